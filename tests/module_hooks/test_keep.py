"""Every policy that streams blocks, with a kept set: streamed blocks are dropped after use, kept ones served from the
page cache, the kept set shrinks at the next forward when (faked) available memory falls, and outputs stay
bit-identical."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import offload_core
from offload_core import dispatch_model, init_empty_weights, load_checkpoint_and_dispatch
from offload_core.errors import ConfigError
from offload_core.module_hooks.align import AlignPerCall, AlignPerCallConfig
from offload_core.module_hooks.chained import Chained, ChainedConfig
from offload_core.module_hooks.functional import FunctionalCall, FunctionalCallConfig
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig, Prefetcher
from offload_core.storage.base import Store
from offload_core.storage.residency import Residency

DISK = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


def _model():
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _checkpoint(tmp_path):
    """The model saved as transformers saves it (the safetensors store reads it in place)."""
    folder = tmp_path / "ckpt"
    _model().save_pretrained(folder)
    return folder


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)


#: every policy that streams blocks, by name: a fresh policy each time
POLICIES = {
    "prefetch": lambda: Prefetch(PrefetchConfig(depth=2)),
    "prefetch_pool": lambda: Prefetch(PrefetchConfig(depth=1, pool=True)),
    "align_per_call": lambda: AlignPerCall(AlignPerCallConfig(granularity="block")),
    "align_per_call_module": lambda: AlignPerCall(AlignPerCallConfig()),
    "chained": lambda: Chained(ChainedConfig()),
    "functional_call": lambda: FunctionalCall(FunctionalCallConfig()),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("storage", ["memmap", "safetensors"])
def test_streamed_blocks_are_dropped_after_use_and_tokens_match(tmp_path, policy, storage):
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = _generate(_model(), ids)
    residency = Residency(budget=0)
    options = dict(
        storage=storage, policy=POLICIES[policy](), no_split_module_classes=["LlamaDecoderLayer"], residency=residency
    )
    if storage == "memmap":
        model = dispatch_model(_model(), DISK, offload_folder=tmp_path / "off", **options)
    else:  # the checkpoint as transformers saves it, read in place
        with init_empty_weights():
            model = _model()
        load_checkpoint_and_dispatch(
            model, _checkpoint(tmp_path), DISK, execution_device="cpu", progress=False, **options
        )
    try:
        assert torch.equal(_generate(model, ids), expected)
        counters = model.offload_state.handle.counters()
    finally:
        model.offload_state.remove()
    assert counters["kept_blocks"] == 0 and counters["streamed_blocks"] >= 3
    assert counters["kept_served_bytes"] == 0
    assert counters["dropped_bytes"] >= 4 * counters["streamed_bytes"] // 2  # each of the 4 forwards dropped them


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_kept_blocks_are_served_from_the_cache_and_shrink_under_pressure(tmp_path, policy):
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = _generate(_model(), ids)
    free = {"bytes": 1 << 40}
    residency = Residency(budget=1 << 40, available=lambda: free["bytes"], margin=0)
    model = _model()
    dispatch_model(
        model,
        DISK,
        storage="memmap",
        policy=POLICIES[policy](),
        offload_folder=tmp_path / "off",
        no_split_module_classes=["LlamaDecoderLayer"],
        residency=residency,
    )
    try:
        with torch.no_grad():
            model(ids)
        counters = model.offload_state.handle.counters()
        units = counters["kept_blocks"]
        assert units >= 3 and counters["streamed_blocks"] == 0
        assert counters["dropped_bytes"] == 0 and counters["kept_served_bytes"] >= counters["kept_bytes"]
        free["bytes"] = counters["kept_bytes"] // 3  # another process grew: a third of the kept set's room is left
        assert torch.equal(_generate(model, ids), expected)
        counters = model.offload_state.handle.counters()
    finally:
        model.offload_state.remove()
    assert counters["kept_shrinks"] == 1 and counters["kept_bytes"] <= free["bytes"]
    assert counters["kept_blocks"] + counters["streamed_blocks"] == units and counters["streamed_blocks"] > 0
    assert counters["kept_shrunk_bytes"] > 0 and counters["dropped_bytes"] > 0


class _RecordingStore(Store):
    """The run's store, calling ``on_warm(key)`` whenever the reader brings a tensor in."""

    def __init__(self, inner, on_warm):
        self.inner, self.on_warm = inner, on_warm

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __getitem__(self, key):
        return self.inner[key]

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def warm(self, key):
        self.on_warm(key)
        return self.inner.warm(key)

    def drop(self, key):
        return self.inner.drop(key)


