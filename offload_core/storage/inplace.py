"""A store that writes nothing: offloaded tensors are read in place from the checkpoint's own safetensors shards
(a tensor built from several checkpoint tensors, such as fused experts, is read part by part into its destination)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import torch

from offload_core.alignment import misplaced, placed, reference_offset
from offload_core.errors import StorageError
from offload_core.storage.base import Store, StoreContext, convert_dtype, converts
from offload_core.storage.pagecache import drop, populate, will_need

log = logging.getLogger(__name__)


class InPlaceStore(Store):
    """``store[name]`` is a zero-copy view of the shard's mapped bytes (file-backed pages, no second copy).

    When the run's dtype differs from a tensor's stored dtype, the tensor is converted on every read
    (one copy per read, into fresh memory that is dropped after the module runs); nothing is cached.
    A tensor the checkpoint presents as several parts (``checkpoint.parts(key)``: per-expert tensors
    of a fused expert parameter) is assembled on every read, each part copied from its mapped bytes
    into its place in the destination; one the checkpoint can only build (``checkpoint.get``) is built
    on every read. Either way nothing is written to disk.
    """

    def __init__(self, context: StoreContext) -> None:
        checkpoint = context.checkpoint
        if checkpoint is None or not getattr(checkpoint, "is_safetensors", False):
            raise StorageError(
                "storage=safetensors reads offloaded tensors in place from .safetensors shards, but this "
                "checkpoint has none; use storage=memmap (or convert the checkpoint to safetensors)"
            )
        self.checkpoint = checkpoint
        self.dtype = context.dtype
        self.maps_checkpoint = context.maps_checkpoint
        self._refs: dict[str, str] = {}
        self._views: dict[str, torch.Tensor] = {}
        self.converting: set[str] = set()
        self.assembled: set[str] = set()  # built from several checkpoint tensors on each read
        self.bytes_written = 0

    def add_from_checkpoint(self, name: str, checkpoint: Any, key: str, dtype: torch.dtype | None) -> None:
        # Only the header is consulted; the tensor's bytes are not read while loading.
        self._refs[name] = key
        if converts(checkpoint.dtype(key), dtype):
            self.converting.add(name)
        if key in getattr(checkpoint, "conversion_targets", ()):
            self.assembled.add(name)

    def put(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        raise StorageError(
            f"storage=safetensors cannot hold {name!r}: it only references tensors of the checkpoint; "
            "use storage=memmap or pinned_cpu for tensors that are not in the checkpoint"
        )

    def finalize(self) -> None:
        if self.converting:
            log.info(
                "safetensors: %d offloaded tensors are stored in another dtype than the run's %s; "
                "they are converted on each read (storage=memmap converts once, at load)",
                len(self.converting), self.dtype,
            )

    def _view(self, name: str) -> torch.Tensor:
        """The stored bytes as a tensor of the stored dtype (a view of the mapped shard)."""
        view = self._views.get(name)
        if view is None:
            with torch.inference_mode(False):  # kept across calls: a normal tensor, whatever mode the first call ran in
                view = self._views[name] = self.checkpoint.get(self._refs[name])
        return view

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.assembled:
            shape, dtype = self.spec(name)
            out = torch.empty(shape, dtype=dtype)
            self.read_into(name, out)
            return out
        view = self._view(name)
        if name in self.converting:
            return convert_dtype(view, self.dtype)
        return placed(view, self.offset(name))

    def spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of ``store[name]`` from the shard's header (no read, no conversion)."""
        key = self._refs[name]
        stored = self.checkpoint.dtype(key)
        dtype = self.dtype if name in self.converting else stored
        return torch.Size(self.checkpoint.shape(key)), dtype

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy ``name`` into ``out``, converting in the same pass (no converted copy in between)."""
        if name in self.assembled:
            parts = self.checkpoint.parts(self._refs[name])
            if parts is None:
                out.copy_(self.checkpoint.get(self._refs[name]))
                return
            for index, source in parts:
                out[index].copy_(source)
            return
        out.copy_(self._view(name))

    def read_expert(self, name: str, expert: int, out: torch.Tensor) -> None:
        """Copy expert ``expert`` of ``name`` into ``out`` from the mapped shard: a row of the stored tensor,
        or the per-expert checkpoint tensors that form it (converting in the same pass)."""
        if name in self.assembled:
            parts = self.checkpoint.parts(self._refs[name])
            if parts is None:
                out.copy_(self.checkpoint.get(self._refs[name])[expert])
                return
            for index, source in parts:
                if _row_of(index) == expert:
                    populate(source)  # one read of its pages rather than a page fault per page
                    out[index[1:]].copy_(source)
            return
        row = self._view(name)[expert]
        populate(row)
        out.copy_(row)

    def advise_expert(self, name: str, expert: int) -> None:
        """Start reading expert ``expert`` of ``name`` from the shard: its per-expert checkpoint tensors, or its row."""
        if name in self.assembled:
            for index, source in self.checkpoint.parts(self._refs[name]) or ():
                if _row_of(index) == expert:
                    will_need(source)
            return
        will_need(self._view(name)[expert])

    def offset(self, name: str) -> int:
        """A tensor read in place sits at its offset in the mapped shard, as an in-memory load in place has it
        (otherwise it is handed out as a copy at offset 0); a converted or assembled one is a new tensor
        (aligned), as in memory."""
        if name in self.converting or name in self.assembled:
            return 0
        return reference_offset(self._view(name), self.maps_checkpoint)

    def warm(self, name: str) -> bool:
        if name in self.converting or name in self.assembled or misplaced(self._view(name), self.offset(name)):
            return False  # a copy is made on read: the caller fetches it ahead instead
        return populate(self._view(name), *self._where(name))

    def drop(self, name: str) -> bool:
        if name in self.assembled:
            return False
        return drop(self._view(name), *self._where(name))

    def _where(self, name: str) -> tuple[Path, int]:
        """The shard holding ``name``'s bytes and their offset in it."""
        key = self._refs[name]
        shard = self.checkpoint.file_of(key)
        return shard, self.checkpoint.safetensors_file(shard).byte_range(key)[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def close(self) -> None:
        self._views.clear()


def _row_of(index: tuple) -> int | None:
    """The first-dimension position of a part's index (per-expert parts sit at one row of the fused tensor)."""
    first = index[0] if index else None
    return first if isinstance(first, int) else None
