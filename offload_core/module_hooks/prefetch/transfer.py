"""How bytes cross to the execution device: the side stream and its events, and a ring of pinned staging buffers."""

from __future__ import annotations

import threading
from typing import Any

import torch

from offload_core import devices

#: pinned staging ring: this many buffers of this many bytes (host memory a GPU run spends on staging)
STAGING_BUFFERS = 3
STAGING_CHUNK = 16 * 2**20


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class Streams:
    """The few stream and event calls of a run, asked of the device layer: on an accelerator a side stream for
    the copies and events between it and the compute stream; on a CPU run every one is a synchronous no-op."""

    def __init__(self, device: torch.device) -> None:
        self.accelerator = devices.for_device(device)
        self.accelerated = self.accelerator is not devices.HOST
        self.device = device
        self.stream = self.accelerator.new_stream(device) if self.accelerated else None

    @property
    def cuda(self) -> bool:
        """An accelerator runs the device (copies are asynchronous): CUDA, or another behind the device layer."""
        return self.accelerated

    def record_on_side(self) -> Any:
        """An event on the side stream after everything queued there so far."""
        return self.accelerator.record_event(self.stream)

    def record_on_compute(self) -> Any:
        """An event on the compute stream after everything queued there so far (kernels reading a buffer)."""
        if not self.accelerated:
            return None
        return self.accelerator.record_event(self.accelerator.current_stream(self.device))

    def side_waits(self, event: Any) -> None:
        self.accelerator.wait_event(self.stream, event)

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            self.accelerator.wait_event(self.accelerator.current_stream(self.device), event)

    def on_side(self):
        return self.accelerator.on_stream(self.stream)

    def synchronize(self) -> None:
        """The host waits for every copy queued on the side stream."""
        self.accelerator.synchronize_stream(self.stream)

    def host_waits(self, event: Any) -> None:
        """The host waits until ``event`` has happened (a staging buffer's last copy is done)."""
        self.accelerator.synchronize_event(event)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.accelerated and self.accelerator.is_pinned(tensor)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """Host bytes for staging: page-locked on an accelerator."""
        return self.accelerator.pinned_empty(nbytes) if self.accelerated else torch.empty(nbytes, dtype=torch.uint8)


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
            self.buffers.append(self.accel.pinned_empty(self.chunk))
        return self.buffers[i]

    def clear(self) -> None:
        """Let the buffers go (the copies reading them must be done: the side stream was synchronized)."""
        with self._lock:
            self.buffers = []
            self.events = [None] * self.count
            self.next = 0

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
                self.accel.host_waits(self.events[i])
            stage = self._buffer(i)[:n]
            stage.copy_(src[start : start + n])
            with self.accel.on_side():
                dst[start : start + n].copy_(stage, non_blocking=True)
            self.events[i] = self.accel.record_on_side()
            self.chunks += 1
