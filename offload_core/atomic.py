"""File-system helpers for writes a crash never leaves half done: flush to the disk, and write beside then rename into
place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path


def fsync_path(path: str | os.PathLike | Path, follow: bool = True) -> None:
    """Flush a file (or a folder's entries) to the disk; with ``follow=False`` a symlink is refused (``ELOOP``)."""
    fd = os.open(path, os.O_RDONLY | (0 if follow else os.O_NOFOLLOW))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    target: str | os.PathLike | Path,
    *,
    folder: bool = False,
    sync: bool = True,
    merge: bool = False,
    last: Collection[str] = (),
) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` to write; when the block ends without error it takes ``target``'s place.

    A file's temporary is ``<name>.tmp`` (one writer per target at a time: callers hold a lock or own
    the folder); a folder's is a new empty folder ``.<name>.tmp-XXXX``. The move is one rename that
    replaces a file, or puts a folder where none is. With ``merge``, a folder whose ``target`` already
    exists is moved in entry by entry instead, the entries named in ``last`` after the others (an index
    after the files it names). ``sync`` flushes the temporary to the disk before the move (for a
    folder, its entries: the files in it are the caller's to flush) and the parent folder after it.
    On any error (Ctrl-C included) the temporary is removed and the error propagates.
    """
    target = Path(target)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    else:
        tmp = target.with_name(target.name + ".tmp")
        # A leftover temporary (or a link planted in its place) is removed, never followed; the new one is
        # created exclusively, so writing it can never reach a file elsewhere.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    try:
        yield tmp
        if sync:
            fsync_path(tmp)
        if folder and merge and target.is_dir():
            entries = sorted(os.listdir(tmp), key=lambda name: name in last)
            for name in entries:
                os.replace(tmp / name, target / name)
            tmp.rmdir()
            if sync:
                fsync_path(target)
        elif folder:
            os.rename(tmp, target)
        else:
            os.replace(tmp, target)
        if sync:
            fsync_path(target.parent)
    except BaseException:
        if folder:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise


def write_text_atomic(target: str | os.PathLike | Path, text: str) -> None:
    """Write ``text`` to ``target`` whole or not at all: a temporary of its own beside it (several processes may write
    the same file), flushed to the disk, then renamed into place; on any error the temporary is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
