"""prefetch on a real GPU from a pinned store: the compute thread issues the read-ahead copies itself (no reader
thread), decoding gives the in-memory model's tokens, and no unit waited for its copies or for a pool buffer;
skipped without CUDA."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from offload_core.module_hooks.reader import THREAD_PREFIX

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = LlamaConfig(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    tie_word_embeddings=False,
)
MAP = {
    "model.embed_tokens": 0,
    **{f"model.layers.{i}": "cpu" if i % 3 else 0 for i in range(6)},
    "model.norm": 0,
    "model.rotary_emb": 0,
    "lm_head": 0,
}


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG, dtype=torch.bfloat16).eval()


def test_pinned_prefetch_issues_copies_inline_and_matches_in_memory():
    ids = torch.randint(0, 1024, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False}
    with torch.no_grad():
        expected = _model().cuda().generate(ids, **kwargs)
    model = _model()
    dispatch_model(model, MAP, storage="pinned_cpu", policy=Prefetch(PrefetchConfig(depth=2)))
    prefetcher = model.offload_state.handle.prefetcher
    assert prefetcher.inline
    try:
        with torch.no_grad():
            model.generate(ids, **kwargs)  # records the order
            late, misses = prefetcher.late, prefetcher.misses
            tokens = model.generate(ids, **kwargs)
        assert torch.equal(tokens, expected)
        assert (prefetcher.late, prefetcher.misses, prefetcher.block_pool.waits) == (late, misses, 0)
        assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX + "prefetch")]
    finally:
        model.offload_state.remove()
