"""The block pool's bookkeeping by value: which buffer each acquire gets, the reference counts, what a release frees
(and the tensors published in it), the free events, and that a read gets a buffer or fails loudly, never hangs."""

from __future__ import annotations

import threading

import pytest
import torch

import offload_core.module_hooks.prefetch.pool as pool_module
from offload_core.module_hooks.prefetch import BlockPool

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    """No read here waits for a buffer that long: one that would (a pool that never frees) fails in 5 s, not 300."""
    monkeypatch.setattr(pool_module, "ACQUIRE_TIMEOUT_S", 5.0)


def test_a_new_pool_holds_nothing():
    pool = BlockPool(3, 512, CPU)
    assert (pool.count, pool.capacity, pool.device) == (3, 512, CPU)
    assert pool.refs == [0, 0, 0] and list(pool.free) == [0, 1, 2]
    assert pool.buffers == [None, None, None] and pool.allocated_bytes == 0
    assert pool.peak_in_use == 0 and pool.live == {}


def test_acquire_hands_out_buffers_in_order_and_allocates_each_once():
    pool = BlockPool(2, 512, CPU)
    a, first, event = pool.acquire()
    assert (a, event) == (0, None) and pool.refs == [1, 0] and pool.peak_in_use == 1
    assert first.dtype == torch.uint8 and first.shape == (512,) and pool.allocated_bytes == 512
    b, second, _ = pool.acquire(wait=False)  # a free buffer: a read-ahead gets it too
    assert b == 1 and pool.refs == [1, 1] and pool.peak_in_use == 2 and pool.allocated_bytes == 1024
    assert pool.acquire(wait=False) is None and pool.refs == [1, 1]  # all held: the read-ahead gives up
    pool.release(a)
    assert pool.refs == [0, 1] and list(pool.free) == [0]
    again, buffer, _ = pool.acquire(wait=False)
    assert again == 0 and buffer is first  # kept, not allocated again
    assert pool.allocated_bytes == 1024 and pool.peak_in_use == 2


def test_buffers_are_made_on_the_pool_device_and_outside_inference_mode():
    pool = BlockPool(1, 300, torch.device("meta"))
    with torch.inference_mode():  # as the compute thread may be: weights are views of the buffer, normal tensors
        _, buffer, _ = pool.acquire()
    assert buffer.device.type == "meta" and buffer.dtype == torch.uint8 and buffer.numel() == 300
    assert not buffer.is_inference()


def test_references_count_every_borrower_and_the_last_release_frees():
    pool = BlockPool(2, 256, CPU)
    a, buffer, _ = pool.acquire()
    b, other, _ = pool.acquire()
    w, x = buffer[:16].view(torch.float32), other[:8]
    pool.publish("w", w, a)
    pool.publish("x", x, b)
    assert pool.borrow("w") == (w, a) and pool.refs == [2, 1]
    assert pool.borrow("w") == (w, a) and pool.refs == [3, 1]
    assert pool.borrow("nothing") is None and pool.refs == [3, 1]
    pool.release(a)
    pool.release(a)
    assert pool.refs == [1, 1] and list(pool.free) == [] and pool.borrow("w") == (w, a)  # still held
    pool.release(a)
    pool.release(a)  # the last reference: a is free, and "w" is no longer on the device
    assert pool.refs == [0, 1] and list(pool.free) == [a] and set(pool.live) == {"x"}
    assert pool.borrow("w") is None and pool.borrow("x") == (x, b)  # b's tensor stays published


def test_the_free_event_is_the_last_compute_use_and_is_handed_out_once():
    # On a GPU the events are CUDA events; any object stands for one here.
    pool = BlockPool(1, 64, CPU)
    index, _, _ = pool.acquire()
    pool.release(index, event="used by compute")
    again, _, wait_for = pool.acquire()
    assert (again, wait_for) == (index, "used by compute")
    pool.release(again)  # a holder that never computed records nothing
    _, _, wait_for = pool.acquire()
    assert wait_for is None  # the earlier event was handed out already


def _acquire_in_thread(pool):
    """``pool.acquire()`` on a daemon thread, joined with a bound: what it returned or raised."""
    got = []

    def run():
        try:
            got.append(pool.acquire())
        except RuntimeError as error:
            got.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "acquire neither returned nor failed"
    return got[0]


def test_a_read_that_finds_every_buffer_held_fails_loudly_instead_of_hanging(monkeypatch):
    """The minimum-size guarantee: a pool sized below what is held at once (a wrong size) is an error, at once
    after the timeout, naming the pool: never a read that waits forever."""
    monkeypatch.setattr(pool_module, "ACQUIRE_TIMEOUT_S", 1.0)
    pool = BlockPool(2, 64, CPU)
    pool.acquire()
    pool.acquire()
    error = _acquire_in_thread(pool)
    assert isinstance(error, RuntimeError)
    assert str(error) == "prefetch: no free block buffer after 1 s (2 buffers, all held)"
    assert pool.refs == [1, 1] and pool.peak_in_use == 2


def test_a_waiting_read_gets_the_buffer_released_meanwhile(monkeypatch):
    monkeypatch.setattr(pool_module, "ACQUIRE_TIMEOUT_S", 30.0)
    pool = BlockPool(1, 64, CPU)
    index, _, _ = pool.acquire()
    released = threading.Thread(target=lambda: (waiting.wait(30), pool.release(index, event="done")))
    waiting = threading.Event()

    def wait_for(predicate, timeout=None):  # the waiter has looked once and found no free buffer
        if not predicate():
            waiting.set()
        return original(predicate, timeout)

    original = pool.cond.wait_for
    pool.cond.wait_for = wait_for
    released.start()
    got = _acquire_in_thread(pool)
    released.join(30)
    assert got[0] == index and got[2] == "done" and pool.refs == [1]


@pytest.mark.parametrize("count", [1, 3])
def test_every_buffer_can_be_held_at_once(count):
    pool = BlockPool(count, 32, CPU)
    held = [pool.acquire(wait=False)[0] for _ in range(count)]
    assert held == list(range(count)) and pool.peak_in_use == count and pool.acquire(wait=False) is None
