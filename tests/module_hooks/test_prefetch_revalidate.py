"""prefetch: what a forward pass's start (``Prefetcher.revalidate``) does with the read-ahead of the pass before it:
only a read-ahead whose pages went is handed to the reader again, and a kept set that shrinks drops the pages of the
blocks that left it, except those being read ahead."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

import offload_core.module_hooks.prefetch.prefetcher as prefetcher_module
from offload_core import dispatch_model
from offload_core.module_hooks.prefetch import Prefetch, PrefetchConfig
from offload_core.module_hooks.reader import THREAD_PREFIX
from offload_core.storage.residency import Residency
from tests.module_hooks.prefetch_model import DISK
from tests.module_hooks.prefetch_model import tiny_llama as _model

IDS = torch.tensor([[5, 6, 7, 8]])


def _dispatched(tmp_path, depth, residency=None):
    """Layers 0, 1 and 3 streamed from a memmap folder (units 0, 1, 2), after two passes: the trace is recorded and
    the next pass's first units are read ahead (their reads done)."""
    model = _model()
    dispatch_model(
        model,
        DISK,
        storage="memmap",
        policy=Prefetch(PrefetchConfig(depth=depth)),
        offload_folder=tmp_path / "off",
        no_split_module_classes=["LlamaDecoderLayer"],
        residency=residency,
    )
    prefetcher = model.offload_state.handle.prefetcher
    with torch.no_grad():
        model(IDS)
        model(IDS)
    for future, _, _ in prefetcher.pending.values():
        future.result()
    return model, prefetcher


def test_only_the_read_ahead_whose_pages_went_is_read_again(tmp_path, monkeypatch):
    reference = _model()
    model, prefetcher = _dispatched(tmp_path, depth=2)
    # After layer 3 (unit 2) ran, the next two along the trace: units 0 and 1, served as mapped pages
    assert sorted(prefetcher.pending) == [0, 1] and all(f.mapped for _, _, f in prefetcher.pending.values())
    before = dict(prefetcher.pending)
    first = before[0][2]
    evicted = {first.tensors[key].data_ptr() for key in first.mapped}  # unit 0's pages went; unit 1's did not
    monkeypatch.setattr(prefetcher_module, "resident", lambda tensor: tensor.data_ptr() not in evicted)
    reread = prefetcher.reread
    prefetcher.revalidate()
    assert prefetcher.reread == reread + 1
    assert prefetcher.pending[1] == before[1]  # untouched: the same future, event and fetch
    future, dropped, fetched = prefetcher.pending[0]
    assert future is not before[0][0] and dropped is before[0][1] and fetched is first
    assert future.result() is first  # the reader read the same fetch's pages in again
    evicted.clear()
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
    finally:
        model.offload_state.remove()


def test_a_read_ahead_still_in_flight_or_failed_is_left_alone(tmp_path, monkeypatch):
    """Every page gone, but unit 0's read failed and unit 1's is still in flight: neither is handed to the reader
    again (the failure is raised when unit 0 runs; the read in flight reads the pages itself)."""
    model, prefetcher = _dispatched(tmp_path, depth=2)
    monkeypatch.setattr(prefetcher_module, "resident", lambda tensor: False)
    failed, in_flight = Future(), Future()
    failed.set_exception(OSError("the read failed"))
    for index, future in ((0, failed), (1, in_flight)):
        prefetcher.pending[index] = (future, *prefetcher.pending[index][1:])
    reread = prefetcher.reread
    prefetcher.revalidate()
    assert prefetcher.reread == reread
    assert prefetcher.pending[0][0] is failed and prefetcher.pending[1][0] is in_flight
    model.offload_state.remove()  # the read in flight is cancelled, the failed one let go
    assert in_flight.cancelled() and not prefetcher.pending


def test_a_shrinking_kept_set_drops_the_blocks_that_left_it_except_those_read_ahead(tmp_path):
    free = {"bytes": 1 << 40}
    residency = Residency(budget=1 << 40, available=lambda: free["bytes"], margin=0)
    model, prefetcher = _dispatched(tmp_path, depth=1, residency=residency)
    assert list(residency.kept) == ["model.layers.0", "model.layers.1", "model.layers.3"]
    # every block kept and in memory after a pass: none is handed to the reader, each is checked where it runs
    assert not prefetcher.pending
    assert prefetcher.keeper.warm is False  # the reader brings the pages in, not the compute thread as a unit loads
    block = residency.kept["model.layers.0"]  # the three blocks are the same size
    free["bytes"] = block  # room for one block: layers 3, then 1 leave the kept set (from its end)
    dropped = residency.dropped
    prefetcher.revalidate()
    assert list(residency.kept) == ["model.layers.0"] and list(residency.streamed) == [
        "model.layers.1",
        "model.layers.3",
    ]
    # layer 3's pages go at once (its tensors' bytes); layer 1, next in the pass starting, is read ahead: its pages stay
    assert sorted(prefetcher.pending) == [1]
    layer3 = sum(
        prefetcher.store[key].numel() * prefetcher.store[key].element_size() for key in prefetcher.units[2].keys
    )
    assert prefetcher.units[2].name == "model.layers.3" and residency.dropped - dropped == layer3
    model.offload_state.remove()


