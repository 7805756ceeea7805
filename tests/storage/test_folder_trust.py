"""A damaged, tampered or shared offload folder: never trusted when it changed, nothing outside it written, starts that
take turns."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from offload_core.errors import StorageError
from offload_core.storage.folder import COMPLETE, INDEX, TAG, FolderStore
from tests.storage.folders import build_folder

TENSORS = {"a": torch.arange(64.0), "b": torch.arange(64.0) * 2, "c": torch.ones(3, 5, dtype=torch.bfloat16)}


build = partial(build_folder, tensors=TENSORS)


def built(folder: Path) -> None:
    build(folder).close()


def assert_right(store: FolderStore) -> None:
    for name, tensor in TENSORS.items():
        assert torch.equal(store[name], tensor), name


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_keeping_times(path: Path) -> None:
    """Damage as a careless tool would: the bytes changed, the size and mtime put back (the ctime still moves)."""
    before = os.stat(path)
    flip(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def swap(folder: Path) -> None:
    a, b = (folder / "a.dat").read_bytes(), (folder / "b.dat").read_bytes()
    (folder / "a.dat").write_bytes(b)
    (folder / "b.dat").write_bytes(a)


def edit_index(change) -> callable:
    def damage(folder: Path) -> None:
        index = json.loads((folder / INDEX).read_text())
        change(index)
        (folder / INDEX).write_text(json.dumps(index))

    return damage


DAMAGE = {
    "flipped bytes": lambda folder: flip(folder / "a.dat"),
    "swapped files": swap,
    "flipped bytes, times put back": lambda folder: _flip_keeping_times(folder / "a.dat"),
    "truncated file": lambda folder: os.truncate(folder / "b.dat", 10),
    "removed file": lambda folder: (folder / "c.dat").unlink(),
    "index shape edited": edit_index(lambda index: index["a"].update(shape=[8, 8])),
    "index dtype edited": edit_index(lambda index: index["a"].update(dtype="int32")),
    "index entry dropped": edit_index(lambda index: index.pop("b")),
    "index unknown dtype": edit_index(lambda index: index["c"].update(dtype="complex7")),
    "index not json": lambda folder: (folder / INDEX).write_text("{oops"),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_folder_is_rebuilt_and_reads_right(damage, tmp_path, capfd):
    folder = tmp_path / "off"
    built(folder)
    damage(folder)
    store = build(folder)
    assert not store.reused
    assert_right(store)
    store.close()
    again = build(folder)
    assert again.reused
    assert_right(again)
    again.close()


def test_a_mismatch_is_said_in_one_line(tmp_path, capfd):
    folder = tmp_path / "off"
    built(folder)
    flip(folder / "a.dat")
    build(folder).close()
    lines = [line for line in capfd.readouterr().err.splitlines() if "failed verification" in line]
    assert lines == [
        f"offload_core: offload folder {folder} failed verification (a.dat does not match its checksum); rebuilding it"
    ]


def _hashed(monkeypatch) -> list[str]:
    """The names of the files hashed from now on."""
    import offload_core.storage.folder as folder_module
    import offload_core.storage.folder_guard as guard
    import offload_core.storage.folder_record as record

    names, real = [], guard.checksum

    def counting(path):
        names.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(guard, "checksum", counting)
    monkeypatch.setattr(folder_module, "checksum", counting)
    monkeypatch.setattr(record, "checksum", counting)
    return names


def test_reuse_hashes_only_what_changed_since_it_was_hashed(tmp_path, monkeypatch):
    """Verification stays on and costs almost nothing: a data file whose stamp (size, times, inode) is as recorded is
    not read; a touched one (same bytes) is hashed once, then trusted again; damaged bytes are always caught
    (``test_a_damaged_folder_is_rebuilt_and_reads_right``)."""
    folder = tmp_path / "off"
    built(folder)
    hashed = _hashed(monkeypatch)
    store = build(folder)
    assert store.reused and [n for n in hashed if n.endswith(".dat")] == []
    assert_right(store)
    store.close()
    os.utime(folder / "b.dat")
    again = build(folder)
    assert again.reused and [n for n in hashed if n.endswith(".dat")] == ["b.dat"]
    again.close()
    build(folder).close()
    assert [n for n in hashed if n.endswith(".dat")] == ["b.dat"]


def test_verify_false_trusts_sizes_only(tmp_path):
    folder = tmp_path / "off"
    built(folder)
    flip(folder / "a.dat")
    store = build(folder, verify=False)
    assert store.reused and not torch.equal(store["a"], TENSORS["a"])  # the documented risk of verify=false
    store.close()


@pytest.mark.parametrize(
    "name", ["a.dat", "a.dat.tmp", INDEX, INDEX + ".tmp", TAG, TAG + ".tmp", COMPLETE, COMPLETE + ".tmp", ".lock"]
)
@pytest.mark.parametrize("when", ["new", "built"])
def test_a_planted_symlink_is_refused_in_one_line_and_its_target_untouched(name, when, tmp_path):
    folder = tmp_path / "off"
    if when == "built":
        built(folder)
    else:
        folder.mkdir()
        (folder / TAG).write_text(json.dumps({"files": []}))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(victim)
    with pytest.raises(StorageError) as error:
        build(folder)
    assert str(error.value).count("\n") == 0 and f"holds a symlink ({name})" in str(error.value)
    assert victim.read_text() == "precious"
    assert (folder / name).is_symlink()  # reported, not removed: the user decides


def test_nothing_outside_the_folder_is_written_by_a_full_build(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    built(tmp_path / "off")
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if not p.is_relative_to(tmp_path / "off")}
    assert after == {p: m for p, m in before.items() if p in after} and set(after) == set(before)


# -- one process, one folder, several stores (a notebook cell run twice) --------------------------


def test_a_second_store_in_this_process_shares_the_folder_while_the_first_is_alive(tmp_path):
    folder = tmp_path / "off"
    first = build(folder)
    second = build(folder)  # would wait forever on its own process's lock without sharing
    assert second.reused
    assert_right(first)
    assert_right(second)
    first.close()
    assert_right(second)
    second.close()


def test_a_dropped_store_lets_the_folder_go_when_collected(tmp_path):
    folder = tmp_path / "off"
    first = build(folder)
    first.wait_until_sealed()  # its sealing thread holds it until done (slow under load)
    del first
    gc.collect()
    other = build(folder, fingerprint={"v": 2})  # a different build: only possible once the first is gone
    assert not other.reused
    other.close()


def test_a_live_store_is_never_rebuilt_under_by_this_process(tmp_path):
    folder = tmp_path / "off"
    first = build(folder)
    with pytest.raises(StorageError, match="in use by another model of this process"):
        build(folder, fingerprint={"v": 2})
    assert_right(first)
    first.close()


# -- simultaneous starts take turns ---------------------------------------------------------------


def _start(folder: str, barrier, results) -> None:
    barrier.wait()
    try:
        store = build(Path(folder))
        assert_right(store)
        store.close()
        results.put("ok")
    except BaseException as error:  # noqa: BLE001 - reported to the test
        results.put(f"{type(error).__name__}: {error}")


#: pairs of simultaneous openers a test races
PAIRS = 40


@pytest.mark.slow
def test_pairs_of_simultaneous_processes_take_turns(tmp_path):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    outcomes = []
    for trial in range(PAIRS):
        folder = str(tmp_path / f"off{trial}")
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=_start, args=(folder, barrier, results)) for _ in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(60)
        outcomes += [results.get(timeout=10) for _ in procs]
    assert outcomes == ["ok"] * 2 * PAIRS, [o for o in outcomes if o != "ok"][:3]


@pytest.mark.slow
def test_pairs_of_simultaneous_threads_take_turns(tmp_path):
    import queue

    outcomes = []
    for trial in range(PAIRS):
        results: queue.Queue = queue.Queue()
        barrier = threading.Barrier(2)
        threads = [
            threading.Thread(target=_start, args=(str(tmp_path / f"off{trial}"), barrier, results)) for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        outcomes += [results.get_nowait() for _ in threads]
    assert outcomes == ["ok"] * 2 * PAIRS, [o for o in outcomes if o != "ok"][:3]
