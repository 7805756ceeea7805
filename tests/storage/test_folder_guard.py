"""The offload folder's guards, value by value: opens that refuse links and non-files (and never block on a FIFO),
scans, checksums and stamps, the rule that trusts an unchanged file, dtype names and safe file names."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import xxhash

from offload_core.errors import StorageError
from offload_core.storage.folder_guard import (
    checksum,
    dtype_from_name,
    dtype_name,
    entries,
    matches,
    open_nofollow,
    safe_file_name,
    stamp,
)


def test_open_nofollow_opens_a_regular_file_blocking_and_creates_one_with_its_mode(tmp_path):
    path = tmp_path / "a.dat"
    path.write_bytes(b"abc")
    fd = open_nofollow(path)
    try:
        assert os.get_blocking(fd) and os.read(fd, 10) == b"abc"
    finally:
        os.close(fd)
    old = os.umask(0o022)
    try:
        fd = open_nofollow(tmp_path / "new", os.O_RDWR | os.O_CREAT, 0o640)
    finally:
        os.umask(old)
    try:
        assert os.get_blocking(fd) and os.write(fd, b"xy") == 2
        assert (os.fstat(fd).st_mode & 0o777) == 0o640 and (tmp_path / "new").read_bytes() == b"xy"
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        open_nofollow(tmp_path / "missing")


def test_open_nofollow_refuses_a_symlink_a_folder_and_a_fifo_in_one_line(tmp_path):
    target = tmp_path / "target"
    target.write_text("theirs")
    (tmp_path / "link.dat").symlink_to(target)
    with pytest.raises(StorageError) as info:
        open_nofollow(tmp_path / "link.dat")
    assert str(info.value) == (
        f"offload_folder {tmp_path} holds a symlink (link.dat); offload_core never follows links in its folder: "
        "remove the link (nothing was read or written through it) and run again"
    )
    (tmp_path / "dir.dat").mkdir()
    with pytest.raises(StorageError) as info:
        open_nofollow(tmp_path / "dir.dat")
    assert (
        str(info.value) == f"offload folder entry {tmp_path / 'dir.dat'} is not a regular file; remove it and run again"
    )
    os.mkfifo(tmp_path / "pipe.dat")
    said: list = []

    def opening() -> None:
        try:
            open_nofollow(tmp_path / "pipe.dat")
        except StorageError as error:
            said.append(str(error))

    thread = threading.Thread(target=opening, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():  # blocked opening the FIFO: let it go (a writer ends the wait) before failing
        os.close(os.open(tmp_path / "pipe.dat", os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=30)
        pytest.fail("opening a FIFO waited for a writer")
    assert said == [f"offload folder entry {tmp_path / 'pipe.dat'} is not a regular file; remove it and run again"]
    assert target.read_text() == "theirs"


def test_entries_names_the_folder_and_refuses_a_symlink(tmp_path):
    assert entries(tmp_path) == set()
    (tmp_path / "a.dat").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    assert entries(tmp_path) == {"a.dat", "sub"}
    (tmp_path / "z").symlink_to(tmp_path / "sub")
    with pytest.raises(StorageError, match=r"holds a symlink \(z\); offload_core never follows links"):
        entries(tmp_path)


@pytest.mark.parametrize("size", [0, 1, 1000, (16 << 20) + 3])
def test_checksum_is_xxh3_128_of_the_bytes(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert checksum(tmp_path / "f") == xxhash.xxh3_128(data).hexdigest()


def test_a_stamp_is_size_times_and_inode_and_an_unchanged_stamp_is_trusted_unread(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"12345")
    info = os.lstat(path)
    now = [5, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]
    assert stamp(path) == now
    right = xxhash.xxh3_128(b"12345").hexdigest()
    assert matches(path, right, None) == (True, now)  # no stamp recorded: hashed, the same bytes
    assert matches(path, "wrong", now) == (True, now)  # the recorded stamp: trusted without reading
    assert matches(path, "wrong", [5, 0, 0, info.st_ino]) == (False, now)  # another stamp: hashed, and differs
    assert matches(path, right, [5, 0, 0, info.st_ino]) == (True, now)


def test_dtype_names_go_both_ways_and_an_unknown_one_is_refused():
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.float16) == "float16"
    for name in ("complex7", "Tensor"):  # torch.Tensor exists, but is no dtype
        with pytest.raises(StorageError) as info:
            dtype_from_name(name)
        assert str(info.value) == (
            f"offload index names an unknown dtype {name!r}: delete the offload folder and run again"
        )


def test_safe_file_name_keeps_a_name_inside_the_folder(tmp_path):
    assert safe_file_name(tmp_path, "model.layers.0.weight") == tmp_path / "model.layers.0.weight.dat"
    for name in ("../up", "a/b", "a\\b", ".hidden", "a\x00b"):
        with pytest.raises(StorageError) as info:
            safe_file_name(tmp_path, name)
        assert str(info.value) == (
            f"offload index in {tmp_path} names tensor {name!r}, which would escape the folder; "
            "delete that offload folder (it was not written by offload_core) and run again"
        )
