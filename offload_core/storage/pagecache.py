"""The page cache seen from a mapped tensor: whether its pages are in memory (``mincore``), reading them in ahead of use
and dropping them after (``madvise``, ``posix_fadvise``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from functools import lru_cache
from typing import NamedTuple
from pathlib import Path

import torch

from offload_core.storage.mapping import file_pages

__all__ = [
    "advise_ranges",
    "coalesce",
    "drop",
    "drop_named",
    "drop_spans",
    "droppable",
    "libc",
    "map_in",
    "page_spans",
    "populate",
    "read_in",
    "resident",
    "span_of",
    "Span",
    "spans_resident",
    "will_need",
]

_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+: read the pages in (from disk if needed) and map them, no copy


@lru_cache(maxsize=1)
def libc() -> ctypes.CDLL | None:
    """The C library with ``madvise``, ``mincore`` and ``fallocate`` typed; None off Linux or where it cannot be
    found."""
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return None
    lib = ctypes.CDLL(name, use_errno=True)  # foreign calls release the GIL while they run
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    lib.mincore.restype = ctypes.c_int
    lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.fallocate.restype = ctypes.c_int
    return lib


_HINT_CHUNK = 1 << 20  # bytes per MADV_WILLNEED call (page aligned)

_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore: only bit 0 of each byte says "resident"


def _all_resident(lib: ctypes.CDLL, start: int, length: int) -> bool:
    """Whether every page of the (page-aligned) range is in memory: one exact ``mincore`` call."""
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(max(pages, 1))
    if lib.mincore(start, length, vec) != 0:
        return False
    return b"\x00" not in vec.raw[:pages].translate(_LOW_BIT)


def _page_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The page-aligned address range holding a CPU tensor's bytes: (start, length)."""
    page = mmap.PAGESIZE
    address = tensor.data_ptr()
    start = address - address % page
    return start, address + tensor.numel() * tensor.element_size() - start


def resident(tensor: torch.Tensor) -> bool:
    """Whether all of a CPU tensor's pages are in memory (as :func:`populate` checks before reading).

    True where that cannot be told (no ``mincore``, an empty or non-CPU tensor). Callers use it to
    decide whether to read pages in again: a wrong answer costs time (a read, or page faults), never
    correctness.
    """
    lib = libc()
    if lib is None or tensor.numel() == 0 or tensor.device.type != "cpu":
        return True
    return _all_resident(lib, *_page_span(tensor))


