"""Buffers a GGUF store dequantizes into and hands out, each used again once nothing holds it any more: a read
allocates no memory (nor pays the page faults of new memory) after the first reads of each size."""

from __future__ import annotations

import threading

import torch


def _users(buffer: torch.Tensor) -> int:
    """Tensors (and storage objects) sharing ``buffer``'s memory, this call's own storage object among them."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


class BufferPool:
    """Buffers by element count and dtype. :meth:`take` hands out one that nothing outside the pool shares now (every
    tensor made of it since it was last handed out has been dropped: a module hook put its placeholder back), or a
    new one it keeps. The pool holds at most what was in use at once."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._alone = _users(torch.empty(1))  # the count of a buffer the pool alone holds

    def take(self, elements: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``elements`` of ``dtype`` that is not in use."""
        with self._lock:
            held = self._held.setdefault((elements, dtype), [])
            free = next((buffer for buffer in held if _users(buffer) == self._alone), None)
            if free is None:
                free = torch.empty(elements, dtype=dtype)
                held.append(free)
            return free.view(-1)  # a tensor of its own over the buffer: while it lives, the buffer counts as in use

    def nbytes(self) -> int:
        """Bytes the pool holds."""
        with self._lock:
            return sum(b.numel() * b.element_size() for held in self._held.values() for b in held)
