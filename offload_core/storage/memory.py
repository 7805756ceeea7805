"""A store in host memory, page-locked when an accelerator is present: the fastest source for H2D copies.

Page-locked tensors come from one arena per store (:class:`offload_core.devices.PinnedArena`), sized from
the bytes the loader says the store will hold, and unpinned when the store closes: pinned memory stays
within a few percent of the bytes stored (PyTorch's pinned allocator would round each tensor up to a power
of two and keep the blocks after the store is gone)."""

from __future__ import annotations

import logging
from typing import Iterator

import torch

from offload_core import devices
from offload_core.alignment import address_offset, empty_at
from offload_core.storage.base import Store, StoreContext, read_tensor
from offload_core.storage.checkpoint import Checkpoint

log = logging.getLogger(__name__)


class HostMemoryStore(Store):
    """Tensors copied once into (pinned) host memory; ``store[name]`` returns that memory itself."""

    def __init__(self, context: StoreContext, pin: bool = True) -> None:
        accelerator = devices.active()
        self.pinned = bool(pin and context.pin_memory and accelerator.available())
        if pin and not self.pinned:
            log.info("pinned_cpu: no accelerator present, offloaded tensors are kept in plain (pageable) memory")
        self.arena = devices.PinnedArena(accelerator, context.nbytes) if self.pinned else None
        self._tensors: dict[str, torch.Tensor] = {}
        self.maps_checkpoint = context.maps_checkpoint
        self.bytes_written = 0

    def put(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        """The tensor's reference offset is where it lies now (an in-memory model's tensor)."""
        # An owned CPU tensor is kept as is unless it must be pinned.
        if owned and not self.pinned and tensor.device.type == "cpu":
            self._tensors[name] = tensor
            return
        self._keep(name, tensor, address_offset(tensor) if tensor.is_contiguous() else 0)

    def add_from_checkpoint(self, name: str, checkpoint: Checkpoint, key: str, dtype: torch.dtype | None) -> None:
        self._held(name, read_tensor(checkpoint, key, dtype, self.maps_checkpoint, self._allocate))

    def _keep(self, name: str, tensor: torch.Tensor, offset: int) -> None:
        # One allocation in the final (pinned) memory and one copy from the source: never a pinned copy beside an
        # unpinned one.
        self._held(name, self._allocate(tuple(tensor.shape), tensor.dtype, offset).copy_(tensor))

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
        """Memory for one tensor: in the pinned arena (a GPU computes with it: where it starts does not change
        results), else at the reference offset (this machine's kernels may depend on it)."""
        return self.arena.take(shape, dtype) if self.arena is not None else empty_at(shape, dtype, offset)

    def _held(self, name: str, held: torch.Tensor) -> None:
        self._tensors[name] = held
        self.bytes_written += held.numel() * held.element_size()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def mapped_view(self, name: str) -> torch.Tensor:
        """The held memory itself: a CPU run computes on it in place (nothing to read, no copy)."""
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes this store holds (its arenas)."""
        return self.arena.nbytes if self.arena is not None else 0

    def close(self) -> None:
        self._tensors.clear()
        if self.arena is not None:
            self.arena.close()
