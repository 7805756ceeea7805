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
    span = whole[(16 << 20) + 100:(32 << 20) + 100]  # 16 MiB, not page aligned: more than one read-ahead window
    will_need(span)
    deadline = time.monotonic() + 10
    while not resident(span) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert resident(span)
    assert not resident(whole[:8 << 20]) and not resident(whole[(40 << 20):])
