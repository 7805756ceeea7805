"""Which GGUF model of a Hub repo a run takes. GGUF repos hold one model in many quantizations (``…-Q4_K_M.gguf``,
``…-Q8_0.gguf``, a large one split into parts, often in a folder per quantization): a repo id names one by a tag
after a colon, as llama.cpp's ``-hf`` and Ollama's ``hf.co/`` take it (``org/name-GGUF:Q8_0``); without a tag the
repo's only GGUF model is taken, else its ``Q4_K_M`` (llama.cpp's choice), else the run asks which."""

from __future__ import annotations

import re
import sys
from pathlib import PurePosixPath

from offload_core.errors import ConfigError
from offload_core.storage.gguf.split import PART, split_paths

__all__ = ["DEFAULT_TAG", "pick_gguf", "split_tag"]

#: the quantization taken where a repo holds several GGUF models and the repo id names none (as llama.cpp does)
DEFAULT_TAG = "Q4_K_M"
#: ``org/name:TAG``
_TAGGED = re.compile(r"^(?P<repo>[^:]+):(?P<tag>[A-Za-z0-9_.-]+)$")
#: a quantization's name in a file name (``Q4_K_M``, ``IQ4_XS``, ``Q8_0``, ``F16``, ``BF16``, ``UD-Q2_K_XL``, ...)
_QUANT = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d[A-Z0-9_]*|BF16|F16|F32))(?![A-Za-z0-9])", re.IGNORECASE)


def split_tag(name: str) -> tuple[str, str | None]:
    """``(repo id, tag)`` of ``org/name:TAG``; ``(name, None)`` for a name without one."""
    tagged = _TAGGED.match(name)
    return (tagged["repo"], tagged["tag"]) if tagged else (name, None)


def hf_download(repo: str, tag: str | None = None, revision: str | None = None) -> str:
    """The command that downloads ``repo`` (at ``revision``; of a GGUF repo only the quantization ``tag`` names, not
    its every one)."""
    return (
        f"hf download {repo}"
        + (f" --revision {revision}" if revision else "")
        + (f' --include "*{tag}*"' if tag else "")
    )


def is_projector(name: str) -> bool:
    """Whether GGUF file ``name`` is a vision projector (``mmproj…``, beside a model in its repo or folder): no model
    to run."""
    return name.lower().startswith("mmproj")


def _models(files: list[str]) -> dict[str, list[str]]:
    """The GGUF models among a repo's ``files``: each by its file (a split model's first part) with all its files;
    a vision projector (``mmproj…``) is no model."""
    models: dict[str, list[str]] = {}
    for file in sorted(files):
        path = PurePosixPath(file)
        if path.suffix.lower() != ".gguf" or is_projector(path.name):
            continue
        parts = split_paths(path)
        models.setdefault(str(parts[0]) if parts else file, []).append(file)
    return models


def _quant(model: str) -> str:
    """The quantization ``model``'s file name says (its last), else its name."""
    name = PurePosixPath(model).name
    found = _QUANT.findall(PART.sub(r"\g<stem>", name))
    return found[-1].upper() if found else name


def _tagged(models: dict[str, list[str]], tag: str) -> list[str]:
    """The models ``tag`` names: those whose quantization it is, where any is (``Q4_K_M`` is not ``UD-Q4_K_M``),
    else those whose name holds it whole (``Q4_K`` is not ``Q4_K_M``)."""
    exact = [model for model in models if _quant(model) == tag.upper()]
    if exact:
        return exact
    mark = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    return [model for model in models if mark.search(model)]


def pick_gguf(
    repo: str, files: list[str], tag: str | None, what: str = "model.path", cached: bool = False
) -> list[str] | None:
    """The files of the GGUF model of ``repo`` (whose files are ``files``) a run takes: the one ``tag`` names, else
    its only one, else its :data:`DEFAULT_TAG` one (said on stderr), where it holds no transformers weights; None for
    a repo without GGUF models (or, untagged, with transformers weights: those are read). A tag that names none or
    several, or several models and no ``Q4_K_M``, is one line listing what the repo holds (``cached``: ``files`` are
    those of its snapshot in the Hugging Face cache, which holds only what was downloaded)."""
    models = _models(files)
    held = ", ".join(sorted({_quant(model) for model in models})) or "no GGUF files"
    if tag is not None:
        found = _tagged(models, tag)
        if cached and not found:
            raise ConfigError(
                f"{what}={repo}:{tag}: the Hugging Face cache's copy of the repo holds no GGUF model tagged {tag} "
                f"(it holds: {held}); download it first: {hf_download(repo, tag)}"
            )
        if not models:
            raise ConfigError(f"{what}={repo}:{tag}: the repo holds no GGUF files; drop the tag: {what}={repo}")
        if not found:
            raise ConfigError(f"{what}={repo}:{tag}: the repo holds no GGUF model tagged {tag}; it holds: {held}")
        if len(found) > 1:
            raise ConfigError(
                f"{what}={repo}:{tag}: the repo holds {len(found)} GGUF models tagged {tag} ({', '.join(found[:4])}); "
                f"download the one to run (hf download {repo} {' '.join(models[found[0]])}) and give its path"
            )
        return models[found[0]]
    if not models or any(file.endswith((".safetensors", ".bin")) for file in files):
        return None
    if len(models) == 1:
        if cached:  # the one the cache holds, of how many the repo has: not told here
            print(
                f"offload_core: running {_quant(next(iter(models)))}, the GGUF model of {repo} in the Hugging Face "
                f"cache (the repo may hold others: name one, {what}={repo}:Q8_0)",
                file=sys.stderr,
            )
        return next(iter(models.values()))
    found = _tagged(models, DEFAULT_TAG)
    if len(found) == 1:
        print(
            f"offload_core: {repo} holds {len(models)} GGUF models ({held}); running {DEFAULT_TAG} "
            f"(name another: {what}={repo}:Q8_0)",
            file=sys.stderr,
        )
        return models[found[0]]
    raise ConfigError(
        f"{what}={repo} holds {len(models)} GGUF models ({held}); name one after a colon: {what}={repo}:"
        f"{_quant(next(iter(models)))}"
    )
