"""What keeps an offload folder safe to share: its lock (one per folder per process, shared by stores in one process),
symlink-refusing opens and scans, and content checksums."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
import threading
from pathlib import Path

import torch
import xxhash

from offload_core.errors import StorageError

LOCK = ".lock"
#: opening flags that never follow a symlink in the last path component, nor leak into child processes
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
#: bytes hashed at a time (:func:`checksum`): a folder's seal hashes on a thread beside the first tokens, in the budget
_CHUNK = 1 << 20


def open_nofollow(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symlink (and anything but a regular file) with a one-line :class:`StorageError`."""
    try:
        fd = os.open(path, flags | NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise symlink_error(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"offload folder entry {path} is not a regular file; remove it and run again")
    os.set_blocking(fd, True)
    return fd


def symlink_error(path: Path) -> StorageError:
    return StorageError(
        f"offload_folder {path.parent} holds a symlink ({path.name}); offload_core never follows links "
        "in its folder: remove the link (nothing was read or written through it) and run again"
    )


def entries(folder: Path, links: bool = False) -> set[str]:
    """The names in ``folder``; a symlink among them is refused with one line (unless ``links``: listed)."""
    names = set()
    with os.scandir(folder) as scan:
        for entry in scan:
            if entry.is_symlink() and not links:
                raise symlink_error(folder / entry.name)
            names.add(entry.name)
    return names


def checksum(path: Path) -> str:
    """xxh3-128 of the regular file at ``path`` (never through a symlink)."""
    digest = xxhash.xxh3_128()
    fd = open_nofollow(path)
    try:
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as handle:
            # no larger than the file: a folder of many small tensors would otherwise zero a whole chunk per file
            buffer = bytearray(max(1, min(_CHUNK, os.fstat(fd).st_size)))
            view = memoryview(buffer)
            while count := handle.readinto(view):
                digest.update(view[:count])
    finally:
        os.close(fd)
    return digest.hexdigest()


def stamp(path: Path) -> list[int]:
    """What changes whenever a file's bytes may have (never through a symlink): its size, mtime and ctime (a write,
    a truncation, a touch) and inode (a replacement)."""
    info = os.lstat(path)
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]


def matches(path: Path, digest: object, recorded: object) -> tuple[bool, list[int]]:
    """Whether the file at ``path`` holds the bytes whose :func:`checksum` is ``digest``, and its stamp now. The one
    rule for the files offload_core trusts (offload folders, model caches): a file whose :func:`stamp` equals the
    one ``recorded`` when it was last hashed is trusted without reading it; any other is hashed and compared. The
    stamp is taken before hashing, so a change while it is hashed is seen next time."""
    now = stamp(path)
    return (now == recorded or checksum(path) == digest), now


class _Held:
    def __init__(self) -> None:
        self.fd: int | None = None  # the flocked lock file, once taken
        self.taking = threading.Lock()  # held by the one thread of this process taking (or waiting for) the flock
        self.users = 0
        self.readers = 0  # stores of this process whose tensors come from the folder as it is now
        self.building = threading.Lock()  # held by the one store of this process inspecting or writing the folder


_held: dict[Path, _Held] = {}
_held_guard = threading.Lock()


class FolderLock:
    """This process's hold on one folder's ``.lock``: taken once per process (flock), shared by every store
    of the process that uses the folder, and let go when the last of them releases it (or is collected)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._released = False
        self._building: threading.Lock | None = None
        self._reading = False
        with _held_guard:  # never held while waiting for another process: other folders' stores go on
            held = _held.get(folder)
            if held is None:
                held = _held[folder] = _Held()
            held.users += 1  # kept in _held (and its flock once taken) until this user lets go
        try:
            with held.taking:  # the first thread takes the flock; the others of this process wait for it and share it
                if held.fd is None:
                    held.fd = _take(folder)
        except BaseException:
            with _held_guard:
                _let_go(folder, held)
            raise

    def begin_build(self) -> None:
        """Wait until no other store of this process is inspecting or writing the folder, then be that store."""
        with _held_guard:
            building = _held[self.folder].building
        building.acquire()
        self._building = building

    def end_build(self) -> None:
        """Idempotent: let the next store of this process inspect the folder."""
        building, self._building = self._building, None
        if building is not None:
            building.release()

    def reading(self) -> None:
        """This store now reads the folder's content: no other store of this process may rebuild it."""
        with _held_guard:
            if not self._reading:
                self._reading = True
                _held[self.folder].readers += 1

    @property
    def shared(self) -> bool:
        """Whether another store of this process reads the folder's content."""
        with _held_guard:
            return _held[self.folder].readers > int(self._reading)

    def release(self) -> None:
        """Idempotent: the flock goes with the last user in this process."""
        self.end_build()
        with _held_guard:
            if self._released:
                return
            self._released = True
            held = _held[self.folder]
            held.readers -= int(self._reading)
            _let_go(self.folder, held)


def _let_go(folder: Path, held: _Held) -> None:
    """One user fewer (the caller holds ``_held_guard``): the last one closes the flocked file, if it was taken."""
    held.users -= 1
    if held.users == 0:
        del _held[folder]
        if held.fd is not None:
            os.close(held.fd)


def _take(folder: Path) -> int:
    """Open (never through a symlink) and flock ``folder/.lock``, waiting for another process; write our pid in it."""
    path = folder / LOCK
    try:
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise StorageError(
            f"cannot create the lock file in offload_folder {folder}: {exc.strerror}; choose a writable folder"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            print(
                f"offload_core: offload_folder {folder} is in use by another run (pid {holder}); "
                "waiting for it to finish (Ctrl-C to stop, or give another offload_folder)",
                file=sys.stderr,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as an offload index names it (``float32``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype an offload index names; an unknown one is refused."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StorageError(f"offload index names an unknown dtype {name!r}: delete the offload folder and run again")
    return dtype


def safe_file_name(folder: Path, name: str) -> Path:
    """``<name>.dat`` inside ``folder``; a name that would escape the folder is refused."""
    if "/" in name or "\\" in name or name.startswith(".") or "\x00" in name:
        raise StorageError(
            f"offload index in {folder} names tensor {name!r}, which would escape the folder; "
            "delete that offload folder (it was not written by offload_core) and run again"
        )
    return folder / f"{name}.dat"
