"""An offload folder from finalize to close: what sealing writes (or logs when it cannot), a temporary folder never
sealed, mapped tensors that are normal tensors in any mode, and the readers count a closed store gives back."""

from __future__ import annotations

import errno
import json
import os
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from offload_core.errors import StorageError
from offload_core.storage import StoreContext
from offload_core.storage.folder import COMPLETE, INDEX, TAG, FolderStore
from offload_core.storage.folder_guard import LOCK, FolderLock, stamp
from tests.logs import records_of
from tests.storage.folders import build_folder

TENSORS = {"a": torch.arange(8.0), "b": torch.ones(2, 3), "e": torch.empty(0, 4)}


build = partial(build_folder, tensors=TENSORS)


def test_a_seal_that_cannot_write_its_marker_logs_and_the_next_run_rebuilds(tmp_path, monkeypatch):
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=list(TENSORS), offload_folder=folder, fingerprint={"v": 1}))
    for name, tensor in TENSORS.items():
        store.put(name, tensor)
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real = store.write_file

    def full_at_the_marker(path, data):
        if Path(path).name == COMPLETE + ".tmp":
            raise error
        real(path, data)

    store.write_file = full_at_the_marker
    with records_of("offload_core.storage.folder") as said:
        store.finalize()
        store.wait_until_sealed()
    assert said == [f"memmap: could not flush offload folder {folder} ({error}); it will be rebuilt next time"]
    assert sorted(os.listdir(folder)) == sorted([LOCK, TAG, INDEX, "a.dat", "b.dat", "e.dat"])  # unmarked
    assert torch.equal(store["a"], TENSORS["a"])  # still readable now
    store.close()
    with records_of("offload_core.storage.folder") as said:
        again = build(folder)
    assert not again.reused and said == [f"memmap: offload folder {folder} is incomplete; rebuilding it"]
    again.close()
    assert json.loads((folder / COMPLETE).read_text())["fingerprint"] == {"store": "memmap/3", "v": 1}


def test_a_reused_folder_is_not_written_by_finalize(tmp_path):
    folder = tmp_path / "off"
    build(folder).close()
    before = {name: stamp(folder / name) for name in (INDEX, COMPLETE, TAG)}
    store = build(folder)
    assert store.reused
    store.finalize()
    store.wait_until_sealed()
    store.close()
    assert {name: stamp(folder / name) for name in (INDEX, COMPLETE, TAG)} == before


def test_a_temporary_folder_is_never_sealed_and_goes_at_close():
    store = build(None)
    folder = store.folder
    store.wait_until_sealed()
    assert sorted(os.listdir(folder)) == sorted([LOCK, TAG, INDEX, "a.dat", "b.dat", "e.dat"])  # no marker
    assert json.loads((folder / INDEX).read_text())["e"] == {"dtype": "float32", "shape": [0, 4]}
    store.close()
    assert not folder.exists()


def test_mapped_tensors_are_normal_tensors_read_back_in_any_mode(tmp_path):
    store = build(tmp_path / "off")
    with torch.inference_mode():
        first = store["a"]  # mapped here: still a normal tensor outside inference mode
    assert not first.is_inference()
    assert torch.equal(first * 2, TENSORS["a"] * 2)
    for name, tensor in TENSORS.items():
        out = torch.full(tensor.shape, -1.0)
        store.read_into(name, out)
        assert torch.equal(out, tensor) and out.shape == tensor.shape, name
    assert store["e"].shape == (0, 4) and store["e"].dtype == torch.float32
    assert store.file_of("b") == tmp_path / "off" / "b.dat" and store.offset("b") == 0
    assert sorted(store) == sorted(TENSORS) and len(store) == 3
    store.close()


def test_a_closed_reader_no_longer_keeps_the_folder_from_being_rebuilt(tmp_path):
    """While another hold on the folder keeps this process's entry for it, a closed store's read is given back: a
    build for other weights may then rebuild the folder."""
    folder = tmp_path / "off"
    folder.mkdir()
    holding = FolderLock(folder)  # another user of the folder in this process, not reading it
    try:
        reader = build(folder)
        reader.close()
        other = build(folder, {"v": 2})
        assert not other.reused and torch.equal(other["b"], TENSORS["b"])
        other.close()
    finally:
        holding.release()


def test_a_folder_stays_in_use_while_any_of_its_readers_is_alive(tmp_path):
    folder = tmp_path / "off"
    first = build(folder)
    first.wait_until_sealed()
    second = build(folder)  # the same weights: a second reader
    assert second.reused
    first.close()
    with pytest.raises(StorageError, match="is in use by another model of this process"):
        build(folder, {"v": 2})
    assert torch.equal(second["a"], TENSORS["a"])
    second.close()
    third = build(folder, {"v": 2})  # no reader left
    assert not third.reused
    third.close()


def test_sealing_runs_on_a_named_daemon_thread_and_close_waits_for_it(tmp_path):
    folder = tmp_path / "off"
    store = FolderStore(StoreContext(names=["a"], offload_folder=folder, fingerprint={"v": 1}))
    store.put("a", TENSORS["a"])
    store.put("z", TENSORS["b"])  # not planned at opening: named in the tag when written
    entered, go_on = threading.Event(), threading.Event()
    real = store.write_file

    def held_at_the_marker(path, data):
        if Path(path).name == COMPLETE + ".tmp":
            entered.set()
            assert go_on.wait(timeout=60)
        real(path, data)

    store.write_file = held_at_the_marker
    before = set(threading.enumerate())
    store.finalize()
    assert entered.wait(timeout=60)
    (sealer,) = [t for t in set(threading.enumerate()) - before if t.name == "offload-folder-seal"]
    assert sealer.daemon and sealer.is_alive()
    assert not (folder / COMPLETE).exists()
    # it yields to the run: the lowest CPU priority for the sealer alone (it halved a 2-core run's first tokens)
    assert os.getpriority(os.PRIO_PROCESS, sealer.native_id) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19
    go_on.set()
    store.close()  # waits for the seal
    assert not sealer.is_alive() and (folder / COMPLETE).exists()
    assert json.loads((folder / TAG).read_text()) == {"files": ["a.dat", "z.dat", INDEX]}


def test_a_mapping_covers_the_tensors_bytes_only(tmp_path):
    """Bytes appended to a tensor's file after it was written (a careless tool) are not mapped into the tensor."""
    store = build(tmp_path / "off")
    store.wait_until_sealed()
    with open(store.file_of("b"), "ab") as handle:
        handle.write(b"\1" * 100)
    assert store["b"].shape == (2, 3) and torch.equal(store["b"], TENSORS["b"])
    store.close()
