"""An offload folder's record of itself, value by value: the completion marker's contents (and its stamps renewed when a
file was touched), the index and tag as read back, where each tensor's bytes lie in its file, and what a failed write
leaves for the next store of this process."""

from __future__ import annotations

import errno
import json
import os
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from offload_core.alignment import ALIGNMENT
from offload_core.errors import StorageError
from offload_core.storage import StoreContext
from offload_core.storage.folder import COMPLETE, INDEX, TAG, FolderStore
from offload_core.storage.folder_guard import checksum, stamp
from offload_core.storage.folder_record import read_index, tagged_files
from tests.storage.folders import build_folder

TENSORS = {"a": torch.arange(8.0), "b": torch.ones(2, 3)}


build = partial(build_folder, tensors=TENSORS)


def record(folder: Path) -> dict:
    """What the completion marker should say of the folder as it is now."""
    files = ["a.dat", "b.dat", INDEX]
    return {
        "fingerprint": {"store": "memmap/3", "v": 1},
        "checksums": {name: checksum(folder / name) for name in files},
        "stamps": {name: stamp(folder / name) for name in files},
    }


def test_the_marker_records_the_fingerprint_and_each_files_checksum_and_stamp(tmp_path):
    folder = tmp_path / "off"
    build(folder).close()
    assert json.loads((folder / COMPLETE).read_text()) == record(folder)
    assert json.loads((folder / INDEX).read_text()) == {
        "a": {"dtype": "float32", "shape": [8]},
        "b": {"dtype": "float32", "shape": [2, 3]},
    }
    assert json.loads((folder / TAG).read_text()) == {"files": ["a.dat", "b.dat", INDEX]}


def test_a_touched_file_is_restamped_in_the_marker_and_the_rest_kept(tmp_path):
    folder = tmp_path / "off"
    build(folder).close()
    before = json.loads((folder / COMPLETE).read_text())
    os.utime(folder / "b.dat", ns=(10**18, 10**18))  # same bytes, a new stamp
    store = build(folder)
    assert store.reused and torch.equal(store["b"], TENSORS["b"])
    store.close()
    after = json.loads((folder / COMPLETE).read_text())
    assert after == record(folder)
    assert after["stamps"]["b.dat"] != before["stamps"]["b.dat"]
    assert after["stamps"]["a.dat"] == before["stamps"]["a.dat"] and after["checksums"] == before["checksums"]


def test_an_unreadable_index_is_refused_in_one_line(tmp_path):
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(StorageError) as info:
        read_index(tmp_path)
    assert str(info.value) == (
        f"offload index {tmp_path / INDEX} is unreadable (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)); delete the folder and run again"
    )
    (tmp_path / INDEX).write_text(json.dumps({"ok": {}, "../up": {}}))
    with pytest.raises(StorageError, match=r"names tensor '\.\./up', which would escape the folder"):
        read_index(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"ok": {"dtype": "int8", "shape": [1]}}))
    assert read_index(tmp_path) == {"ok": {"dtype": "int8", "shape": [1]}}


@pytest.mark.parametrize(
    "tag, files",
    [
        (None, []),  # no tag at all
        ("[1, 2]", []),  # not an object
        ("{}", []),  # no list of files
        ("{oops", []),  # not JSON
        (json.dumps({"files": ["a.dat", 3, None, "b.dat"]}), ["a.dat", "b.dat"]),  # only the names
    ],
)
def test_the_tag_lists_only_the_names_it_holds(tmp_path, tag, files):
    if tag is not None:
        (tmp_path / TAG).write_text(tag)
    assert tagged_files(tmp_path) == files


def test_a_tag_without_a_list_of_files_still_lets_the_folder_be_rebuilt(tmp_path):
    folder = tmp_path / "off"
    build(folder).close()
    (folder / TAG).write_text("{}")
    store = build(folder, {"v": 2})
    assert not store.reused  # the index and marker went; the data files were written again
    assert torch.equal(store["a"], TENSORS["a"]) and torch.equal(store["b"], TENSORS["b"])
    store.close()


def test_each_tensors_bytes_lie_at_its_reference_offset_in_its_file(tmp_path):
    """A contiguous tensor's bytes lie at its address's offset modulo ALIGNMENT (that many zero bytes first); a
    non-contiguous one is written contiguous, at offset 0."""
    base = torch.arange(40.0)
    shifted = base[3:11]  # 3 floats into its storage: 12 bytes past base's address
    transposed = base[3:9].reshape(2, 3).t()  # not contiguous, though it starts 12 bytes in too
    expected = (base.data_ptr() + 12) % ALIGNMENT
    assert expected == shifted.data_ptr() % ALIGNMENT
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=["s", "t"], offload_folder=folder))
    store.put("s", shifted)
    store.put("t", transposed)
    store.finalize()
    store.wait_until_sealed()
    index = json.loads((folder / INDEX).read_text())
    assert index["t"] == {"dtype": "float32", "shape": [3, 2]} and store.offset("t") == 0
    assert (folder / "t.dat").read_bytes() == transposed.contiguous().numpy().tobytes()
    assert store.offset("s") == expected
    assert index["s"] == {"dtype": "float32", "shape": [8], **({"offset": expected} if expected else {})}
    assert (folder / "s.dat").read_bytes() == bytes(expected) + shifted.numpy().tobytes()
    assert store.bytes_written == 8 * 4 + 6 * 4
    for name, tensor in (("s", shifted), ("t", transposed)):
        assert torch.equal(store[name], tensor) and store[name].data_ptr() % ALIGNMENT == store.offset(name)
    store.close()


def test_a_failed_write_lets_the_next_store_of_this_process_in_before_close(tmp_path):
    """The failed store stops building the folder at once: another store of this process opening the same folder
    goes ahead (rebuilding it) without waiting for the failed one to be closed."""
    folder = tmp_path / "off"
    failed = FolderStore(StoreContext(names=list(TENSORS), offload_folder=folder, fingerprint={"v": 1}))
    failed.put("a", TENSORS["a"])

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    failed.write_file = full
    with pytest.raises(StorageError, match="no space left"):
        failed.put("b", TENSORS["b"])
    opened: list = []
    thread = threading.Thread(target=lambda: opened.append(build(folder)), daemon=True)
    thread.start()
    thread.join(timeout=60)
    try:
        assert not thread.is_alive(), "the next store waited for the failed one"
        (store,) = opened
        assert not store.reused and torch.equal(store["b"], TENSORS["b"])
        store.close()
    finally:
        failed.close()
        thread.join(timeout=60)
    assert (folder / COMPLETE).exists()  # the second store's build is complete and kept
