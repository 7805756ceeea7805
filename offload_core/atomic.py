"""Small file-system helpers shared by the checkpoint writer and the offload folder."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike | Path) -> None:
    """Flush a file (or a folder's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
