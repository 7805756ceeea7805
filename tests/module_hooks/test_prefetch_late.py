"""prefetch: a read-ahead its unit had to wait for or read again (late), and read-aheads let go: after they failed,
found no free buffer, or while the compute thread was interrupted waiting for one; every buffer comes back."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import pytest
import torch

import offload_core.module_hooks.prefetch.pool as pool_module
import offload_core.module_hooks.prefetch.prefetcher as prefetcher_module
from offload_core.module_hooks.prefetch import Prefetcher
from offload_core.module_hooks.units import TransferStats
from offload_core.storage.base import MappingStore
from tests.logs import records_of
from tests.module_hooks.prefetch_units import CPU, X, GatedStore, MappedStore, settle, stack
from tests.waits import blocked_in


class _FailingStore(MappingStore):
    """Reading a key in ``failing`` raises, as a read from a vanished file would."""

    def __init__(self, tensors, failing):
        super().__init__(tensors)
        self.failing = set(failing)

    def spec(self, key):
        tensor = super().__getitem__(key)
        return tensor.shape, tensor.dtype

    def __getitem__(self, key):
        if key in self.failing:
            raise OSError(f"cannot read {key}")
        return super().__getitem__(key)


def test_read_aheads_let_go_after_they_failed_or_found_no_buffer_give_back_quietly(monkeypatch):
    """A read-ahead that failed raises when its unit runs; one that found no free buffer is let go when another unit
    runs instead. Either is let go without an error in the future's done callback (concurrent.futures would only
    log it), and every buffer comes back."""
    monkeypatch.setattr(pool_module, "ACQUIRE_TIMEOUT_S", 10.0)
    model, reference, tensors, units = stack(4)
    prefetcher = Prefetcher(units, _FailingStore(tensors, {"1.weight"}), CPU, 1, TransferStats())
    pool = prefetcher.blocks
    try:
        with records_of("concurrent.futures", logging.ERROR) as said:
            prefetcher.load(0)
            _settle_quietly(prefetcher)
            prefetcher.release(0)
            with pytest.raises(OSError, match="cannot read 1.weight"):
                prefetcher.load(1)
            held, _, _ = pool.acquire()  # with unit 0 held below, unit 1's read-ahead finds no buffer
            prefetcher.load(0)
            _settle_quietly(prefetcher)
            assert [f.complete for _, _, f in prefetcher.pending.values()] == [False]
            prefetcher.release(0)
            prefetcher.load(3)  # not the unit read ahead: a miss lets it go
            pool.release(held)
            with torch.no_grad():
                assert torch.equal(model[3](X), reference[3](X))
            prefetcher.release(3)
        assert said == []
        assert not any(pool.refs) and sorted(pool.free) == [0, 1]
    finally:
        prefetcher.close()


def _settle_quietly(prefetcher):
    """Wait for every read-ahead in flight to end, however it ends."""
    for future, _, _ in prefetcher.pending.values():
        future.exception(timeout=30)


def test_a_read_ahead_still_in_flight_when_its_unit_runs_is_waited_for_and_counted_late():
    model, reference, tensors, units = stack(2)
    store = GatedStore(tensors, {"1.bias"})
    prefetcher = Prefetcher(units, store, CPU, 1, TransferStats())
    compute = threading.Thread(target=prefetcher.load, args=(1,))
    try:
        prefetcher.load(0)
        assert store.reading.wait(30)  # unit 1's read-ahead is stalled in its read
        prefetcher.release(0)
        compute.start()
        blocked_in(compute, "result")  # unit 1 runs: it waits for the read-ahead, not reading again
        store.gate.set()
        compute.join(30)
        assert not compute.is_alive()
        with torch.no_grad():
            assert torch.equal(model[1](X), reference[1](X))
        assert (prefetcher.hits, prefetcher.misses, prefetcher.late) == (1, 1, 1) and prefetcher.waited_s > 0
    finally:
        store.gate.set()
        if compute.ident is not None:
            compute.join(30)
        prefetcher.close()


def test_a_read_ahead_without_a_buffer_is_read_when_its_unit_runs_and_the_others_are_let_go(monkeypatch):
    """Depth 2: 3 buffers, the test holds one and unit 0 another; unit 1's read-ahead takes the last, unit 2's finds
    none. Unit 2 runs next: it is read now (late), and unit 1's read-ahead is let go so that its buffer is free."""
    monkeypatch.setattr(pool_module, "ACQUIRE_TIMEOUT_S", 10.0)
    model, reference, store, units = stack(4)
    prefetcher = Prefetcher(units, store, CPU, 2, TransferStats())
    pool = prefetcher.blocks
    held, _, _ = pool.acquire()
    try:
        prefetcher.load(0)
        settle(prefetcher)
        assert {i: f.complete for i, (_, _, f) in prefetcher.pending.items()} == {1: True, 2: False}
        unit_1 = prefetcher.pending[1]
        prefetcher.release(0)
        prefetcher.load(2)
        assert unit_1[1].is_set() and unit_1[2].buffers == [] and sorted(prefetcher.pending) == [3]
        with torch.no_grad():
            assert torch.equal(model[2](X), reference[2](X))
        assert (prefetcher.misses, prefetcher.hits, prefetcher.late) == (1, 1, 1)
        settle(prefetcher)
        prefetcher.release(2)
    finally:
        pool.release(held)
        prefetcher.close()


class _InterruptedWait(Future):
    """A read-ahead not started yet whose wait the user interrupts (Ctrl-C while the compute thread waits)."""

    def result(self, timeout=None):
        raise KeyboardInterrupt


def test_ctrl_c_while_waiting_for_a_read_ahead_lets_it_go_and_gives_its_buffers_back():
    model, reference, store, units = stack(2)
    prefetcher = Prefetcher(units, store, CPU, 1, TransferStats())
    try:
        prefetcher.load(0)
        settle(prefetcher)
        _, dropped, fetched = prefetcher.pending[1]
        assert len(fetched.buffers) == 1  # the read-ahead holds a buffer
        waited = _InterruptedWait()
        prefetcher.pending[1] = (waited, dropped, fetched)
        prefetcher.release(0)
        with pytest.raises(KeyboardInterrupt):
            prefetcher.load(1)
        assert waited.cancelled() and dropped.is_set() and fetched.buffers == []
        assert not any(prefetcher.block_pool.refs) and prefetcher.pending == {}
    finally:
        prefetcher.close()


def test_a_read_ahead_evicted_before_its_unit_runs_is_read_again_then(monkeypatch):
    """Mapped pages read ahead for units 1 and 2 go before each runs: the compute thread reads them again at once (one
    read, not page faults while it computes), each counted as read again and late."""
    evicted = set()
    monkeypatch.setattr(prefetcher_module, "resident", lambda tensor: tensor.data_ptr() not in evicted)
    model, reference, tensors, units = stack(3)
    store = MappedStore(tensors)
    prefetcher = Prefetcher(units, store, CPU, 1, TransferStats())
    try:
        prefetcher.load(0)
        for index in (1, 2):
            settle(prefetcher)
            evicted.add(store[f"{index}.weight"].data_ptr())
            prefetcher.release(index - 1)
            store.warmed.clear()
            prefetcher.load(index)
            # read again, every key of the fetch, on this thread
            assert store.warmed[:2] == [f"{index}.weight", f"{index}.bias"]
            with torch.no_grad():
                assert torch.equal(model[index](X), reference[index](X))
        assert (prefetcher.hits, prefetcher.reread, prefetcher.late) == (2, 2, 2)
    finally:
        prefetcher.close()
