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
    deadline = time.monotonic() + 10
    while not resident(span) and time.monotonic() < deadline:
        will_need(span)  # a hint the kernel may drop while its disk queue is busy (a loaded machine): given again
        time.sleep(0.05)
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


def test_page_spans_merge_neighbours_only_where_no_whole_page_lies_between(tmp_path):
    """A layer's tensors side by side make one range (one mincore); a whole page between two tensors keeps them apart,
    so asking the ranges is asking each tensor, never a page that neither holds."""
    from offload_core.storage.pagecache import page_spans, populate, spans_resident

    page = mmap.PAGESIZE
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(64 * page))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    base = whole.data_ptr()
    a = whole[100 : 2 * page + 50]  # pages 0-2
    b = whole[3 * page + 20 : 4 * page]  # page 3: next to a's last page
    c = whole[4 * page : 4 * page + 8]  # page 4, right after b
    d = whole[6 * page + 1 : 7 * page]  # page 6: page 5 lies between c and d
    empty = whole[10:10]
    assert page_spans([d, b, empty, a, c]) == [(base, 4 * page + 8), (base + 6 * page, page)]
    assert page_spans([]) == [] and spans_resident([])
    if resident(whole):
        pytest.skip("this file system keeps the file in memory (the page cache cannot be dropped)")
    tensors = [a, b, c, d]
    assert not spans_resident(page_spans(tensors)) and not all(map(resident, tensors))
    for tensor in tensors:
        populate(tensor)
    assert all(map(resident, tensors)) and spans_resident(page_spans(tensors))
