"""The contract between loading and module hooks: a store of offloaded tensors, written while loading, read by name."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch


@dataclass
class StoreContext:
    """What a storage backend needs to open its store for one run.

    ``fingerprint`` identifies what the offloaded tensors depend on (checkpoint files, dtype, device map):
    a persistent store whose fingerprint matches may be reused as is. ``checkpoint`` is the
    :class:`offload_core.checkpoint.Checkpoint` being loaded (stores that read in place use it).
    """

    names: list[str]
    dtype: torch.dtype | None = None
    offload_folder: Path | None = None
    checkpoint: Any = None
    fingerprint: dict = field(default_factory=dict)
    pin_memory: bool = False


_CHUNK = 8 << 20
_scratch = threading.local()


def read_into_page_cache(path: str | os.PathLike, offset: int, length: int) -> None:
    """Read ``length`` bytes of ``path`` from ``offset`` so they sit in the page cache (GIL released while reading)."""
    if length <= 0:
        return
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        end = offset + length
        while offset < end:
            n = os.preadv(fd, [view[: min(_CHUNK, end - offset)]], offset)
            if n <= 0:
                break
            offset += n
    finally:
        os.close(fd)


def convert_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast floating tensors to ``dtype`` (integers and bools keep theirs); no copy when nothing changes."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


class Store(Mapping):
    """Offloaded tensors by name.

    Loading calls :meth:`add_from_checkpoint` (or :meth:`put`) for each offloaded tensor unless
    :attr:`reused` is true, then :meth:`finalize`. Module hooks read with ``store[name]``: the
    returned CPU tensor must not be written to; stores hand out views of memory they hold (mapped files,
    pinned buffers) rather than fresh copies wherever they can.
    """

    #: True when a previous run's complete store was found and nothing needs writing.
    reused: bool = False
    #: bytes this store wrote to disk or copied into memory while loading.
    bytes_written: int = 0
    #: True when ``store[name]`` returns memory that is page-locked (fast, non-blocking H2D copies).
    pinned: bool = False

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (already converted to the run's dtype) under ``name``."""
        raise NotImplementedError

    def add_from_checkpoint(self, name: str, checkpoint: Any, key: str, dtype: torch.dtype | None) -> None:
        """Keep checkpoint tensor ``key`` under ``name``; stores that read in place override this."""
        self.put(name, convert_dtype(checkpoint.get(key), dtype))

    def warm(self, name: str) -> bool:
        """Bring ``name``'s bytes close (the page cache, for mapped stores) ahead of use.

        Returns True when reading ``store[name]`` afterwards costs no further I/O and no copy; False
        when the store has nothing to warm and the caller should fetch (copy) the tensor itself.
        """
        return False

    def finalize(self) -> None:
        """Called once all tensors are in: make the store complete (and durable, for folders)."""

    def close(self) -> None:
        """Release files and memory; temporary data this store created is removed."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Mapping: subclasses implement __getitem__, __iter__, __len__.
    def __getitem__(self, name: str) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __iter__(self) -> Iterator[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError
