"""Content checksums of a model cache folder offload_core builds (the converted SmolLM2, the synthetic models):
xxh3-128 of every file, written with the folder (after its files, before its completion marker) and verified before
the folder is used. A file whose size and times are as they were when last verified is not read again (a write over
its bytes changes its times); any other is hashed and compared, so damaged bytes are never trusted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from offload_core.atomic import atomic_write
from offload_core.storage.folder_guard import checksum, matches, stamp

CHECKSUMS = ".checksums"


def _files(folder: Path, skip: set[str]) -> list[str]:
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name not in skip
    )


def write_checksums(folder: Path, skip: set[str]) -> None:
    """Hash every file of ``folder`` (but those named in ``skip``) into ``folder/.checksums``, atomically."""
    files = {}
    for name in _files(folder, skip | {CHECKSUMS}):
        path = folder / name
        recorded = stamp(path)
        files[name] = {"xxh3_128": checksum(path), "stamp": recorded}
    with atomic_write(folder / CHECKSUMS) as tmp:
        tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _read(folder: Path) -> dict[str, dict[str, Any]] | None:
    try:
        data = json.loads((folder / CHECKSUMS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if (
        not isinstance(files, dict)
        or not files
        or not all(
            isinstance(v, dict) and isinstance(v.get("xxh3_128"), str) and isinstance(v.get("stamp"), list)
            for v in files.values()
        )
    ):
        return None
    return files


def damage(folder: Path, skip: set[str]) -> str | None:
    """What is wrong with ``folder``'s content against its ``.checksums`` (None when every file matches). A folder
    built before checksums were written (none there) is hashed now and trusted from then on."""
    files = _read(folder)
    if files is None:
        if (folder / CHECKSUMS).exists():
            return f"its {CHECKSUMS} file cannot be read"
        write_checksums(folder, skip)
        return None
    present = set(_files(folder, skip | {CHECKSUMS}))
    missing = sorted(set(files) - present)
    if missing:
        return f"{missing[0]} is missing"
    restamped = False
    for name, entry in files.items():
        same, now = matches(folder / name, entry["xxh3_128"], entry["stamp"])
        if not same:
            return f"{name} does not match its checksum"
        if now != entry["stamp"]:
            entry["stamp"], restamped = now, True
    if restamped:  # copied or touched, content the same: remember, so the next run need not read it again
        try:
            with atomic_write(folder / CHECKSUMS) as tmp:
                tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        except OSError:
            pass  # a read-only cache: verified again next time
    return None
