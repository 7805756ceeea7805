"""What a process pays the first time it computes on weights read through a mapping: the kept set's residency asked
once (``mincore``) and a page fault per window as the pages are mapped. Its rate depends on the file's pages (how
they came into the page cache) as much as on the machine: files on one disk map at rates several times apart. So
it is measured on the run's own file where it can be (a cached stretch of the checkpoint's largest shard), and on a
freshly copied file (as an offload folder is written) otherwise; timed on a probe file instead, a first token was
predicted too fast."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path
from typing import Any

#: the most bytes of a file the rate is measured on
SAMPLE_BYTES = 32 * 2**20


def _resident_pages(lib: ctypes.CDLL, address: int, length: int) -> Any:
    """Per page of the mapped range, True where it is in the page cache (``mincore``), or None where it cannot be
    told."""
    import numpy

    count = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(count)
    if lib.mincore(address, length, vec) != 0:
        return None
    return (numpy.frombuffer(vec.raw, dtype=numpy.uint8, count=count) & 1).astype(bool)


def _longest_run(resident: Any) -> tuple[int, int]:
    """(first page, pages) of the longest run of resident pages."""
    import numpy

    edges = numpy.diff(numpy.concatenate(([0], resident.astype(numpy.int8), [0])))
    starts, ends = numpy.flatnonzero(edges == 1), numpy.flatnonzero(edges == -1)
    if not len(starts):
        return 0, 0
    i = int(numpy.argmax(ends - starts))
    return int(starts[i]), int(ends[i] - starts[i])


def _residency(lib: ctypes.CDLL, path: Path) -> Any:
    """Per page of the file at ``path``, whether it is in the page cache (None where it cannot be told)."""
    import numpy

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        pages = numpy.frombuffer(mapped, dtype=numpy.uint8)
        resident = _resident_pages(lib, pages.ctypes.data, len(pages))
        del pages
    return resident


def _touch_bps(lib: ctypes.CDLL, path: Path, resident: Any, sample: int) -> float | None:
    """Bytes/s a fresh mapping of ``path`` takes to be asked for its residency and to have every page faulted in,
    timed on up to ``sample`` bytes of its longest run of cached pages (``resident``; the best of two fresh
    mappings): None where under a megabyte of it is cached (then its first touch is a read from the disk)."""
    import numpy

    first, count = _longest_run(resident)
    length = min(count * mmap.PAGESIZE, sample, os.path.getsize(path) - first * mmap.PAGESIZE)
    if length < 2**20:
        return None
    best = float("inf")
    with open(path, "rb") as f:
        for _ in range(2):
            with mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ, offset=first * mmap.PAGESIZE) as mapped:
                pages = numpy.frombuffer(mapped, dtype=numpy.uint8)
                started = time.perf_counter()
                _resident_pages(lib, pages.ctypes.data, length)
                int(pages[:: mmap.PAGESIZE].sum())
                best = min(best, time.perf_counter() - started)
                del pages
    return length / best


def file_pages(files: list[Path], sample: int = SAMPLE_BYTES) -> dict[str, float]:
    """What the page cache holds of ``files`` now, each file asked once (``mincore``): ``cached_share``, the share of
    their bytes in it (what a run's first reads find there rather than on the disk: after a reboot, nothing), and
    ``first_touch_bps``, the rate the largest file's cached pages map at (:func:`_touch_bps`). Each left out where it
    cannot be told (no ``mincore``, no file, too little cached to time)."""
    from offload_core.storage.pagecache import libc

    lib = libc()
    files = [f for f in files if f.is_file() and f.stat().st_size >= mmap.PAGESIZE]
    if lib is None or not files:
        return {}
    residency = {path: _residency(lib, path) for path in files}
    if any(resident is None for resident in residency.values()):
        return {}
    found = {"cached_share": sum(int(r.sum()) for r in residency.values()) / sum(len(r) for r in residency.values())}
    largest = max(files, key=lambda f: f.stat().st_size)
    rate = _touch_bps(lib, largest, residency[largest], sample)
    if rate is not None:
        found["first_touch_bps"] = rate
    return found
