"""The folder lock across processes and threads: waiting for another process's folder holds up no other folder of
this process, and threads of one process waiting for the same folder share one hold on it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from offload_core.errors import StorageError
from offload_core.storage.folder_guard import LOCK, FolderLock
from tests.waits import wait_until

#: holds ``argv[1]/.lock`` (flock), the bytes ``argv[3]`` (hex) written in it, from the moment it creates ``argv[2]``
#: until its stdin closes
_HOLDER = """
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, bytes.fromhex(sys.argv[3]), 0)
open(sys.argv[2], "w").close()
sys.stdin.read()
"""


class Holder:
    """Another process holding a folder's lock until :meth:`let_go`."""

    def __init__(self, folder: Path, tmp_path: Path, says: bytes) -> None:
        ready = tmp_path / f"{folder.name}.held"
        command = [sys.executable, "-c", _HOLDER, str(folder), str(ready), says.hex()]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE)
        wait_until(lambda: ready.exists() or self.proc.poll() is not None, "the other process holding the lock", 60)
        assert self.proc.poll() is None, "the holder ended before taking the lock"

    def let_go(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            assert self.proc.wait(timeout=60) == 0


def locked_elsewhere(folder: Path) -> bool:
    """Whether some open file (this process's or another's) holds ``folder/.lock``: asked of a fresh open file."""
    fd = os.open(folder / LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the only descriptor of this open file lets a lock it took go
    return False


def in_background(target, name: str) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(target())
        except BaseException as error:  # noqa: BLE001 - reported to the test
            out.append(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, out


def waiting_message(capsys, seen: list[str]) -> str:
    seen.append(capsys.readouterr().err)
    return "".join(seen)


def test_waiting_for_another_process_folder_holds_up_no_other_folder(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    holder = Holder(a, tmp_path, b"4242" + b" " * 40 + b"\n")
    waiting, got_a = in_background(lambda: FolderLock(a), "waits-for-a")
    try:
        seen: list[str] = []
        said = wait_until(
            lambda: "in use by another run" in waiting_message(capsys, seen) and "".join(seen),
            "the thread waiting for a's lock",
        )
        assert said == (
            f"offload_core: offload_folder {a} is in use by another run (pid 4242); waiting for it to finish "
            "(Ctrl-C to stop, or give another offload_folder)\n"
        )
        assert got_a == [] and waiting.is_alive()  # still waiting for the other process
        other, got_b = in_background(lambda: FolderLock(b), "takes-b")
        other.join(timeout=30)
        assert not other.is_alive(), "b's lock waited for a's"
        (lock_b,) = got_b
        assert isinstance(lock_b, FolderLock) and locked_elsewhere(b)
        lock_b.release()
        assert not locked_elsewhere(b)
        assert got_a == []  # a is still the other process's
    finally:
        holder.let_go()
        waiting.join(timeout=60)
    (lock_a,) = got_a
    assert isinstance(lock_a, FolderLock)
    assert (a / LOCK).read_text() == f"{os.getpid()}\n"  # our pid replaces all the other process wrote
    lock_a.release()
    assert not locked_elsewhere(a)


@pytest.mark.parametrize(
    "says, pid",
    [(b"", "unknown"), (b"\xff77\n", "\ufffd77"), (b"7" * 40, "7" * 32)],  # at most 32 bytes are read
)
def test_threads_waiting_for_one_folder_share_one_hold_on_it(tmp_path, capsys, says, pid):
    """The flock is taken once per process: two threads waiting for the same folder both get it once the other
    process lets go (a second flock of this process would wait for the first forever), and it goes with the last."""
    a = tmp_path / "a"
    a.mkdir()
    holder = Holder(a, tmp_path, says)  # a holder that names no pid, or not in UTF-8
    threads = []
    try:
        first, got_first = in_background(lambda: FolderLock(a), "first")
        threads.append(first)
        seen: list[str] = []
        wait_until(lambda: "in use by another run" in waiting_message(capsys, seen), "the first thread waiting")
        assert f"offload_folder {a} is in use by another run (pid {pid}); waiting" in "".join(seen)
        second, got_second = in_background(lambda: FolderLock(a), "second")
        threads.append(second)
    finally:
        holder.let_go()
        for thread in threads:
            thread.join(timeout=60)
    assert not first.is_alive() and not second.is_alive()
    (one,), (two,) = got_first, got_second
    assert isinstance(one, FolderLock) and isinstance(two, FolderLock)
    one.release()
    one.release()  # idempotent: the second user still holds it
    assert locked_elsewhere(a)
    two.release()
    assert not locked_elsewhere(a)


def test_a_lock_that_cannot_be_taken_leaves_nothing_held(tmp_path):
    """A failed take is forgotten: the next lock of the same folder tries again (and the flock goes with it)."""
    folder = tmp_path / "a"
    (folder / LOCK).mkdir(parents=True)  # not a file: the lock cannot be opened
    with pytest.raises(StorageError) as info:
        FolderLock(folder)
    assert str(info.value) == (
        f"cannot create the lock file in offload_folder {folder}: Is a directory; choose a writable folder"
    )
    (folder / LOCK).rmdir()
    lock = FolderLock(folder)
    assert locked_elsewhere(folder)
    lock.release()
    assert not locked_elsewhere(folder)


def test_a_symlinked_lock_is_refused_and_its_target_untouched(tmp_path):
    folder, target = tmp_path / "a", tmp_path / "target"
    folder.mkdir()
    target.write_text("theirs")
    (folder / LOCK).symlink_to(target)
    with pytest.raises(StorageError) as info:
        FolderLock(folder)
    assert str(info.value) == (
        f"offload_folder {folder} holds a symlink (.lock); offload_core never follows links in its folder: remove "
        "the link (nothing was read or written through it) and run again"
    )
    assert target.read_text() == "theirs"
    (folder / LOCK).unlink()
    lock = FolderLock(folder)
    lock.release()
    assert not locked_elsewhere(folder)
