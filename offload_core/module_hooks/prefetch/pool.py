"""A fixed set of reusable, reference-counted block buffers on the execution device."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

#: a reader waiting this long for a free block buffer means the pool is wrongly sized: fail, never hang
ACQUIRE_TIMEOUT_S = 300.0


class BlockPool:
    """``count`` reusable buffers of ``capacity`` bytes on ``device``, reference-counted.

    A buffer is allocated the first time it is needed and kept. Each fetch holds a reference on the
    buffer it filled and on every buffer it borrowed a tied tensor from; a buffer whose last
    reference goes is free again, after the compute stream is done with it (``free_event``).
    """

    def __init__(self, count: int, capacity: int, device: torch.device) -> None:
        self.count = count
        self.capacity = capacity
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.refs = [0] * count
        self.free_events: list[Any] = [None] * count
        self.free = deque(range(count))
        self.cond = threading.Condition()
        self.peak_in_use = 0
        self.waits = 0  # times the compute thread found every buffer held and waited for one
        #: key -> (tensor view in a buffer, buffer index): what is on the device now, for borrowing
        self.live: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    def acquire(self, wait: bool = True) -> tuple[int, torch.Tensor, Any] | None:
        """A free buffer with one reference; returns (index, buffer, event to wait for).

        Only the compute thread waits (``wait=True``): the buffers it waits for are held by units it has
        loaded (at most the deepest nesting) and by read-aheads, which never wait themselves, so they end
        and give theirs back. A read-ahead (``wait=False``) gets None when every buffer is held: it is
        handed back unread and its unit read when it runs. So no read ever waits on a buffer that only
        a waiting read could give back; a pool sized below the nesting fails loudly instead of hanging.
        """
        with self.cond:
            if not wait and not self.free:
                return None
            self.waits += not self.free
            if not self.cond.wait_for(lambda: self.free, timeout=ACQUIRE_TIMEOUT_S):
                raise RuntimeError(
                    f"prefetch: no free block buffer after {ACQUIRE_TIMEOUT_S:.0f} s ({self.count} buffers, all held)"
                )
            index = self.free.popleft()
            self.refs[index] = 1
            self.peak_in_use = max(self.peak_in_use, self.count - len(self.free))
            event, self.free_events[index] = self.free_events[index], None
        if self.buffers[index] is None:
            with torch.inference_mode(False):  # weights are views of it: normal tensors, as the in-memory model's
                self.buffers[index] = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return index, self.buffers[index], event

    def borrow(self, key: str) -> tuple[torch.Tensor, int] | None:
        """The device copy of ``key`` if a buffer holds it, with one more reference on that buffer."""
        with self.cond:
            hit = self.live.get(key)
            if hit is not None:
                self.refs[hit[1]] += 1
            return hit

    def publish(self, key: str, tensor: torch.Tensor, index: int) -> None:
        with self.cond:
            self.live[key] = (tensor, index)

    def release(self, index: int, event: Any = None) -> None:
        """Drop one reference; the last one frees the buffer (rewritten only after ``event``)."""
        with self.cond:
            if event is not None:  # the latest point the compute stream used it (a later holder may not have)
                self.free_events[index] = event
            self.refs[index] -= 1
            if self.refs[index] > 0:
                return
            for key in [k for k, (_, i) in self.live.items() if i == index]:
                del self.live[key]
            self.free.append(index)
            self.cond.notify_all()

    def wake(self) -> None:
        """Make waiting readers look again (one of them may have been dropped)."""
        with self.cond:
            self.cond.notify_all()