def test_with_every_block_streamed_the_window_is_depth_blocks(tmp_path):
    """The window rides over kept blocks only: with none kept, depth 1 reads one block ahead (unit 0 for the next
    pass), not both."""
    model, prefetcher = _dispatched(tmp_path, depth=1, residency=Residency(budget=0))
    assert not prefetcher.residency.kept and sorted(prefetcher.pending) == [0]
    model.offload_state.remove()


def _reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX + "prefetch")]


def test_kept_blocks_in_memory_are_checked_where_they_run_and_read_ahead_again_once_their_pages_go(
    tmp_path, monkeypatch
):
    """A warm run keeps every block: after the first pass none goes through the reader (its wake-ups for each block
    slowed a two-core decode by a quarter); a block whose pages the page cache let go of is read ahead again."""
    reference = _model()
    model, prefetcher = _dispatched(tmp_path, depth=1, residency=Residency(budget=1 << 40))
    hits, misses = prefetcher.hits, prefetcher.misses
    with torch.no_grad():
        model(IDS)
    assert not prefetcher.pending and (prefetcher.hits, prefetcher.misses) == (hits + 3, misses)
    assert not _reader_threads()  # with nothing to read, its thread ended
    gone = {prefetcher.store[key].data_ptr() for key in prefetcher.units[0].keys}  # unit 0's pages went
    monkeypatch.setattr(prefetcher_module, "resident", lambda tensor: tensor.data_ptr() not in gone)
    # a settled unit's pages are checked by the address ranges they span (one mincore per range)
    monkeypatch.setattr(
        prefetcher_module,
        "spans_resident",
        lambda spans: not any(start <= ptr < start + length for ptr in gone for start, length in spans),
    )
    prefetcher.revalidate()
    assert list(prefetcher.pending) == [0] and _reader_threads()  # the pass's first block, handed to a new reader
    gone.clear()
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
        assert not prefetcher.pending and prefetcher.misses == misses
    finally:
        model.offload_state.remove()


def test_a_warm_pass_over_kept_blocks_asks_the_store_nothing_and_checks_each_block_once(tmp_path, monkeypatch):
    """What a warm in-memory run does not pay, a warm pass over settled blocks does not either: no store look-up, no
    page check per tensor as a block loads, the same parameters handed over pass after pass; the pass's start asks
    the page cache once per block (one ``mincore`` per range of neighbouring pages)."""
    reference = _model()
    model, prefetcher = _dispatched(tmp_path, depth=1, residency=Residency(budget=1 << 40))
    store_calls, checks = [], []
    for name in ("__getitem__", "warm", "offset"):
        original = getattr(type(prefetcher.store), name)

        def counted(self, key, _original=original, _name=name):
            store_calls.append(_name)
            return _original(self, key)

        monkeypatch.setattr(type(prefetcher.store), name, counted)
    monkeypatch.setattr(prefetcher_module, "resident", lambda tensor: checks.append("tensor") or True)
    spans_resident = prefetcher_module.spans_resident
    monkeypatch.setattr(
        prefetcher_module, "spans_resident", lambda spans: checks.append(len(spans)) or spans_resident(spans)
    )
    given = []
    for unit in prefetcher.units:
        unit.module.register_forward_pre_hook(lambda module, args: given.append(module.self_attn.q_proj.weight))
    try:
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
            assert torch.equal(model(IDS).logits, reference(IDS).logits)
        # two passes, three blocks: each block's pages asked once per pass (its ranges: a file per tensor here)
        assert store_calls == [] and len(checks) == 6 and "tensor" not in checks
        assert all(given[i] is given[i + 3] for i in range(3))  # the same parameter objects, pass after pass
        assert {p.device.type for unit in prefetcher.units for p in unit.module.parameters()} == {"meta"}  # let go
    finally:
        model.offload_state.remove()
