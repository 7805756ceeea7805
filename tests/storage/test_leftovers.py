"""The temporary offload folder of a run killed with ``kill -9`` (its ``.lock`` naming a dead process) is removed by
the next run that makes one; a folder a live run holds, or not ours, is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from offload_core.storage.leftovers import remove_leftovers

KILLED_RUN = """
import sys, time
from offload_core.loading.checkpoint import Checkpoint
from offload_core.registry.manager import get_registry
from offload_core.storage import StoreContext
registry = get_registry()
storage = registry.create("storage", "memmap", {"name": "memmap"})
store = storage.open(StoreContext(names=["w"], offload_folder=None, checkpoint=None, fingerprint={}))
print(store.folder, flush=True)
time.sleep(120)
"""


@pytest.mark.slow  # a process that imports offload_core and opens a store, then is killed
def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(tmp_path, monkeypatch):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN], stdout=subprocess.PIPE, text=True, env=env)
    try:
        folder = proc.stdout.readline().strip()
        assert folder.startswith(str(tmp_path / "offload_core-")), folder
        live = remove_leftovers(tmp_path)
        assert live == [] and os.path.isdir(folder)  # its run is alive: kept
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert os.path.isdir(folder) and os.path.isfile(os.path.join(folder, ".lock"))
    mine = tmp_path / "offload_core-not-a-run"  # no lock: not known to be ours
    mine.mkdir()
    # the next run's temporary store removes it as it makes its own
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    from offload_core.registry.manager import get_registry
    from offload_core.storage import StoreContext

    storage = get_registry().create("storage", "memmap", {"name": "memmap"})
    store = storage.open(StoreContext(names=["w"], offload_folder=None, checkpoint=None, fingerprint={}))
    try:
        assert not os.path.exists(folder) and mine.is_dir() and store.folder.is_dir()
    finally:
        store.close()


def test_a_lock_held_by_a_live_process_keeps_its_folder_whatever_pid_it_names(tmp_path):
    import fcntl

    folder = tmp_path / "offload_core-held"
    folder.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=60
    )
    (folder / ".lock").write_text(done.stdout)  # a pid that is gone
    with open(folder / ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # but a live process (another pid namespace, say) holds the lock
        assert remove_leftovers(tmp_path) == [] and folder.is_dir()
    assert remove_leftovers(tmp_path) == [folder] and not folder.exists()
