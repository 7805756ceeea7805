"""prefetch: the recorded trace, look-ahead hits, invalidation on a changed order, and bounded in-flight work."""

from __future__ import annotations

import pytest
import torch

from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig, Trace
from tests.module_hooks.prefetch_model import DISK, dispatched
from tests.module_hooks.prefetch_model import tiny_llama as _model


def test_trace_records_a_cycle_and_predicts_ahead():
    trace = Trace()
    assert [trace.observe(u) for u in (0, 1, 2, 3)] == [False] * 4
    assert trace.observe(0) is True and trace.complete
    assert trace.upcoming(2) == [1, 2]
    assert trace.observe(1) and trace.upcoming(5) == [2, 3, 0]  # never predicts itself
    assert trace.observe(3) is False  # 2 was expected
    assert trace.invalidations == 1 and not trace.complete and trace.upcoming(2) == []
    for u in (0, 1, 2):
        trace.observe(u)
    assert trace.observe(3) is True and trace.order == [3, 0, 1, 2]


def test_prefetch_hits_after_the_first_pass_and_matches_in_memory(tmp_path):
    reference = _model()
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    model = _model()
    dispatched(model, DISK, Prefetch(PrefetchConfig(depth=2)), tmp_path)
    prefetcher = model.offload_state.handle.prefetcher
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
    assert len(prefetcher.units) == 3
    # First pass records (3 misses, plus the call that closes the cycle), then every load was prefetched.
    assert prefetcher.misses <= 4
    assert prefetcher.hits >= 3 * 6 - 4
    assert len(prefetcher.pending) <= 2
    model.offload_state.remove()


def test_changed_order_invalidates_the_trace_and_stays_correct(tmp_path):
    model = _model()
    reference = _model()
    dispatch_model(
        model,
        DISK,
        storage="pinned_cpu",
        policy=Prefetch(PrefetchConfig(depth=1)),
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    prefetcher = model.offload_state.handle.prefetcher
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids).logits, reference(ids).logits)
        hidden = torch.randn(1, 4, 48)
        position = torch.arange(4)[None]
        emb = model.model.rotary_emb(hidden, position)
        ref_emb = reference.model.rotary_emb(hidden, position)
        # Run one offloaded block out of order: layer 3 when layer 0 was predicted.
        out = model.model.layers[3](hidden, position_embeddings=emb, attention_mask=None)
        ref = reference.model.layers[3](hidden, position_embeddings=ref_emb, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        ref = ref[0] if isinstance(ref, tuple) else ref
        assert torch.equal(out, ref)
        assert prefetcher.trace.invalidations == 1
        assert torch.equal(model(ids).logits, reference(ids).logits)
    model.offload_state.remove()


def test_depth_zero_is_plain_per_block_offload(tmp_path):
    model = _model()
    dispatch_model(
        model,
        DISK,
        storage="pinned_cpu",
        policy=Prefetch(PrefetchConfig(depth=0)),
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    prefetcher = model.offload_state.handle.prefetcher
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
        model(torch.tensor([[1, 2, 3]]))
    assert prefetcher.hits == 0 and not prefetcher.reads_ahead
    model.offload_state.remove()


def test_staging_chunk_is_checked():
    from offload_core.errors import ConfigError

    with pytest.raises(ConfigError, match="staging_chunk"):
        Prefetch(PrefetchConfig(staging_chunk="12 apples"))
    with pytest.raises(ConfigError, match="below 4KiB"):
        Prefetch(PrefetchConfig(staging_chunk=100))
