"""One pinned allocation per store, sub-allocated: page-locked bytes stay within a few percent of the bytes stored.

PyTorch's pinned allocator rounds every request up to a power of two (a 32 MiB tensor takes 64 MiB), and
keeps the blocks cached after they are freed. A store that pins its tensors one by one can hold up to
twice its bytes in page-locked memory, which the operating system can neither swap nor reclaim. An arena
is sized once from the bytes the store will hold, pinned as it is, handed out in aligned pieces, and
unpinned when the store closes.
"""

from __future__ import annotations

import threading

import torch

from offload_core.devices.base import Accelerator

#: each piece starts on this boundary (cache lines; wide enough for DMA)
PIECE_ALIGN = 64


def arena_bytes(sizes: list[int]) -> int:
    """The arena that holds tensors of ``sizes`` bytes, each piece aligned."""
    return sum(-(-n // PIECE_ALIGN) * PIECE_ALIGN for n in sizes)


class PinnedArena:
    """Pinned host memory handed out in pieces: :meth:`take` until it is full, then from new arenas of the
    size still expected (``capacity`` is the first one's size; a store that did not know its size up front
    grows by doubling arenas)."""

    def __init__(self, accelerator: Accelerator, capacity: int) -> None:
        self.accelerator = accelerator
        self.expected = max(int(capacity), 0)
        self.arenas: list[torch.Tensor] = []
        self.used = 0  # bytes taken from the last arena
        self.taken = 0  # bytes handed out, in all
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held (the arenas' sizes)."""
        return sum(a.numel() for a in self.arenas)

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized pinned tensor of ``shape`` and ``dtype``."""
        nbytes = -(-(int(torch.Size(shape).numel()) * dtype.itemsize) // PIECE_ALIGN) * PIECE_ALIGN
        with self._lock:
            if not self.arenas or self.used + nbytes > self.arenas[-1].numel():
                left = self.expected - self.taken
                size = max(nbytes, left if left > 0 else max(nbytes, self.nbytes))
                self.arenas.append(self.accelerator.pinned_arena(size))
                self.used = 0
            arena = self.arenas[-1]
            start = self.used
            self.used += nbytes
            self.taken += nbytes
        raw = arena[start : start + torch.Size(shape).numel() * dtype.itemsize]
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        """Unpin every arena (after the copies reading them are done)."""
        with self._lock:
            arenas, self.arenas = self.arenas, []
            self.used = 0
        for arena in arenas:
            self.accelerator.free_arena(arena)
