"""Page-cache tools for the benchmarks: drop a file's cached pages (cold-cache runs), count what is still cached, time
sequential reads."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from pathlib import Path
from typing import Iterable

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
MADV_DONTNEED = 4


def _mappings_of(paths: set[str]) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``paths`` (from /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in paths:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((start, end))
    return ranges


def drop_cache(files: Iterable[str | os.PathLike]) -> None:
    """Drop ``files`` from the page cache, including pages this process still has mapped.

    ``posix_fadvise(DONTNEED)`` leaves pages that some process maps (the kernel skips mapped pages),
    and mapped stores keep their maps open; so first this process's page-table entries for those
    files are dropped with ``madvise(MADV_DONTNEED)`` (read-only mappings: the next access faults the
    page in from the file again), then the cached pages themselves with ``posix_fadvise``.
    """
    paths = {str(Path(f).resolve()) for f in files}
    for start, end in _mappings_of(paths):
        _libc.madvise(ctypes.c_void_p(start), end - start, MADV_DONTNEED)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(files: Iterable[str | os.PathLike]) -> float:
    """Fraction of the pages of ``files`` that sit in the page cache now (``mincore``)."""
    total = resident = 0
    for path in files:
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            pages = (size + PAGE - 1) // PAGE
            vector = (ctypes.c_ubyte * pages)()
            buffer = ctypes.c_char.from_buffer(mapped)
            try:
                if _libc.mincore(ctypes.addressof(buffer), size, vector) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed")
            finally:
                del buffer
            resident += sum(v & 1 for v in vector)
            total += pages
        finally:
            mapped.close()
    return resident / total if total else 0.0


def sequential_read_bandwidth(
    ranges: Iterable[tuple[str, int, int]], chunk: int = 16 << 20
) -> tuple[float, int, float]:
    """Drop the files from the cache, then read each ``(path, start, end)`` byte range front to back
    with ``chunk``-byte reads (ranges of one file merged where they touch).

    Returns (bytes per second, bytes read, seconds).
    """
    merged: dict[str, list[list[int]]] = {}
    for path, start, end in sorted((str(p), int(a), int(b)) for p, a, b in ranges):
        spans = merged.setdefault(path, [])
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    drop_cache(merged)
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    total = 0
    started = time.perf_counter()
    for path, spans in merged.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for start, end in spans:
                offset = start
                while offset < end:
                    n = os.preadv(fd, [view[: min(chunk, end - offset)]], offset)
                    if n <= 0:
                        break
                    offset += n
                total += offset - start
        finally:
            os.close(fd)
    seconds = time.perf_counter() - started
    return total / seconds, total, seconds


def mapped_read_bandwidth(ranges: Iterable[tuple[str, int, int]], chunk: int = 64 << 20) -> tuple[float, int, float]:
    """Drop the files from the cache, then read each ``(path, start, end)`` byte range the way the prefetch
    reader reads a streamed block: its pages mapped and read in with ``MADV_POPULATE_READ``, ``chunk``
    bytes at a time, each chunk dropped again after (``MADV_DONTNEED`` + ``POSIX_FADV_DONTNEED``).

    Returns (bytes per second, bytes read, seconds).
    """
    import torch

    from offload_core.storage.mapping import map_file, view
    from offload_core.storage.pagecache import drop, populate

    ranges = [(str(p), int(a), int(b)) for p, a, b in ranges]
    drop_cache({path for path, _, _ in ranges})
    total = 0
    started = time.perf_counter()
    for path, start, end in ranges:
        mapped = map_file(path)  # as the stores map: private, never written; unmapped with its last view
        whole = view(mapped, torch.uint8, (len(mapped),))
        for offset in range(start, end, chunk):
            piece = whole[offset : min(offset + chunk, end)]
            populate(piece)
            drop(piece, path, offset)
            total += piece.numel()
        del whole, mapped
    seconds = time.perf_counter() - started
    return total / seconds, total, seconds


def whole_files(files: Iterable[str | os.PathLike]) -> list[tuple[str, int, int]]:
    """Byte ranges covering ``files`` entirely."""
    return [(str(f), 0, os.path.getsize(f)) for f in files]


def warm(files: Iterable[str | os.PathLike], chunk: int = 16 << 20) -> None:
    """Read ``files`` once so their pages are in the page cache."""
    buffer = bytearray(chunk)
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