def test_the_reader_reads_the_next_streamed_block_while_a_kept_one_is_next(tmp_path):
    """Layers 0-3 offloaded, layers 1 and 3 kept: with depth 1, layer 2 (streamed) is read while layer 0
    runs, because layer 1 (kept) costs no read; counting layer 1 against the depth would leave the disk
    idle until layer 1 starts."""
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    expected = _generate(_model(), ids)
    model = _model()
    layer2_read = threading.Event()

    def on_warm(key):
        if key.startswith("model.layers.2."):
            layer2_read.set()

    class Recording(Prefetch):
        def make_prefetcher(self, units, plan):
            return Prefetcher(
                units,
                _RecordingStore(plan.store, on_warm),
                plan.execution_device,
                self.config.depth,
                plan.stats,
                residency=plan.residency,
            )

    block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    residency = Residency(budget=block * 5 // 2)  # two of the four blocks, spread: layers 1 and 3
    dispatch_model(
        model,
        {**DISK, "model.layers.2": "disk"},
        storage="memmap",
        policy=Recording(PrefetchConfig(depth=1)),
        offload_folder=tmp_path / "off",
        no_split_module_classes=["LlamaDecoderLayer"],
        residency=residency,
    )
    handle = model.offload_state.handle
    assert list(residency.kept) == ["model.layers.1", "model.layers.3"]
    seen = []

    def layer0_ran(*_):  # each forward: was layer 2 read while layer 0 ran? then wait for the next pass's read
        seen.append(layer2_read.wait(timeout=10))
        layer2_read.clear()

    model.model.layers[0].register_forward_hook(layer0_ran)
    try:
        assert torch.equal(_generate(model, ids), expected)
        counters = handle.counters()
    finally:
        model.offload_state.remove()
    assert seen and all(seen), "layer 2 was not read while layer 0 ran: the kept layer 1 held the read-ahead back"
    assert counters["kept_served_bytes"] > 0 and counters["dropped_bytes"] > 0


@pytest.mark.parametrize("page_cache,kept", [(0, False), ("1GiB", True)])
def test_from_pretrained_takes_a_page_cache(tmp_path, page_cache, kept):
    """The Python API plans the kept set as run.py does: ``page_cache=0`` streams every block, a size keeps them."""
    folder = _checkpoint(tmp_path)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(4))
    expected = _generate(_model(), ids)
    model = offload_core.from_pretrained(
        folder,
        offload={
            "device_map": DISK,
            "storage": "safetensors",
            "policy": "align_per_call",
            "execution_device": "cpu",
            "page_cache": page_cache,
        },
    )
    try:
        assert torch.equal(_generate(model, ids), expected)
        counters = model.offload_state.handle.counters()
    finally:
        model.offload_state.remove()
    assert (counters["kept_blocks"] > 0) is kept and counters["streamed_blocks"] + counters["kept_blocks"] >= 3
    assert (counters["dropped_bytes"] > 0) is not kept


def test_from_pretrained_refuses_a_page_cache_it_cannot_read(tmp_path):
    with pytest.raises(ConfigError, match="page_cache"):
        offload_core.from_pretrained(
            _checkpoint(tmp_path), offload={"device_map": DISK, "storage": "safetensors", "page_cache": "lots"}
        )
