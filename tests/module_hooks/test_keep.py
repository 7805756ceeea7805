"""prefetch with a kept set: streamed blocks are dropped after use, kept ones served from the page cache, the kept set
shrinks at the next forward when (faked) available memory falls, and outputs stay bit-identical."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from offload_core.storage.residency import Residency

DISK = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "disk", "model.layers.2": "cpu",
        "model.layers.3": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def _model():
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("pool", [None, True])
def test_streamed_blocks_are_dropped_after_use_and_tokens_match(tmp_path, pool):
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = _generate(_model(), ids)
    model = _model()
    residency = Residency(budget=0)
    dispatch_model(model, DISK, storage="memmap", policy=Prefetch(PrefetchConfig(depth=2, pool=pool)),
                   offload_folder=tmp_path / "off", no_split_module_classes=["LlamaDecoderLayer"], residency=residency)
    try:
        assert torch.equal(_generate(model, ids), expected)
        counters = model.offload_state.handle.counters()
    finally:
        model.offload_state.remove()
    assert counters["streamed_blocks"] == 3 and counters["kept_blocks"] == 0
    assert counters["kept_served_bytes"] == 0
    assert counters["dropped_bytes"] >= 4 * counters["streamed_bytes"] // 2  # each of the 4 forwards dropped them


def test_kept_blocks_are_served_from_the_cache_and_shrink_under_pressure(tmp_path):
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = _generate(_model(), ids)
    free = {"bytes": 1 << 40}
    residency = Residency(budget=1 << 40, available=lambda: free["bytes"], margin=0)
    model = _model()
    dispatch_model(model, DISK, storage="memmap", policy=Prefetch(PrefetchConfig(depth=1)),
                   offload_folder=tmp_path / "off", no_split_module_classes=["LlamaDecoderLayer"], residency=residency)
    try:
        with torch.no_grad():
            model(ids)
        counters = model.offload_state.handle.counters()
        assert counters["kept_blocks"] == 3 and counters["dropped_bytes"] == 0 and counters["kept_served_bytes"] > 0
        free["bytes"] = counters["kept_bytes"] // 3  # another process grew: one block's room is left
        assert torch.equal(_generate(model, ids), expected)
        counters = model.offload_state.handle.counters()
    finally:
        model.offload_state.remove()
    assert counters["kept_shrinks"] == 1 and counters["kept_blocks"] == 1 and counters["streamed_blocks"] == 2
    assert counters["kept_shrunk_bytes"] > 0 and counters["dropped_bytes"] > 0
