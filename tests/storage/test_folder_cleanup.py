"""What an offload folder removes when it is rebuilt or a write fails: exactly the files of the shapes it writes,
named in its tag, and the exact one-line error of a failed write."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from offload_core.errors import StorageError
from offload_core.storage import StoreContext
from offload_core.storage.folder import COMPLETE, INDEX, TAG, FolderStore
from tests.logs import records_of
from tests.storage.folders import build_folder

TENSORS = {"a": torch.arange(8.0), "b": torch.ones(2, 3)}


def build(folder: Path, version: int) -> FolderStore:
    return build_folder(folder, {"v": version}, tensors=TENSORS)


def test_a_rebuild_removes_the_tagged_files_of_our_shapes_and_nothing_else(tmp_path):
    folder = tmp_path / "off"
    build(folder, 1).close()
    assert sorted(os.listdir(folder)) == sorted([".lock", TAG, COMPLETE, INDEX, "a.dat", "b.dat"])
    (folder / "sub").mkdir()
    planted = {
        "user.txt": "mine",
        "c.dat": "mine",
        "sub/y.dat": "mine",
        "..\\z.dat": "mine",
        "notes.tmp": "mine",
        "x.dat.tmp": "ours",
        INDEX + ".tmp": "ours",
        TAG + ".tmp": "ours",
        COMPLETE + ".tmp": "ours",
    }
    for name, text in planted.items():
        (folder / name).write_text(text)
    # a tag naming files that are not ours (no .dat suffix, paths, a backslash) and one already gone
    tag = json.loads((folder / TAG).read_text())["files"]
    assert tag == ["a.dat", "b.dat", INDEX]
    (folder / TAG).write_text(
        json.dumps({"files": tag + ["user.txt", "sub/y.dat", "sub/../c.dat", "..\\z.dat", "gone.dat", 7]})
    )

    store = FolderStore(StoreContext(names=list(TENSORS), offload_folder=folder, fingerprint={"v": 2}))
    assert not store.reused
    left = {str(p.relative_to(folder)) for p in folder.rglob("*")}
    assert left == {".lock", TAG, "sub", "user.txt", "c.dat", "sub/y.dat", "..\\z.dat", "notes.tmp"}
    assert json.loads((folder / TAG).read_text()) == {"files": ["a.dat", "b.dat"]}  # this run's plan, named first
    store.close()


@pytest.mark.parametrize(
    "code, said",
    [
        (
            errno.ENOSPC,
            "no space left on the device of offload_folder {folder} while writing 'b'; free space or point "
            "offload_folder at a larger disk (the partial offload folder was removed; your files are untouched)",
        ),
        (
            errno.EDQUOT,
            "no space left on the device of offload_folder {folder} while writing 'b'; free space or point "
            "offload_folder at a larger disk (the partial offload folder was removed; your files are untouched)",
        ),
        (
            errno.EACCES,
            "cannot write offload_folder {folder} while writing 'b': Permission denied; check the folder (the "
            "partial offload folder was removed)",
        ),
    ],
)
def test_a_failed_write_removes_what_it_wrote_and_says_so_in_one_line(tmp_path, code, said):
    folder = tmp_path / "new" / "off"
    store = FolderStore(StoreContext(names=list(TENSORS), offload_folder=folder, fingerprint={"v": 1}))
    store.put("a", TENSORS["a"])
    assert (folder / "a.dat").exists() and store.bytes_written == 32
    for name in ("b.dat.tmp", INDEX + ".tmp", TAG + ".tmp", COMPLETE + ".tmp"):  # interrupted writes of ours: go too
        (folder / name).write_text("interrupted")

    def failing(path, data):
        raise OSError(code, os.strerror(code))

    store.write_file = failing
    with pytest.raises(StorageError) as info:
        store.put("b", TENSORS["b"])
    assert str(info.value) == said.format(folder=folder)
    assert sorted(os.listdir(folder)) == [".lock"]  # data, tag and temporary files gone; the lock until close
    assert len(store) == 0
    store.close()
    assert not folder.exists()  # the folder this store made for the failed write goes too
    assert (tmp_path / "new").exists()  # never more than that


def test_a_failed_index_write_in_an_existing_folder_keeps_the_folder(tmp_path):
    folder = tmp_path / "off"
    folder.mkdir()
    store = FolderStore(StoreContext(names=list(TENSORS), offload_folder=folder, fingerprint={"v": 1}))
    for name, tensor in TENSORS.items():
        store.put(name, tensor)

    def failing(path, data):
        raise OSError(errno.EIO, "")  # no strerror: the exception itself is said

    store.write_file = failing
    with pytest.raises(StorageError, match=r"while writing its index: \[Errno 5\] ; check the folder"):
        store.finalize()
    store.close()
    assert folder.exists() and os.listdir(folder) == []  # not ours to remove: only its contents were


def test_reuse_that_cannot_record_new_stamps_says_so_and_reuses(tmp_path, monkeypatch):
    """A touched file is hashed again (same bytes) and its new stamp recorded in the marker: best effort, so a full
    disk then is one log line, and the folder is still reused."""
    folder = tmp_path / "off"
    build(folder, 1).close()
    os.utime(folder / "a.dat", ns=(1, 1))
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full(path, data):
        raise error

    monkeypatch.setattr(FolderStore, "write_file", staticmethod(full))
    with records_of("offload_core.storage.folder") as said:
        store = build(folder, 1)
    assert store.reused
    # this folder's lines (a sealer an earlier test left running may log about its own folder meanwhile)
    assert [line for line in said if str(folder) in line] == [
        f"memmap: could not record the verified stamps in {folder} ({error})",
        f"memmap: reusing complete offload folder {folder} (contents verified)",
    ]
    store.close()
