"""How bytes cross to the execution device: the side stream and its events, and a ring of pinned staging buffers."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

#: pinned staging ring: this many buffers of this many bytes (host memory a GPU run spends on staging)
STAGING_BUFFERS = 3
STAGING_CHUNK = 16 * 2**20


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class Streams:
    """The few stream and event calls of a CUDA run; on a CPU run every one is a synchronous no-op."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def record_on_side(self) -> Any:
        """An event on the side stream after everything queued there so far."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def record_on_compute(self) -> Any:
        """An event on the compute stream after everything queued there so far (kernels reading a buffer)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def side_waits(self, event: Any) -> None:
        if event is not None:
            self.stream.wait_event(event)

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def on_side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()


class StagingRing:
    """A fixed ring of pinned host buffers carrying pageable bytes to the device in chunks.

    For each chunk: wait until the copy that last read this buffer has finished (its event), copy the
    chunk from the source into it on this thread (for a mapped file, this is where the disk is read),
    then queue its copy to the device on the side stream and record the buffer's event. With
    ``count >= 2`` the host copy of one chunk overlaps the device copy of the one before.
    """

    def __init__(self, accel: Streams, count: int = STAGING_BUFFERS, chunk: int = STAGING_CHUNK) -> None:
        self.accel = accel
        self.count = count
        self.chunk = chunk
        self.buffers: list[torch.Tensor] = []
        self.events: list[Any] = [None] * count
        self.next = 0
        self.chunks = 0
        # The reader and, on a miss, the compute thread may both copy: one tensor at a time goes through.
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def _buffer(self, i: int) -> torch.Tensor:
        while len(self.buffers) <= i:  # allocated on first use, once
            self.buffers.append(torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self.accel.cuda))
        return self.buffers[i]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the 1-D uint8 host tensor ``src`` into the 1-D uint8 device tensor ``dst`` (same length)."""
        with self._lock:
            self._copy(src, dst)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        total = src.numel()
        for start in range(0, total, self.chunk):
            n = min(self.chunk, total - start)
            i = self.next
            self.next = (i + 1) % self.count
            if self.events[i] is not None:
                self.events[i].synchronize()
            stage = self._buffer(i)[:n]
            stage.copy_(src[start:start + n])
            with self.accel.on_side():
                dst[start:start + n].copy_(stage, non_blocking=True)
            self.events[i] = self.accel.record_on_side()
            self.chunks += 1
