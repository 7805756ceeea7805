"""A Prefetcher driven unit by unit, as its hooks drive it: which units are read ahead after each load (module order,
then along the trace), the counters it keeps, and a read-ahead that found every block buffer held (read when its
unit runs: the pool's minimum-size guarantee)."""

from __future__ import annotations

import itertools
import threading
import types

import torch
from torch import nn

import offload_core.module_hooks.prefetch.pool as pool_module
import offload_core.module_hooks.prefetch.prefetcher as prefetcher_module
from offload_core.module_hooks.prefetch import Prefetcher
from offload_core.module_hooks.units import TransferStats, find_units
from offload_core.storage.base import MappingStore
from tests.module_hooks.prefetch_units import CPU, X, GatedStore, MappedStore, settle, stack
from tests.waits import blocked_in


def test_read_ahead_follows_module_order_then_the_trace_and_keeps_what_is_still_expected():
    model, reference, store, units = stack()
    stats = TransferStats()
    prefetcher = Prefetcher(units, store, CPU, 2, stats)
    try:
        prefetcher.load(0)
        assert sorted(prefetcher.pending) == [1, 2]  # no trace yet: the next two in module order
        settle(prefetcher)
        second = prefetcher.pending[2][0]
        prefetcher.release(0)
        prefetcher.load(1)
        assert sorted(prefetcher.pending) == [2, 3] and prefetcher.pending[2][0] is second  # 2 kept, not read again
        with torch.no_grad():
            assert torch.equal(model[1](X), reference[1](X))
        settle(prefetcher)
        prefetcher.release(1)
        for index in (2, 3):
            prefetcher.load(index)
            settle(prefetcher)
            prefetcher.release(index)
        assert prefetcher.pending == {}  # unit 3 is the last in module order: nothing after it
        prefetcher.load(0)  # closes the cycle: from here along the trace (0 -> 1 -> 2 -> 3)
        assert sorted(prefetcher.pending) == [1, 2] and prefetcher.trace.complete
        settle(prefetcher)
        prefetcher.release(0)
        prefetcher.release(0)  # a second release (a hook's error path) finds nothing held: no error
        unit_1 = prefetcher.pending[1]
        prefetcher.load(2)  # 1 was expected: the trace is dropped; 2 was read ahead (a hit), 1 is let go
        assert prefetcher.trace.invalidations == 1 and sorted(prefetcher.pending) == [3] and unit_1[1].is_set()
        settle(prefetcher)
        prefetcher.release(2)
        # misses: unit 0 twice (nothing was read ahead for it); hits: 1, 2, 3, then 2
        assert (prefetcher.misses, prefetcher.hits, prefetcher.late, prefetcher.borrowed) == (2, 4, 0, 0)
        # each load counts its unit's two tensors and 64 + 16 bytes
        assert (stats.loads, stats.bytes) == (2 * 6, 80 * 6)
        assert prefetcher.held == {} and not any(u.loaded for u in units)
    finally:
        prefetcher.close()
    assert prefetcher.pending == {} and prefetcher.block_pool is None


