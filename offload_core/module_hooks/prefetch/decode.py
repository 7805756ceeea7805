"""Decoding on the execution device: a store's packed tensors (:meth:`Store.packed`) copied as they are held and
decoded on the side stream into the unit's block buffer, in scratch buffers made once."""

from __future__ import annotations

import threading
from typing import Any, Mapping

import torch

from offload_core.module_hooks.prefetch.prefetcher import Prefetcher
from offload_core.module_hooks.prefetch.transfer import Streams
from offload_core.storage.base import Store


class Decoder:
    """The prefetcher's device decoding: one scratch on the execution device per kind of packed tensor
    (:class:`offload_core.storage.base.DevicePacked`), made at the first tensor of that kind and used by the reader
    and, on a miss, the compute thread in turn."""

    def __init__(self, accel: Streams) -> None:
        self.accel = accel
        self.scratches: dict[str, Any] = {}
        self.decoded = 0  # tensors decoded on the device
        self._lock = threading.Lock()

    def decode(self, store: Mapping[str, torch.Tensor], key: str, dst_bytes: torch.Tensor) -> bool:
        """Queue ``key``'s packed bytes' copies and decoding into ``dst_bytes`` on the side stream (whose event,
        recorded after the unit's tensors, covers them); False where there is nothing to decode (a CPU run, a store
        or tensor held raw): the caller copies as usual."""
        if not self.accel.cuda or not isinstance(store, Store):
            return False
        packed = store.packed(key)
        if packed is None:
            return False
        with self._lock:
            scratch = self.scratches.get(packed.kind)
            if scratch is None:
                scratch = self.scratches[packed.kind] = packed.new_scratch(self.accel.device)
            with self.accel.on_side():
                packed.decode_on_device(dst_bytes, scratch, key)
            self.decoded += 1
        return True

    @property
    def nbytes(self) -> int:
        """Device bytes of the scratches (0 before the first packed tensor)."""
        return sum(scratch.nbytes for scratch in self.scratches.values())

    def clear(self) -> None:
        """Let the scratches go (the side stream was synchronized: nothing queued reads them)."""
        with self._lock:
            self.scratches.clear()


class DecodingPrefetcher(Prefetcher):
    """The prefetcher of a run whose store holds packed tensors: each is copied packed and decoded on the execution
    device (:class:`Decoder`); the rest is the prefetcher's own path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoder = Decoder(self.accel)

    def _copy_tensor(self, key: str, view: torch.Tensor, dst_bytes: torch.Tensor) -> None:
        if not self.decoder.decode(self.store, key, dst_bytes):
            super()._copy_tensor(key, view, dst_bytes)

    def close(self) -> None:
        super().close()  # the side stream synchronized: no decoding reads the scratch any more
        self.decoder.clear()


def packs(store: Any) -> bool:
    """Whether ``store`` holds tensors packed (:attr:`Store.packs`)."""
    return isinstance(store, Store) and store.packs
