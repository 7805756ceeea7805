"""Hinting a mapped tensor ahead of use (``will_need``) reads all of its pages in, and not its neighbours'."""

from __future__ import annotations

import mmap
import os
import time

import pytest
import torch

from offload_core.storage.pagecache import resident, will_need


def test_a_hinted_span_is_read_in_whole_and_alone(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(48 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # private: writable for torch, the file untouched
    finally:
        os.close(fd)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    if resident(whole):
        pytest.skip("this file system keeps the file in memory (the page cache cannot be dropped)")
    span = whole[(16 << 20) + 100 : (32 << 20) + 100]  # 16 MiB, not page aligned: more than one read-ahead window
    will_need(span)
    deadline = time.monotonic() + 10
    while not resident(span) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident(span)
    assert not resident(whole[: 8 << 20]) and not resident(whole[(40 << 20) :])


def test_file_ranges_are_merged_in_file_order_and_hinted_whole(tmp_path, monkeypatch):
    """Neighbouring ranges (two routed experts side by side) become one read; a hint longer than a read-ahead window
    is given in 1 MiB pieces that cover it (one call would read one window and drop the rest)."""
    from offload_core.storage import pagecache

    a, b = tmp_path / "a", tmp_path / "b"
    for path in (a, b):
        path.write_bytes(b"\0" * 4096)
    assert pagecache.coalesce([(b, 10, 20), (a, 50, 60), (a, 0, 50), (a, 70, 80)]) == [
        (a, 0, 60),
        (a, 70, 80),
        (b, 10, 20),
    ]
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((offset, length, advice)))
    pagecache.advise_ranges([(a, 3 << 20, 6 << 20), (a, 100, 3 << 20)], "POSIX_FADV_WILLNEED")
    assert calls[0][0] == 100 and all(length <= 1 << 20 for _, length, _ in calls)
    assert sum(length for _, length, _ in calls) == (6 << 20) - 100  # one range, nothing twice
    assert all(x + n == y for (x, n, _), (y, _, _) in zip(calls, calls[1:]))
