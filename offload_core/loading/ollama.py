"""A model Ollama has pulled, named as Ollama names it: ``ollama:qwen3:30b-a3b`` (``ollama:<name>[:<tag>]``, the tag
``latest`` where none is given; ``ollama:user/name:tag`` for a user's model). Ollama keeps each model's manifest
under ``$OLLAMA_MODELS/manifests/<registry>/<namespace>/<name>/<tag>`` (default ``~/.ollama/models``) and its weights
as one GGUF blob, ``blobs/sha256-<digest>``: the run reads that blob (it is never written)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from offload_core.errors import ConfigError

__all__ = ["PREFIX", "resolve_ollama"]

#: how a model path names an Ollama model
PREFIX = "ollama:"
#: the manifest layer that holds the weights
MODEL_LAYER = "application/vnd.ollama.image.model"
#: an Ollama tag (an OCI reference's)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
#: where Ollama pulls from unless the name says otherwise
REGISTRY = "registry.ollama.ai"


def models_folder() -> Path:
    """Where Ollama keeps its models: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def _manifest(name: str, what: str) -> Path:
    """The manifest file of Ollama model ``name`` (``[registry/][namespace/]model[:tag]``)."""
    model, _, tag = name.partition(":")
    parts = [p for p in model.split("/") if p]
    if not parts or (":" in name and not _TAG.fullmatch(tag)) or any(p in (".", "..") for p in parts):
        raise ConfigError(f"{what}={PREFIX}{name!r} is no Ollama model name; give one as `ollama list` shows it")
    if len(parts) == 1:
        parts = [REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [REGISTRY, *parts]
    return _any_case(models_folder() / "manifests", [*parts, tag or "latest"])


def _any_case(folder: Path, names: list[str]) -> Path:
    """``folder/names...``, each name matched in any case where only one entry of its folder matches it (Ollama's
    names are case-insensitive: ``qwen3:8B`` is ``qwen3:8b``); as given where none does."""
    path = folder
    for name in names:
        if not (path / name).exists() and path.is_dir():
            found = [entry for entry in path.iterdir() if entry.name.lower() == name.lower()]
            name = found[0].name if len(found) == 1 else name
        path = path / name
    return path


def resolve_ollama(name: str, what: str = "model.path") -> Path:
    """The GGUF blob of the Ollama model ``name`` (what follows :data:`PREFIX`); one line where Ollama has not pulled
    it, or its manifest or blob is missing or damaged."""
    manifest = _manifest(name, what)
    if not manifest.is_file():
        raise ConfigError(
            f"{what}={PREFIX}{name}: Ollama has no such model in {models_folder()} (no {manifest.name!r} manifest at "
            f"{manifest.parent}); pull it first (`ollama pull {name}`), or set OLLAMA_MODELS to where Ollama keeps "
            "its models"
        )
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER)
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(digest)):
            raise ValueError(digest)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise ConfigError(
            f"{what}={PREFIX}{name}: its Ollama manifest {manifest} is damaged or names no model weights; pull the "
            f"model again (`ollama pull {name}`)"
        ) from None
    blob = models_folder() / "blobs" / str(digest).replace(":", "-")
    if not blob.is_file():
        raise ConfigError(
            f"{what}={PREFIX}{name}: its weights ({blob.name}) are missing from {blob.parent}; pull the model again "
            f"(`ollama pull {name}`)"
        )
    try:
        with open(blob, "rb") as handle:
            head = handle.read(4)
    except OSError as error:
        raise ConfigError(f"{what}={PREFIX}{name}: its weights blob {blob} cannot be read ({error.strerror})") from None
    if head != b"GGUF":
        raise ConfigError(
            f"{what}={PREFIX}{name}: its weights blob {blob} is not a GGUF file (it opens with {head!r}); pull the "
            f"model again (`ollama pull {name}`)"
        )
    return blob
