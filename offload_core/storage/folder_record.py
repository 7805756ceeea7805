"""An offload folder's record of itself: ``index.json``, the tag ``.offload_core`` (every file we wrote, so only those
are ever removed) and the completion marker ``.offload_complete`` (the fingerprint, each file's checksum and stamp):
reading them, deciding whether the folder can be reused, and removing exactly our files (see
:mod:`offload_core.storage.folder`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from offload_core.atomic import atomic_write
from offload_core.errors import StorageError
from offload_core.storage.folder_guard import checksum, dtype_from_name, matches, open_nofollow, safe_file_name

INDEX = "index.json"
TAG = ".offload_core"
COMPLETE = ".offload_complete"


def read_json(folder: Path, name: str) -> Any:
    fd = open_nofollow(folder / name)
    with os.fdopen(fd, "rb") as handle:
        return json.loads(handle.read())


def marker(fingerprint: dict, sums: dict[str, str], stamps: dict[str, list[int]]) -> bytes:
    """The completion marker's bytes."""
    return json.dumps({"fingerprint": fingerprint, "checksums": sums, "stamps": stamps}).encode()


def check_reusable(
    folder: Path, fingerprint: dict, verify: bool, restamp: Callable[[dict[str, str], dict[str, list[int]]], None]
) -> str | None:
    """None when ``folder`` holds a complete, intact copy for ``fingerprint``; else why not (the index's own checksum
    is always checked, so an edited, dropped or added entry is never used). Files whose stamp changed but whose bytes
    did not are handed to ``restamp(sums, stamps)`` (so they are not hashed again next time)."""
    try:
        complete = read_json(folder, COMPLETE)
    except (OSError, ValueError):
        return "incomplete"
    if not isinstance(complete, dict) or complete.get("fingerprint") != json.loads(json.dumps(fingerprint)):
        return "stale"
    try:
        index = read_json(folder, INDEX)
    except (OSError, ValueError):
        return "verification (its index is unreadable)"
    sums = complete.get("checksums")
    if not isinstance(index, dict) or not isinstance(sums, dict):
        return "verification (its index or checksums are not JSON objects)"
    try:
        if checksum(folder / INDEX) != sums.get(INDEX):
            return "verification (index.json does not match its checksum)"
    except (OSError, StorageError):
        return "verification (index.json is unreadable)"
    for name in index:
        safe_file_name(folder, name)  # an intact index naming paths outside the folder: refuse, never read
    recorded = complete.get("stamps") if isinstance(complete.get("stamps"), dict) else {}
    stamps = {}
    for file in [safe_file_name(folder, name).name for name in index]:
        path = folder / file
        try:
            info = index[file.removesuffix(".dat")]
            expected = int(np.prod(info["shape"], dtype=np.int64)) * dtype_from_name(info["dtype"]).itemsize + int(
                info.get("offset", 0)
            )
            if os.lstat(path).st_size != expected:
                return f"verification ({file} has the wrong size)"
            if verify:  # a file unchanged since it was hashed is not read again (folder_guard.matches)
                same, stamps[file] = matches(path, sums.get(file), recorded.get(file))
                if not same:
                    return f"verification ({file} does not match its checksum)"
        except (OSError, KeyError, TypeError, ValueError, StorageError):
            return f"verification ({file} is missing or damaged)"
    if any(now != recorded.get(file) for file, now in stamps.items()):
        restamp(sums, {**recorded, **stamps})  # copied or touched, the same bytes
    return None


def read_index(folder: Path) -> dict[str, dict]:
    try:
        index = read_json(folder, INDEX)
    except (OSError, ValueError) as exc:
        raise StorageError(
            f"offload index {folder / INDEX} is unreadable ({exc}); delete the folder and run again"
        ) from None
    for name in index:
        safe_file_name(folder, name)
    return index


def tagged_files(folder: Path) -> list[str]:
    """The file names the tag lists (none when it is missing or unreadable)."""
    try:
        files = read_json(folder, TAG).get("files", [])
    except (OSError, ValueError, AttributeError, StorageError):
        return []
    return [name for name in files if isinstance(name, str)]


def write_tag(folder: Path, files: list[str]) -> None:
    with atomic_write(folder / TAG, sync=False) as tmp:
        tmp.write_text(json.dumps({"files": files}))


def remove_our_files(folder: Path) -> None:
    """The tagged files of the shapes we write, the index, the marker and our temporary files (the tag stays)."""
    for name in tagged_files(folder) + [INDEX, COMPLETE]:
        path = folder / name
        # Only names of the shapes we write, directly inside the folder (no path: its parent would be another
        # folder; no backslash: another system's path): a tampered tag removes nothing else.
        ours = name in (INDEX, COMPLETE) or (name.endswith(".dat") and "\\" not in name)
        if ours and path.parent == folder:
            path.unlink(missing_ok=True)  # a symlink is removed, never what it points to
    for path in folder.glob("*.tmp"):
        if path.name.endswith(".dat.tmp") or path.name in (INDEX + ".tmp", TAG + ".tmp", COMPLETE + ".tmp"):
            path.unlink(missing_ok=True)


def remove_record(folder: Path) -> None:
    """Best effort, never raising: our files as :func:`remove_our_files` removes them, then the tag."""
    try:
        remove_our_files(folder)
        (folder / TAG).unlink()
    except OSError:
        pass
