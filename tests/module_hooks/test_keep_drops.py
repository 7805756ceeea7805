"""Streamed blocks' pages are dropped off the compute thread: in one call per run of neighbouring tensors, never
under a block fetched again, and counted once the run's counters are read."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from offload_core import init_empty_weights, load_checkpoint_and_dispatch
from offload_core.module_hooks.align import AlignPerCall, AlignPerCallConfig
from offload_core.storage.inplace import InPlaceStore
from offload_core.storage.pagecache import libc
from offload_core.storage.residency import Residency
from tests.module_hooks.test_keep import DISK, _checkpoint, _generate, _model

pytestmark = pytest.mark.skipif(libc() is None or not hasattr(os, "posix_fadvise"), reason="needs madvise/fadvise")


def _dispatched(folder, residency=None):
    """The checkpoint read in place, layers 0, 1 and 3 streamed block by block."""
    with init_empty_weights():
        model = _model()
    policy = AlignPerCall(AlignPerCallConfig(granularity="block"))
    options = dict(policy=policy, no_split_module_classes=["LlamaDecoderLayer"], residency=residency)
    load_checkpoint_and_dispatch(
        model, folder, DISK, execution_device="cpu", progress=False, storage="safetensors", **options
    )
    return model


def _layer(keys) -> str:
    return ".".join(next(iter(keys)).split(".")[:3])


def test_streamed_blocks_are_dropped_on_another_thread_and_never_under_a_block_fetched_again(tmp_path, monkeypatch):
    folder = _checkpoint(tmp_path)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(5))
    expected = _generate(_model(), ids)
    events: list[tuple[str, str, str]] = []  # (what, layer, thread)
    drop_all, warm = InPlaceStore.drop_all, InPlaceStore.warm

    def slow_drop_all(self, names):
        events.append(("drop starts", _layer(names), threading.current_thread().name))
        time.sleep(0.02)  # a slow drop: the compute thread must not wait for it, a fetch of the block must
        dropped = drop_all(self, names)
        events.append(("drop ends", _layer(names), threading.current_thread().name))
        return dropped

    def recording_warm(self, name):
        events.append(("warm", _layer([name]), threading.current_thread().name))
        return warm(self, name)

    monkeypatch.setattr(InPlaceStore, "drop_all", slow_drop_all)
    monkeypatch.setattr(InPlaceStore, "warm", recording_warm)
    model = _dispatched(folder, Residency(budget=0))
    try:
        assert torch.equal(_generate(model, ids), expected)
        counters = model.offload_state.handle.counters()
    finally:
        model.offload_state.remove()
    drops = [e for e in events if e[0] != "warm"]
    assert drops and all(thread != threading.main_thread().name for _, _, thread in drops)
    pending: set[str] = set()
    for what, name, _ in events:
        if what == "drop starts":
            pending.add(name)
        elif what == "drop ends":
            pending.discard(name)
        else:
            assert name not in pending, f"{name} was read in again while its pages were being dropped"
    # every block streamed each pass was dropped, and the counters waited for the last drops
    assert counters["dropped_bytes"] > 0 and counters["streamed_blocks"] == 3


def test_a_layer_whose_tensors_lie_side_by_side_is_dropped_in_one_call(tmp_path, monkeypatch):
    folder = _checkpoint(tmp_path)
    model = _dispatched(folder)
    store = model.offload_state.store
    keys = [k for k in store if k.startswith("model.layers.0.")]
    real, calls = os.posix_fadvise, []

    def spying(fd, start, length, advice):
        calls.append((start, length, advice))
        return real(fd, start, length, advice)

    try:
        for key in keys:
            store.warm(key)
        monkeypatch.setattr(os, "posix_fadvise", spying)
        assert sorted(store.drop_all(keys)) == sorted(keys)
    finally:
        monkeypatch.setattr(os, "posix_fadvise", real)
        model.offload_state.remove()
    assert len(keys) == 9 and len(calls) == 1 and calls[0][2] == os.POSIX_FADV_DONTNEED
    ranges = sorted(store.checkpoint.safetensors_file(store.checkpoint.file_of(k)).byte_range(k) for k in keys)
    assert calls[0][:2] == (ranges[0][0], ranges[-1][1] - ranges[0][0])  # exactly the layer's bytes, edges kept