def page_spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned address ranges ``(start, length)`` holding CPU tensors' bytes, neighbours merged where no
    whole page lies between them (a layer's tensors, side by side in a mapped file, make one range): asking
    :func:`spans_resident` of them is asking :func:`resident` of each tensor, with one ``mincore`` per range."""
    spans: list[tuple[int, int]] = []
    for start, length in sorted(_page_span(t) for t in tensors if t.numel() and t.device.type == "cpu"):
        if spans and start <= -(-(spans[-1][0] + spans[-1][1]) // mmap.PAGESIZE) * mmap.PAGESIZE:
            spans[-1] = (spans[-1][0], max(spans[-1][1], start + length - spans[-1][0]))
        else:
            spans.append((start, length))
    return spans


def spans_resident(spans: list[tuple[int, int]]) -> bool:
    """Whether every page of these :func:`page_spans` is in memory (True where that cannot be told, as
    :func:`resident`)."""
    lib = libc()
    return lib is None or all(_all_resident(lib, start, length) for start, length in spans)


def populate(tensor: torch.Tensor, path: str | os.PathLike[str] | None = None, offset: int = 0) -> bool:
    """Bring a CPU tensor's file-backed pages into memory ahead of use, on the calling (reader) thread.

    When ``mincore`` shows the tensor already in memory, nothing is done (walking the pages of every offloaded byte on
    every token is costly). Otherwise, given the file the tensor maps (``path``, its bytes starting at ``offset``), the
    tensor's byte range is first asked for with ``POSIX_FADV_WILLNEED`` (in read-ahead-window pieces:
    :func:`advise_ranges`), which queues the whole range at once (a deeper queue than the page faults' readahead
    windows: ``bench/readpath.py``); then ``MADV_POPULATE_READ`` waits for the pages and maps them (the GIL is released
    meanwhile). Kernels without it get the ``MADV_WILLNEED`` hint, which some disks ignore. Returns False where madvise
    is unavailable.
    """
    lib = libc()
    if lib is None or tensor.numel() == 0 or tensor.device.type != "cpu":
        return lib is not None
    start, length = _page_span(tensor)
    if _all_resident(lib, start, length):
        return True
    if path is not None:
        advise_ranges([(path, offset, offset + tensor.numel() * tensor.element_size())], "POSIX_FADV_WILLNEED")
    if lib.madvise(start, length, _MADV_POPULATE_READ) == 0:
        return True
    return lib.madvise(start, length, _MADV_WILLNEED) == 0


def _advise(path: str | os.PathLike[str], offset: int, length: int, advice: str) -> bool:
    """``posix_fadvise`` on a byte range of ``path``; False where it cannot be given (no such call, the file gone)."""
    if not hasattr(os, advice):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, offset, length, getattr(os, advice))
    finally:
        os.close(fd)
    return True


def will_need(tensor: torch.Tensor) -> None:
    """Start reading a mapped CPU tensor's pages in without waiting (``MADV_WILLNEED``): the disk gets every
    range hinted at once, where reading one range after another keeps only one request in flight. Does
    nothing where its pages are already in memory or madvise is unavailable."""
    lib = libc()
    if lib is None or tensor.numel() == 0 or tensor.device.type != "cpu":
        return
    start, length = _page_span(tensor)
    if _all_resident(lib, start, length):
        return
    # The kernel reads at most one read-ahead window (read_ahead_kb, or the disk's largest request) per
    # hint and ignores the rest; a page left out would later be faulted in with a read-around window
    # that spills into the neighbouring tensors. Hints of 1 MiB each cover the whole span.
    for offset in range(0, length, _HINT_CHUNK):
        lib.madvise(start + offset, min(_HINT_CHUNK, length - offset), _MADV_WILLNEED)


class Span(NamedTuple):
    """Mapped file pages to let go of: ``[address, address + length)`` of a mapping of this process (page aligned),
    and the bytes ``[start, end)`` of ``path`` they hold (a tensor's own: a page it shares with a neighbour stays in
    the page cache)."""

    address: int
    length: int
    path: Path
    start: int
    end: int


def span_of(tensor: torch.Tensor, path: str | os.PathLike[str], offset: int) -> Span | None:
    """The :class:`Span` of a mapped CPU tensor whose bytes start at ``offset`` in ``path``; None for an empty or
    non-CPU tensor."""
    if tensor.numel() == 0 or tensor.device.type != "cpu":
        return None
    return Span(*_page_span(tensor), Path(path), offset, offset + tensor.numel() * tensor.element_size())


def drop(tensor: torch.Tensor, path: str | os.PathLike[str], offset: int) -> bool:
    """Let go of a mapped tensor's pages: unmap them from this process (``MADV_DONTNEED``), then drop
    the file's bytes from the page cache (``POSIX_FADV_DONTNEED``): :func:`drop_spans` of its :func:`span_of`.

    Only for tensors that are read-only views of a file mapping of ``path`` whose bytes start at
    ``offset`` in the file: the next read faults the pages in from disk again (time, never data).
    Returns False where this cannot be done (off Linux, an empty or non-CPU tensor, the file gone), and
    where the tensor's pages are not the file pages of a live mapping of
    :mod:`~offload_core.storage.mapping` (memory of the heap or anonymous memory would read as zeros).
    """
    span = span_of(tensor, path, offset)
    return span is not None and drop_spans([span])


def coalesce(ranges: list[tuple[os.PathLike[str], int, int]], gap: int = 0) -> list[tuple[os.PathLike[str], int, int]]:
    """File byte ranges sorted by file and offset, those that touch (or lie within ``gap`` bytes) merged: one
    large read per run of neighbours, in the order they lie on the disk."""
    merged: list[tuple[os.PathLike[str], int, int]] = []
    for path, start, end in sorted(ranges, key=lambda r: (str(r[0]), r[1])):
        if merged and str(merged[-1][0]) == str(path) and start <= merged[-1][2] + gap:
            merged[-1] = (path, merged[-1][1], max(merged[-1][2], end))
        else:
            merged.append((path, start, end))
    return merged


def advise_ranges(ranges: list[tuple[os.PathLike[str], int, int]], advice: str) -> None:
    """``posix_fadvise(advice)`` on file byte ranges, neighbours merged (each file opened once), in file order.

    ``POSIX_FADV_WILLNEED`` reads at most one read-ahead window per call and ignores the rest (as
    ``MADV_WILLNEED``: :func:`will_need`), so it is given in :data:`_HINT_CHUNK` pieces covering each range."""
    if not ranges or not hasattr(os, advice):
        return
    chunk = _HINT_CHUNK if advice == "POSIX_FADV_WILLNEED" else 1 << 62
    fds: dict[str, int] = {}
    try:
        for path, start, end in coalesce(ranges):
            if str(path) not in fds:
                fds[str(path)] = os.open(path, os.O_RDONLY)
            for offset in range(start, end, chunk):
                os.posix_fadvise(fds[str(path)], offset, min(chunk, end - offset), getattr(os, advice))
    except OSError:
        pass  # a hint that cannot be given costs time, never data
    finally:
        for fd in fds.values():
            os.close(fd)


def droppable(spans: list[Span]) -> bool:
    """Whether :func:`drop_spans` may drop these spans: madvise and fadvise exist here, and every span is the file
    pages of a live mapping of :mod:`~offload_core.storage.mapping` (memory of the heap or anonymous memory would
    read as zeros)."""
    return libc() is not None and hasattr(os, "posix_fadvise") and all(file_pages(s.address, s.length) for s in spans)


def drop_named(spans: dict[str, list[Span | None]]) -> list[str]:
    """:func:`drop_spans` of several tensors' spans (by name) in one go, those not :func:`droppable` left out: the
    names dropped."""
    kept = {name: found for name, found in spans.items() if found and None not in found and droppable(found)}
    return list(kept) if kept and drop_spans([s for found in kept.values() for s in found]) else []


def drop_spans(spans: list[Span]) -> bool:
    """:func:`drop` for mapped file pages: unmapped from this process, then their bytes dropped from the page cache;
    spans that touch are merged first, so a layer whose tensors lie side by side costs one ``madvise`` and one
    ``posix_fadvise`` (each ``POSIX_FADV_DONTNEED`` drains every CPU's page lists: many small calls cost more than
    the pages they drop). False where :func:`droppable` is not (nothing is dropped)."""
    if not droppable(spans):
        return False
    merged: list[list[int]] = []
    for span in sorted(spans):
        if merged and span.address <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.address + span.length)
        else:
            merged.append([span.address, span.address + span.length])
    lib = libc()
    for start, end in merged:
        lib.madvise(start, end - start, _MADV_DONTNEED)
    advise_ranges([(s.path, s.start, s.end) for s in spans], "POSIX_FADV_DONTNEED")
    return True


def read_in(tensors: list[torch.Tensor], ranges: list[tuple[os.PathLike[str], int, int]]) -> int:
    """Bring mapped CPU tensors in whose pages are not all in memory: the file ranges that hold them (``ranges``,
    one list per tensor) asked for at once, neighbours merged, then each tensor waited for and mapped, in
    order. Tensors already in memory cost one ``mincore`` each. Returns how many were not in memory."""
    missing = [i for i, tensor in enumerate(tensors) if not resident(tensor)]
    advise_ranges([r for i in missing for r in ranges[i]], "POSIX_FADV_WILLNEED")
    for i in missing:
        map_in(tensors[i])
    return len(missing)


def map_in(tensor: torch.Tensor) -> None:
    """Map a CPU tensor's pages now, waiting for those still being read (``MADV_POPULATE_READ``, even where all are
    cached: :func:`populate` skips those, and the compute would fault each window in)."""
    lib = libc()
    if lib is None or lib.madvise(*_page_span(tensor), _MADV_POPULATE_READ) != 0:
        populate(tensor)
