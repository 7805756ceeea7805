"""A model named by a Hugging Face Hub repo id (``org/name``): its snapshot folder in the local Hub cache, downloaded
first, as transformers would, where the cache lacks it and the machine may go online."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from offload_core.errors import ConfigError
from offload_core.loading.hub_gguf import hf_download, pick_gguf, split_tag
from offload_core.loading.ollama import PREFIX, resolve_ollama
from offload_core.loading.sources import ModelSourceError
from offload_core.values import read_fields

__all__ = ["Hub", "resolve_model_path", "looks_like_repo_id", "probe_folder"]

#: what a run reads besides the weights: configs, indexes, tokenizer and chat-template files (never code, never
#: another framework's weights)
READ = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
#: a diffusers variant of a weight file (``diffusion_pytorch_model.fp16.safetensors``): left out where the plain one is
_VARIANT = re.compile(r"\.(fp16|fp32|bf16|ema|non_ema)(?=\.(safetensors|bin)$)")
#: a Hub address before a repo id (``hf.co/org/name:TAG``, as Ollama takes it; ``https://huggingface.co/org/name``)
_HUB_URL = re.compile(r"^(?:https?://)?(?:www\.)?(?:hf\.co|huggingface\.co)/(?:models/)?")
#: file endings of a path that names a file, never a repo
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".gguf")


@dataclass(frozen=True)
class Hub:
    """Where a Hub repo id is read from, as transformers' ``from_pretrained`` takes it: ``revision`` (a branch, tag or
    commit; default ``main``), ``token`` (default ``HF_TOKEN`` or the saved login) for private or gated repos,
    ``local_files_only`` (never download) and ``cache_dir`` (default ``HF_HUB_CACHE`` / ``HF_HOME``'s)."""

    revision: str | None = None
    token: str | bool | None = None
    local_files_only: bool = False
    cache_dir: str | os.PathLike[str] | None = None


def read_hub(value: Hub | Mapping[str, Any] | None) -> Hub:
    """``value`` as a :class:`Hub`: itself, the defaults for None, or a dict of its fields."""
    return read_fields(Hub, value, "hub", "{'revision': 'v1.0', 'local_files_only': True}")


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` can be a Hub repo id (``org/name`` or ``name``), not a path (``/a``, ``./a``, ``~/a``,
    ``a/b/c``, ``model.safetensors``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not name or name.startswith((".", "~")) or name.endswith(_FILE_SUFFIXES):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def probe_folder(checkpoint: str | os.PathLike[str]) -> Path:
    """Where a run may write its short-lived probes on the checkpoint's file system: the folder holding the checkpoint
    folder (or file), but for a snapshot of the Hub cache (``.../models--org--name/snapshots/<commit>``) the folder
    holding that cache, so that nothing is ever written inside the cache."""
    path = Path(checkpoint).absolute()
    parts = path.parts
    for at in range(len(parts) - 2, 1, -1):
        if parts[at] == "snapshots" and parts[at - 1].startswith(("models--", "datasets--", "spaces--")):
            return Path(*parts[: at - 2])
    return path.parent


def resolve_model_path(
    path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    what: str = "model.path",
) -> Path:
    """The local folder (or file) ``path`` names: ``path`` itself where it exists (a local path wins over a repo id,
    as in transformers), else the snapshot folder of the Hub repo ``path`` at ``revision`` (default ``main``).

    A repo in the Hub cache (``HF_HUB_CACHE``, ``HF_HOME``, or ``cache_dir``) is used as it is when
    ``HF_HUB_OFFLINE=1`` or ``local_files_only``; otherwise the Hub is asked and what is missing is downloaded
    (configs, tokenizer and the weights in one format: safetensors where the repo has them, else ``.bin``) with
    huggingface_hub's progress bars (``progress``), the token ``token`` or ``HF_TOKEN`` / the saved login. ``what``
    names the argument in error lines. Of a GGUF repo the answer is the file of the GGUF model the run takes
    (``org/name:TAG``: :mod:`offload_core.loading.hub_gguf`), and only that model's files are downloaded. A model
    Ollama has pulled, ``ollama:name:tag``, is its GGUF blob (:mod:`offload_core.loading.ollama`).
    """
    if path is None or not str(path).strip():  # Path("") is the working folder
        raise ConfigError(
            f"{what} is empty: give a checkpoint folder, a GGUF file, a Hub repo id (org/name) or ollama:<name>"
        )
    local = Path(path).expanduser()
    if local.exists():
        return local
    if str(path).startswith(PREFIX):
        return resolve_ollama(str(path)[len(PREFIX) :], what)
    name, tag = split_tag(str(path))
    bare = _HUB_URL.sub("", str(path)).rstrip("/")
    if bare != str(path) and looks_like_repo_id(split_tag(bare)[0]):
        raise ConfigError(f"{what}={str(path)!r} names a Hub repo by its address: give its id alone, {what}={bare}")
    if not looks_like_repo_id(name):
        raise ConfigError(
            f"{what}={str(path)!r} does not exist: give a local Hugging Face checkpoint folder or a Hub repo id "
            "(org/name)"
        )
    from huggingface_hub import constants

    cache = Path(cache_dir).expanduser() if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    at = f" at revision {revision!r}" if revision else ""
    if local_files_only or constants.HF_HUB_OFFLINE:
        found = cached_snapshot(name, revision, cache)
        if found is not None:
            return _chosen(found, name, tag, what)
        why, undo = (
            ("local_files_only=True", "pass local_files_only=False")
            if local_files_only
            else ("HF_HUB_OFFLINE=1", "unset HF_HUB_OFFLINE")
        )
        raise ModelSourceError(
            f"{what}={name!r} is neither a local folder nor a model in the Hugging Face cache ({cache}){at}, and "
            f"{why} forbids downloading it; set {what} to a checkpoint folder, {undo} to download it, or download it "
            f"first: {hf_download(name, tag, revision)}"
        )
    return _download(name, tag, revision, token, cache if cache_dir is not None else None, progress, what, at)


def _chosen(folder: Path, repo: str, tag: str | None, what: str) -> Path:
    """The snapshot ``folder`` of ``repo``, or the GGUF model in it the run takes (:func:`pick_gguf`)."""
    files = [str(path.relative_to(folder).as_posix()) for path in folder.rglob("*") if not path.is_dir()]
    picked = pick_gguf(repo, files, tag, what, cached=True)
    missing = [name for name in picked or [] if not (folder / name).exists()]
    if missing:  # a link to a blob an interrupted download or a cache clean-up left out
        raise ModelSourceError(
            f"{what}={repo}{f':{tag}' if tag else ''}: the Hugging Face cache holds {missing[0]} only as a link to a "
            f"missing file (a download cut short, or the cache cleaned); download it again: hf download {repo} "
            + " ".join(picked or [])
        )
    return folder / picked[0] if picked else folder


def cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` (a branch or tag through ``refs/``, or a commit) in the Hub
    cache ``cache``, or None where the cache does not hold it."""
    from huggingface_hub import snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError

    for name in ("config.json", "model_index.json"):
        found = try_to_load_from_cache(repo_id, name, cache_dir=cache, revision=revision)
        if isinstance(found, str):
            return Path(found).parent
    try:  # a repo without a config (a GGUF file alone): its snapshot folder, where the cache holds it whole
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def wanted_files(files: list[str]) -> tuple[list[str], list[str]]:
    """``(allow_patterns, ignore_patterns)`` of the files a run of a repo holding ``files`` reads: configs and
    tokenizer files, and the weights as transformers picks them (safetensors where there are any, else ``.bin``),
    a diffusers variant (``*.fp16.safetensors``) only where its plain file is missing."""
    weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
    present = set(files)
    ignore = [f for f in files if _VARIANT.search(f) and _VARIANT.sub("", f) in present]
    return READ + weights, ignore


def _download(
    repo_id: str,
    tag: str | None,
    revision: str | None,
    token: str | bool | None,
    cache: Path | None,
    progress: bool,
    what: str,
    at: str,
) -> Path:
    """The snapshot folder of ``repo_id`` once what a run reads of it is downloaded (or, where the Hub cannot be
    reached, the cached one); of a GGUF repo, the GGUF model the run takes (``tag``: see :func:`pick_gguf`), only its
    files downloaded."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi(token=token).model_info(repo_id, revision=revision)
        files = [sibling.rfilename for sibling in info.siblings or []]
        picked = pick_gguf(repo_id, files, tag, what)
        allow, ignore = (READ + picked, []) if picked else wanted_files(files)
        with _progress_bars(progress):
            folder = snapshot_download(
                repo_id,
                revision=info.sha or revision,
                cache_dir=cache,
                token=token,
                allow_patterns=allow,
                ignore_patterns=ignore or None,
            )
        return Path(folder) / picked[0] if picked else Path(folder)
    except ConfigError:
        raise
    except RevisionNotFoundError:
        raise ModelSourceError(
            f"{what}={repo_id!r}: the Hub repo has no revision {revision!r}; give a branch, tag or commit it has"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as error:
        kind = "is gated" if isinstance(error, GatedRepoError) else "was not found"
        raise ModelSourceError(
            f"{what}={repo_id!r} is no local folder, and the Hub repo {repo_id} {kind} (or is private); check the "
            "name, or give a token with access (HF_TOKEN, or `hf auth login`)"
        ) from None
    except Exception as error:  # noqa: BLE001 - no network, the Hub down, a full disk: use the cache if it has it
        from huggingface_hub import constants

        found = cached_snapshot(repo_id, revision, cache or Path(constants.HF_HUB_CACHE))
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        if found is not None:
            print(f"offload_core: the Hub could not be reached ({reason}); using the cached {repo_id}", file=sys.stderr)
            return _chosen(found, repo_id, tag, what)
        raise ModelSourceError(
            f"{what}={repo_id!r} is no local folder and could not be downloaded{at} ({reason}); check the network "
            f"(or set {what} to a checkpoint folder), then run again or download it first: {hf_download(repo_id, tag)}"
        ) from None


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """huggingface_hub's progress bars as the run asks (they also obey ``HF_HUB_DISABLE_PROGRESS_BARS``)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if shown or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
