"""Temporary offload folders that killed runs left behind (``offload_core-*`` in the temporary directory, whose
``.lock`` names a process that is gone and is held by none): removed by the next run that makes one."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from offload_core.storage.folder_guard import LOCK, open_nofollow

PREFIX = "offload_core-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _abandoned(folder: Path) -> bool:
    """Whether ``folder`` is a temporary offload folder of ours whose run is gone: its ``.lock`` names a pid that is
    not alive, and no process holds the lock (checked holding it, so a run starting now is never disturbed)."""
    try:
        if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
            return False
        fd = open_nofollow(folder / LOCK, os.O_RDWR)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live run holds it
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return text.isdigit() and not _alive(int(text))
    finally:
        os.close(fd)  # the flock goes with it


def remove_leftovers(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the abandoned temporary offload folders in ``root`` (the temporary directory); returns them."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for folder in root.glob(f"{PREFIX}*"):
        if _abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
