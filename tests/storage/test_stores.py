"""Stores round-trip every dtype exactly; the memmap folder is atomic, reusable, and never touches files it did not
write."""

from __future__ import annotations

import json
import os

import pytest
import torch

from offload_core.errors import StorageError
from offload_core.storage import StoreContext
from offload_core.storage.folder import COMPLETE, INDEX, FolderStore
from offload_core.storage.memory import HostMemoryStore


def _fill(store, tensors):
    for name, t in tensors.items():
        store.put(name, t)
    store.finalize()


def _assert_equal(store, tensors):
    assert set(store) == set(tensors)
    for name, t in tensors.items():
        got = store[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name


def test_host_memory_round_trip(tensors):
    store = HostMemoryStore(StoreContext(names=list(tensors)))
    _fill(store, tensors)
    _assert_equal(store, tensors)
    assert not store.pinned  # no accelerator here: plain memory, said once in the log


def test_host_memory_owned_tensor_is_not_copied():
    store = HostMemoryStore(StoreContext(names=["w"]))
    t = torch.randn(3)
    store.put("w", t, owned=True)
    assert store["w"].data_ptr() == t.data_ptr()
    store.put("v", t)
    assert store["v"].data_ptr() != t.data_ptr()


def test_memmap_round_trip_and_accelerate_index(tmp_path, tensors):
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=list(tensors), offload_folder=folder, fingerprint={"a": 1}))
    _fill(store, tensors)
    _assert_equal(store, tensors)
    index = json.loads((folder / INDEX).read_text())
    assert index["bf16"] == {"dtype": "bfloat16", "shape": [6, 8]}
    assert index["scalar"] == {"dtype": "float32", "shape": []}
    assert (folder / "f32.dat").stat().st_size == 6 * 8 * 4
    store.close()
    assert folder.exists()  # a folder the user named is kept


def test_memmap_read_is_a_mapping_not_a_copy(tmp_path):
    t = torch.randn(256, 256)
    store = FolderStore(StoreContext(names=["w"], offload_folder=tmp_path / "o"))
    _fill(store, {"w": t})
    got = store["w"]
    got2 = store["w"]
    assert got.data_ptr() == got2.data_ptr()
    # writing to the view never reaches the file (private copy-on-write mapping)
    got.zero_()
    store.close()
    again = FolderStore(StoreContext(names=["w"], offload_folder=tmp_path / "o"))
    assert again.reused
    assert torch.equal(again["w"], t)


def test_memmap_reuse_stale_and_partial(tmp_path):
    folder = tmp_path / "off"
    t = {"w": torch.arange(10.0)}
    s1 = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 1}))
    _fill(s1, t)
    s1.close()
    s2 = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 1}))
    assert s2.reused and s2.bytes_written == 0
    s2.close()
    stale = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 2}))
    assert not stale.reused
    assert not (folder / "w.dat").exists()  # our stale file removed before rebuilding
    _fill(stale, {"w": torch.ones(3)})
    stale.close()
    # Interrupted write: the marker is gone -> never trusted, rebuilt.
    (folder / COMPLETE).unlink()
    partial = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 2}))
    assert not partial.reused
    partial.close()
    # A truncated data file with a marker is not trusted either.
    s = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 3}))
    _fill(s, {"w": torch.ones(100)})
    s.close()
    with open(folder / "w.dat", "r+b") as f:
        f.truncate(10)
    s = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 3}))
    assert not s.reused
    s.close()


def test_memmap_refuses_a_folder_with_files_it_did_not_create(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.txt").write_text("only copy")
    with pytest.raises(StorageError, match="did not create"):
        FolderStore(StoreContext(names=["w"], offload_folder=folder))
    assert (folder / "thesis.txt").read_text() == "only copy"
    assert sorted(os.listdir(folder)) == ["thesis.txt"]


def test_memmap_rebuild_keeps_foreign_files_added_later(tmp_path):
    folder = tmp_path / "off"
    s = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 1}))
    _fill(s, {"w": torch.ones(2)})
    s.close()
    (folder / "notes.md").write_text("mine")
    s = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 2}))
    s.close()
    assert (folder / "notes.md").read_text() == "mine"


def test_memmap_index_escaping_the_folder_is_refused(tmp_path):
    folder = tmp_path / "off"
    s = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 1}))
    _fill(s, {"w": torch.ones(2)})
    s.close()
    (tmp_path / "escape.dat").write_bytes(b"outside")
    (folder / INDEX).write_text(json.dumps({"../escape": {"dtype": "float32", "shape": [2]}}))
    rebuilt = FolderStore(StoreContext(names=["w"], offload_folder=folder, fingerprint={"v": 1}))
    assert not rebuilt.reused  # an edited index fails verification: rebuilt, nothing outside read or touched
    rebuilt.close()
    assert (tmp_path / "escape.dat").read_bytes() == b"outside"
    with pytest.raises(StorageError, match="escape"):
        FolderStore(StoreContext(names=["x"], offload_folder=folder)).put("../x", torch.ones(1))


def test_memmap_temporary_folder_removed_on_close():
    store = FolderStore(StoreContext(names=["w"]))
    _fill(store, {"w": torch.ones(4)})
    folder = store.folder
    assert folder.exists()
    store.close()
    assert not folder.exists()
