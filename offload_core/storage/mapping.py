"""The one rule for memory that tensors view in place (mapped files, reserved address space): no mapping is ever
unmapped while a tensor views it, and pages are only ever discarded from file mappings this module made.

Every such mapping is a :class:`Mapping`, made here (:func:`map_file`, :func:`map_anonymous`), and every tensor over one
is made by :func:`view`. A view holds a buffer export of its mapping (through a NumPy array, which ``torch.from_numpy``
keeps alive), so:

- the mapping lives as long as its last view, whoever else lets go of it (a store's ``close``, a checkpoint's, the
  garbage collector): the kernel unmaps it only when the last reference goes;
- ``close()`` on it while a view lives raises ``BufferError`` instead of unmapping pages under the view (a segfault
  at the view's next read). ``torch.frombuffer`` would hold only a reference, no export: ``mmap.close()`` then unmaps
  under live tensors. Nothing in offload_core closes a mapping; owners drop their reference.

:func:`file_pages` says whether an address range lies in the file-backed pages of a live mapping of this module (a
mapped file, or the file pieces a :class:`~offload_core.storage.splice.Spliced` tensor maps into its reserved space):
``MADV_DONTNEED`` is given only there (:func:`offload_core.storage.pagecache.drop`), where the next read faults the
file's bytes in again. Anywhere else (the heap, anonymous memory) it would zero live data. A file truncated under a
live mapping raises ``SIGBUS`` at the next read of a page past its end: offload_core never writes a file in place
that may be mapped (new files are written aside and renamed: :mod:`offload_core.atomic`).
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref

import numpy as np
import torch

__all__ = [
    "Mapping",
    "address",
    "file_pages",
    "map_anonymous",
    "map_file",
    "mapping_of",
    "register_file_pages",
    "view",
]

PAGE = mmap.PAGESIZE


class Mapping(mmap.mmap):
    """A memory mapping made by this module: registered while it is mapped, unmapped when the last reference to it
    (its views' included) goes."""

    def __del__(self) -> None:
        # Runs before mmap's own deallocator unmaps it: its file pages leave the registry while they are still
        # mapped. (A weakref callback would run after the unmap, which releases the GIL: another thread could map
        # the same addresses and register them in between, or take heap memory there for file pages.)
        _unregister(self.__dict__.get("_file_pages", ()))

    def close(self) -> None:
        """Unmap now: refused (``BufferError``) while a view lives. Nothing in offload_core calls it."""
        spans = self.__dict__.get("_file_pages", [])
        with _guard:  # its file pages leave the registry before they are unmapped, and come back if it is refused
            ends = {start: _ends[start] for start in spans if start in _ends}
            _unregister(spans)
            try:
                super().close()
            except BufferError:
                for start, end in ends.items():
                    bisect.insort(_starts, start)
                    _ends[start] = end
                raise


_live: weakref.WeakSet[Mapping] = weakref.WeakSet()  # every mapping of this module not yet collected


def map_file(path: str | os.PathLike[str], length: int = 0) -> Mapping:
    """The first ``length`` bytes of the file at ``path`` (0: all of it), mapped private and copy-on-write
    (``ACCESS_COPY``): its pages come from the page cache, and a write to a view changes only this process's copy.
    ``path`` may be an open file descriptor (not closed here)."""
    if isinstance(path, int):
        mapping = Mapping(path, length, access=mmap.ACCESS_COPY)
    else:
        with open(path, "rb") as handle:
            mapping = Mapping(handle.fileno(), length, access=mmap.ACCESS_COPY)
    _live.add(mapping)
    register_file_pages(mapping, 0, len(mapping))
    return mapping


def map_anonymous(size: int) -> Mapping:
    """``size`` bytes of reserved, private address space: a page takes memory only once written (file pages may be
    mapped over parts of it: :func:`register_file_pages`)."""
    mapping = Mapping(-1, max(int(size), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _live.add(mapping)
    return mapping


def address(mapping: Mapping) -> int:
    """Where ``mapping`` starts in this process's address space (page-aligned)."""
    return np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data


def view(mapping: Mapping, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, offset: int = 0) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` over ``mapping``'s bytes from ``offset`` on, no copy. It holds a buffer export
    of the mapping for as long as it (or any view of it) lives: the mapping cannot be unmapped under it."""
    shape = torch.Size(shape)
    nbytes = shape.numel() * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)
    return torch.from_numpy(array).view(dtype).view(shape)


def mapping_of(tensor: torch.Tensor) -> Mapping | None:
    """The live mapping of this module that holds ``tensor``'s bytes, or None (a diagnostic: a scan of them all)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    for mapping in list(_live):
        if not mapping.closed:
            base = address(mapping)
            if base <= start < base + len(mapping):
                return mapping
    return None


# -- the file pages of live mappings ---------------------------------------------------------------
_starts: list[int] = []  # sorted starts of the registered ranges
_ends: dict[int, int] = {}  # start -> end
_guard = threading.RLock()  # reentrant: a mapping collected while the guard is held unregisters in the same thread


def register_file_pages(mapping: Mapping, start: int, end: int) -> None:
    """Bytes ``[start, end)`` of ``mapping`` (page-aligned offsets into it) are pages of a file, for as long as
    ``mapping`` is mapped (a file mapped whole, or a file piece mapped over reserved space)."""
    if end <= start:
        return
    base = address(mapping)
    lo, hi = base + start, base + -(-end // PAGE) * PAGE
    with _guard:
        if lo in _ends:  # a mapping gone without its __del__ (never: Mapping.__del__ unregisters first)
            _unregister([lo])
        bisect.insort(_starts, lo)
        _ends[lo] = hi
        mapping.__dict__.setdefault("_file_pages", []).append(lo)


def _unregister(starts: list[int]) -> None:
    with _guard:
        for start in starts:
            index = bisect.bisect_left(_starts, start)
            if index < len(_starts) and _starts[index] == start:
                del _starts[index]
                _ends.pop(start, None)


def file_pages(start: int, length: int) -> bool:
    """Whether ``[start, start + length)`` lies inside one registered range of file pages of a live mapping."""
    if length <= 0:
        return False
    with _guard:
        index = bisect.bisect_right(_starts, start) - 1
        return index >= 0 and start + length <= _ends.get(_starts[index], 0)