def test_a_read_ahead_that_found_every_buffer_held_is_read_when_its_unit_runs(monkeypatch):
    """Depth 1 on a plain stack: 2 buffers. The test holds one, the unit running the other: each read-ahead is handed
    back unread (no free buffer, and a reader never waits), and its unit is read when it runs, late."""
    monkeypatch.setattr(pool_module, "ACQUIRE_TIMEOUT_S", 10.0)  # a read that waits on the reader fails, not hangs
    clock = itertools.count()  # each perf_counter() call one second on: a late load waits 1 s
    monkeypatch.setattr(prefetcher_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    model, reference, store, units = stack(3)
    prefetcher = Prefetcher(units, store, CPU, 1, TransferStats())
    pool = prefetcher.blocks
    assert pool.count == 2
    held, _, _ = pool.acquire()
    try:
        prefetcher.load(0)  # a miss: it takes the last free buffer
        settle(prefetcher)
        assert [f.complete for _, _, f in prefetcher.pending.values()] == [False]  # unit 1: none free
        assert pool.refs[1 - held] == 1  # ... and it holds none
        prefetcher.release(0)
        for index in (1, 2):
            prefetcher.load(index)  # scheduled, but read now: late
            with torch.no_grad():
                assert torch.equal(model[index](X), reference[index](X))
            settle(prefetcher)
            prefetcher.release(index)
        assert (prefetcher.misses, prefetcher.hits, prefetcher.late) == (1, 2, 2)
        assert prefetcher.waited_s == 2.0
        assert pool.peak_in_use == 2 and pool.refs[held] == 1 and pool.refs[1 - held] == 0
    finally:
        pool.release(held)
        prefetcher.close()


class _ReadIntoStore(MappingStore):
    """A store that tells shapes without reading (``spec``) and reads into a buffer given (``read_into``, as the
    converting stores do); records which way each tensor was read."""

    reads_into = True

    def __init__(self, tensors):
        super().__init__(tensors)
        self.reads = []

    def spec(self, key):
        return super().__getitem__(key).shape, super().__getitem__(key).dtype

    def __getitem__(self, key):
        self.reads.append(("getitem", key))
        return super().__getitem__(key)

    def read_into(self, key, out):
        self.reads.append(("read_into", key))
        out.copy_(super().__getitem__(key))


def test_on_a_cpu_a_store_that_reads_into_a_buffer_is_read_straight_into_the_pool():
    model, reference, tensors, units = stack(2)
    store = _ReadIntoStore(tensors)
    prefetcher = Prefetcher(units, store, CPU, 0, TransferStats())
    try:
        prefetcher.load(1)
        with torch.no_grad():
            assert torch.equal(model[1](X), reference[1](X))
        assert store.reads == [("read_into", "1.weight"), ("read_into", "1.bias")]
    finally:
        prefetcher.close()


def test_through_the_staging_ring_a_store_is_read_chunk_by_chunk():
    """staging on (the GPU path, run on a CPU): each tensor crosses the ring from ``store[key]``, 4 KiB at a time:
    a 32 x 64 float32 weight is 8 KiB (2 chunks), its bias 256 bytes (1 chunk)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    store = _ReadIntoStore({name: torch.randn(t.shape) for name, t in model.state_dict().items()})
    units = find_units(model, {name: name for name in store}, [], "block")
    prefetcher = Prefetcher(units, store, CPU, 0, TransferStats(), copy=True, staging=True, staging_chunk=4096)
    try:
        prefetcher.load(0)
        assert torch.equal(model[0].weight, store["0.weight"]) and torch.equal(model[0].bias, store["0.bias"])
        assert [how for how, _ in store.reads] == ["getitem"] * 4  # the two reads above and the two copies
        assert prefetcher.staging.chunks == 3
    finally:
        prefetcher.close()


def test_on_a_cpu_a_mapped_store_is_served_in_place_unless_copying_is_asked():
    model, reference, tensors, units = stack(2)
    store = MappedStore(tensors)
    stats = TransferStats()
    prefetcher = Prefetcher(units, store, CPU, 0, stats)
    try:
        prefetcher.load(1)
        assert model[1].weight.data_ptr() == store["1.weight"].data_ptr()  # the store's memory, not a copy
        assert prefetcher.held[1].mapped == ["1.weight", "1.bias"] and store.warmed == ["1.weight", "1.bias"]
        assert prefetcher.block_pool is None and (stats.loads, stats.bytes) == (2, 64 + 16)  # paged in: moved
    finally:
        prefetcher.close()
    copying = Prefetcher(units, store, CPU, 0, TransferStats(), copy=True)
    try:
        copying.load(0)
        assert copying.held[0].mapped == [] and copying.block_pool.allocated_bytes == 512
        with torch.no_grad():
            assert torch.equal(model[0](X), reference[0](X))
    finally:
        copying.close()


def test_a_miss_waits_for_the_buffer_of_a_read_ahead_it_let_go_while_in_flight(monkeypatch):
    """2 buffers: unit 0 holds one, unit 1's read-ahead the other, stalled in its read. Unit 2 runs instead (a
    miss): unit 1's read is let go, and the miss waits for the buffer it gives back when its read ends."""
    monkeypatch.setattr(pool_module, "ACQUIRE_TIMEOUT_S", 30.0)
    model, reference, tensors, units = stack(3)
    store = GatedStore(tensors, {"1.weight"})
    prefetcher = Prefetcher(units, store, CPU, 1, TransferStats())
    errors = []

    def run_unit_2():
        try:
            prefetcher.load(2)
        except Exception as error:  # reported by the test below
            errors.append(error)

    compute = threading.Thread(target=run_unit_2)
    try:
        prefetcher.load(0)
        assert store.reading.wait(30) and sorted(prefetcher.pending) == [1]
        compute.start()
        blocked_in(compute, "acquire")  # waiting for a buffer: none is free until unit 1's read ends
        assert prefetcher.pending == {}  # unit 1's read-ahead was let go
        store.gate.set()
        compute.join(30)
        assert not compute.is_alive() and errors == []
        with torch.no_grad():
            assert torch.equal(model[2](X), reference[2](X))
        assert prefetcher.misses == 2 and prefetcher.hits == 0 and prefetcher.block_pool.peak_in_use == 2
    finally:
        store.gate.set()
        if compute.ident is not None:
            compute.join(30)
        prefetcher.close()


