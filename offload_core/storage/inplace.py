"""A store that writes nothing: offloaded tensors are read in place from the checkpoint's own safetensors shards
(a tensor built from several checkpoint tensors, such as fused experts, is mapped part by part where it lies:
:mod:`offload_core.storage.splice`)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Iterator, Sequence

import torch

from offload_core.alignment import misplaced, placed, reference_offset
from offload_core.errors import StorageError
from offload_core.storage.base import Store, StoreContext, convert_dtype, converts
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.pagecache import (
    advise_ranges,
    drop_named,
    populate,
    read_in,
    resident,
    span_of,
    will_need,
)
from offload_core.storage.splice import Spliced, checkpoint_parts

log = logging.getLogger(__name__)


class InPlaceStore(Store):
    """``store[name]`` is a zero-copy view of the shard's mapped bytes (file-backed pages, no second copy).

    When the run's dtype differs from a tensor's stored dtype, the tensor is converted on every read
    (one copy per read, into fresh memory that is dropped after the module runs); nothing is cached.
    A tensor the checkpoint presents as several parts (``checkpoint.parts(key)``: per-expert tensors
    of a fused expert parameter) is spliced once, on its first read: each part's pages mapped where
    they lie in the shard, only the edge pages copied (:class:`~offload_core.storage.splice.Spliced`),
    and every read after is that view. Where it cannot be spliced (a conversion of dtype, parts that
    are not contiguous ranges of it) it is assembled on every read, each part copied into its place;
    one the checkpoint can only build (``checkpoint.get``) is built on every read. Either way nothing
    is written to disk.
    """

    reads_into = True  # converts or assembles into the caller's buffer in one pass

    def __init__(self, context: StoreContext) -> None:
        checkpoint = context.checkpoint
        if checkpoint is None or not checkpoint.is_safetensors:
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
        self.assembled: set[str] = set()  # built from several checkpoint tensors
        self._spliced: dict[str, Spliced | None] = {}  # assembled tensors mapped where their parts lie (None: cannot)
        self._splicing = threading.Lock()
        self.bytes_written = 0

    def add_from_checkpoint(self, name: str, checkpoint: Checkpoint, key: str, dtype: torch.dtype | None) -> None:
        # Only the header is consulted; the tensor's bytes are not read while loading.
        self._refs[name] = key
        if converts(checkpoint.dtype(key), dtype):
            self.converting.add(name)
        if key in checkpoint.conversion_targets:
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
                len(self.converting),
                self.dtype,
            )

    def _view(self, name: str) -> torch.Tensor:
        """The stored bytes as a tensor of the stored dtype (a view of the mapped shard)."""
        view = self._views.get(name)
        if view is None:
            with torch.inference_mode(False):  # kept across calls: a normal tensor, whatever mode the first call ran in
                view = self._views[name] = self.checkpoint.get(self._refs[name])
        return view

    def spliced(self, name: str) -> Spliced | None:
        """The assembled tensor ``name`` mapped where its parts lie (built on first use), or None where it is not
        assembled or cannot be spliced (converted, parts that are not placement, no ``mmap``)."""
        if name not in self.assembled or name in self.converting:
            return None
        if name not in self._spliced:
            with self._splicing:
                if name not in self._spliced:
                    self._spliced[name] = self._splice(name)
        return self._spliced[name]

    def _splice(self, name: str) -> Spliced | None:
        parts = checkpoint_parts(self.checkpoint, self._refs[name])
        if not parts:
            return None
        shape, dtype = self.spec(name)
        with torch.inference_mode(False):
            spliced = Spliced.build(shape, dtype, parts)
            if spliced is not None:
                spliced.copy_edges([source for _, source in self.checkpoint.parts(self._refs[name])])
        return spliced

    def mapped_view(self, name: str) -> torch.Tensor | None:
        """``store[name]`` where it is the shard's mapped bytes at the reference offset (computed on in place)."""
        if name in self.converting:
            return None
        spliced = self.spliced(name)
        view = spliced.tensor if spliced is not None else None if name in self.assembled else self._view(name)
        return None if view is None or misplaced(view, self.offset(name)) else view

    def file_ranges(self, name: str, start: int, end: int) -> list[tuple[Path, int, int]]:
        """Where bytes ``[start, end)`` of ``store[name]`` lie in the shards (for a tensor read in place or spliced)."""
        spliced = self.spliced(name)
        if spliced is not None:
            return spliced.ranges(start, end)
        if name in self.assembled or name in self.converting:
            return []
        shard, offset = self._where(name)
        return [(shard, offset + start, offset + end)]

    def __getitem__(self, name: str) -> torch.Tensor:
        spliced = self.spliced(name)
        if spliced is not None:
            return placed(spliced.tensor, self.offset(name))
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
        spliced = self.spliced(name)
        if spliced is not None:
            out.copy_(spliced.tensor)
            return
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
        spliced = self.spliced(name)
        if spliced is not None:
            row = spliced.tensor[expert]
            read_in([row], [self._row_ranges(spliced, expert)])
            out.copy_(row)
            return
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
        spliced = self.spliced(name)
        if spliced is not None:
            if not resident(spliced.tensor[expert]):
                advise_ranges(self._row_ranges(spliced, expert), "POSIX_FADV_WILLNEED")
        elif name in self.assembled:
            for index, source in self.checkpoint.parts(self._refs[name]) or ():
                if _row_of(index) == expert:
                    will_need(source)
        else:
            will_need(self._view(name)[expert])

    @staticmethod
    def _row_ranges(spliced: Spliced, expert: int) -> list[tuple[Path, int, int]]:
        row = spliced.nbytes // spliced.shape[0]
        return spliced.ranges(expert * row, (expert + 1) * row)

    def offset(self, name: str) -> int:
        """A tensor read in place sits at its offset in the mapped shard, as an in-memory load in place has it
        (otherwise it is handed out as a copy at offset 0); a converted or assembled one is a new tensor
        (aligned), as in memory."""
        if name in self.converting or name in self.assembled:
            return 0
        return reference_offset(self._view(name), self.maps_checkpoint)

    def warm(self, name: str) -> bool:
        spliced = self.spliced(name)
        if spliced is not None:
            if misplaced(spliced.tensor, self.offset(name)):
                return False
            read_in([spliced.tensor], [spliced.ranges(0, spliced.nbytes)])
            return True
        if name in self.converting or name in self.assembled or misplaced(self._view(name), self.offset(name)):
            return False  # a copy is made on read: the caller fetches it ahead instead
        return populate(self._view(name), *self._where(name))

    def drop(self, name: str) -> bool:
        return bool(self.drop_all([name]))

    def drop_all(self, names: Sequence[str]) -> list[str]:
        return drop_named({name: self._spans(name) for name in names})

    def _spans(self, name: str) -> list:
        """The file pages ``name``'s mapped bytes lie in; [] where it is a copy."""
        spliced = self.spliced(name)
        if spliced is not None:  # the mapped pages only: the copied edges are the tensor's own memory
            return list(spliced.mapped_spans())
        if name in self.assembled:
            return []
        return [span_of(self._view(name), *self._where(name))]

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
        self._spliced.clear()


def _row_of(index: tuple) -> int | None:
    """The first-dimension position of a part's index (per-expert parts sit at one row of the fused tensor)."""
    first = index[0] if index else None
    return first if isinstance(first, int) else None
