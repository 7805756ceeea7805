"""Opening an offload folder, line by line: why it is reused or rebuilt (check_reusable's exact answers), what is
logged, and the one-line errors of a folder that cannot be used."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import torch

import offload_core.storage.folder_record as folder_record
from offload_core.errors import StorageError
from offload_core.storage.folder import COMPLETE, INDEX, TAG
from offload_core.storage.folder_guard import stamp
from offload_core.storage.folder_record import check_reusable
from tests.logs import records_of
from tests.storage.folders import build_folder

TENSORS = {"a": torch.arange(8.0), "b": torch.ones(2, 3)}
FINGERPRINT = {"store": "memmap/3", "v": 1}


build = partial(build_folder, tensors=TENSORS)


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "no marker": (lambda f: (f / COMPLETE).unlink(), "incomplete"),
    "marker not JSON": (lambda f: (f / COMPLETE).write_text("{"), "incomplete"),
    "marker a list": (lambda f: (f / COMPLETE).write_text("[]"), "stale"),
    "other fingerprint": (lambda f: edit(f / COMPLETE, lambda m: m.update(fingerprint={"v": 2})), "stale"),
    "no index": (lambda f: (f / INDEX).unlink(), "verification (its index is unreadable)"),
    "index a list": (
        lambda f: (f / INDEX).write_text("[]"),
        "verification (its index or checksums are not JSON objects)",
    ),
    "checksums a list": (
        lambda f: edit(f / COMPLETE, lambda m: m.update(checksums=[])),
        "verification (its index or checksums are not JSON objects)",
    ),
    "index edited": (
        lambda f: edit(f / INDEX, lambda i: i["a"].update(shape=[4, 2])),
        "verification (index.json does not match its checksum)",
    ),
    "short file": (lambda f: (f / "a.dat").write_bytes(b"\0" * 31), "verification (a.dat has the wrong size)"),
    "flipped byte": (lambda f: flip(f / "b.dat"), "verification (b.dat does not match its checksum)"),
    "missing file": (lambda f: (f / "b.dat").unlink(), "verification (b.dat is missing or damaged)"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_check_reusable_says_why_a_folder_cannot_be_reused(tmp_path, damage):
    folder = tmp_path / "off"
    build(folder).close()
    restamped = []
    assert check_reusable(folder, FINGERPRINT, True, lambda *a: restamped.append(a)) is None
    assert restamped == []  # nothing changed since the marker was written
    change, why = DAMAGE[damage]
    change(folder)
    assert check_reusable(folder, FINGERPRINT, True, lambda *a: restamped.append(a)) == why
    assert restamped == []


def test_an_unreadable_index_checksum_and_an_unhashed_flip_without_verification(tmp_path, monkeypatch):
    folder = tmp_path / "off"
    build(folder).close()
    flip(folder / "a.dat")  # the size is right: without verification, trusted
    assert check_reusable(folder, FINGERPRINT, False, None) is None

    def failing(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(folder_record, "checksum", failing)
    assert check_reusable(folder, FINGERPRINT, False, None) == "verification (index.json is unreadable)"


def test_a_file_touched_since_it_was_hashed_is_handed_back_to_be_restamped(tmp_path):
    folder = tmp_path / "off"
    build(folder).close()
    marker = json.loads((folder / COMPLETE).read_text())
    os.utime(folder / "a.dat", ns=(10**18, 10**18))
    restamped = []
    assert check_reusable(folder, FINGERPRINT, True, lambda *a: restamped.append(a)) is None
    assert restamped == [(marker["checksums"], {**marker["stamps"], "a.dat": stamp(folder / "a.dat")})]


def test_an_untouched_reuse_leaves_the_marker_as_it_was(tmp_path):
    folder = tmp_path / "off"
    build(folder).close()
    before = stamp(folder / COMPLETE)
    build(folder).close()
    assert stamp(folder / COMPLETE) == before  # not written again (a rewrite is a new file: another inode)


@pytest.mark.parametrize("verify, said", [(True, "contents verified"), (False, "contents not verified: verify=false")])
def test_what_opening_logs(tmp_path, verify, said):
    folder = tmp_path / "off"
    with records_of("offload_core.storage.folder") as lines:
        build(folder).close()
        build(folder, verify=verify).close()
        (folder / COMPLETE).unlink()
        build(folder).close()
        build(folder, {"v": 2}).close()
    assert lines == [
        f"memmap: reusing complete offload folder {folder} ({said})",
        f"memmap: offload folder {folder} is incomplete; rebuilding it",
        f"memmap: offload folder {folder} is stale; rebuilding it",
    ]


@pytest.mark.parametrize("count, named", [(3, "a, b, c"), (4, "a, b, c, ...")])
def test_a_foreign_folder_is_refused_naming_three_of_its_files(tmp_path, count, named):
    folder = tmp_path / "off"
    folder.mkdir()
    for name in "abcd"[:count]:
        (folder / name).write_text("mine")
    with pytest.raises(StorageError) as info:
        build(folder)
    assert str(info.value) == (
        f"offload_folder {folder} holds files offload_core did not create ({named}); give an empty or new folder "
        "(nothing was changed)"
    )
    assert sorted(os.listdir(folder)) == sorted("abcd"[:count])


def test_what_a_start_of_ours_leaves_is_not_foreign(tmp_path):
    folder = tmp_path / "off"
    folder.mkdir()
    (folder / ".lock").write_text("123\n")
    (folder / (TAG + ".tmp")).write_text("{")
    store = build(folder)
    assert not store.reused and torch.equal(store["a"], TENSORS["a"])
    store.close()


def test_a_folder_that_cannot_be_made_or_prepared_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "off"
    with pytest.raises(StorageError) as info:
        build(folder)
    assert str(info.value) == f"cannot create offload_folder {folder}: Not a directory; choose a writable folder"
    folder = tmp_path / "off"
    (folder / (TAG + ".tmp")).mkdir(parents=True)  # where the tag is written first: cannot be
    with pytest.raises(StorageError) as info:
        build(folder)
    assert str(info.value) == (
        f"cannot prepare offload_folder {folder}: Is a directory; choose a writable folder with free space"
    )
    (folder / (TAG + ".tmp")).rmdir()
    build(folder).close()  # the lock was let go


def test_a_folder_another_live_model_reads_is_not_rebuilt_under_it(tmp_path):
    folder = tmp_path / "off"
    first = build(folder)
    with pytest.raises(StorageError) as info:
        build(folder, {"v": 2})
    assert str(info.value) == (
        f"offload_folder {folder} is in use by another model of this process built for different weights; delete "
        "that model or give another offload_folder"
    )
    second = build(folder)  # the same weights: shared
    assert second.reused and torch.equal(second["b"], TENSORS["b"])
    second.close()
    first.close()


def test_a_marker_without_stamps_has_every_file_hashed_and_restamped(tmp_path):
    folder = tmp_path / "off"
    build(folder).close()
    marker = json.loads((folder / COMPLETE).read_text())
    edit(folder / COMPLETE, lambda m: m.pop("stamps"))
    restamped = []
    assert check_reusable(folder, FINGERPRINT, True, lambda *a: restamped.append(a)) is None
    assert restamped == [(marker["checksums"], {name: stamp(folder / name) for name in ("a.dat", "b.dat")})]