class _Params(nn.Module):
    def __init__(self, *names):
        super().__init__()
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.zeros(4)))


def test_a_tied_tensor_brought_in_after_a_fetch_was_scheduled_is_borrowed_when_it_runs():
    """Store keys shared between units (tied tensors): unit 0 holds x and a, unit 1 b and y, unit 2 a, b and c. When
    unit 0 runs, units 1 and 2 are scheduled: unit 2 borrows a at once (unit 0 holds it); b is brought in by unit 1's
    fetch, which the reader does just before unit 2's: unit 2 borrows it then, and copies only c."""
    model = nn.Sequential(_Params("p", "q"), _Params("p", "q"), _Params("p", "q", "r"))
    keys = {"0.p": "x", "0.q": "a", "1.p": "b", "1.q": "y", "2.p": "a", "2.q": "b", "2.r": "c"}
    # unit 1's read of b waits until unit 2 is scheduled (else the reader may bring b in before)
    store = GatedStore({key: torch.full((4,), float(i)) for i, key in enumerate("xabyc")}, {"b"})
    units = find_units(model, keys, [], "block")
    assert [u.keys for u in units] == [["x", "a"], ["b", "y"], ["a", "b", "c"]]
    stats = TransferStats()
    prefetcher = Prefetcher(units, store, CPU, 2, stats)
    try:
        prefetcher.load(0)
        assert sorted(prefetcher.pending) == [1, 2] and prefetcher.borrowed == 1  # a, as unit 2 was scheduled
        store.gate.set()
        settle(prefetcher)
        assert prefetcher.borrowed == 2  # b, as unit 2 was fetched
        assert prefetcher.pending[2][2].moved == 16  # c only: 4 float32
        prefetcher.load(1)
        prefetcher.load(2)
        block = model[2]
        assert [block.p.data_ptr(), block.q.data_ptr()] == [model[0].q.data_ptr(), model[1].p.data_ptr()]
        assert [block.p[0].item(), block.q[0].item(), block.r[0].item()] == [1.0, 2.0, 4.0]
        assert stats.bytes == 32 + 32 + 16 and prefetcher.block_pool.peak_in_use == 3
    finally:
        store.gate.set()
        prefetcher.close()
