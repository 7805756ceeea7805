"""Write tensors as Hugging Face sharded safetensors (``model-0000i-of-0000N.safetensors`` + index), atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from offload_core.atomic import atomic_write, fsync_path
from offload_core.errors import CheckpointError
from offload_core.loading.checkpoint import SAFE_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = ["plan_shards", "write_safetensors_shards", "write_sharded_safetensors"]


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split ``(name, nbytes)`` in order into shards of at most ``max_shard_size`` bytes (a larger tensor gets its
    own)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def write_safetensors_shards(
    directory: str | os.PathLike[str],
    shards: list[list[str]],
    produce: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    extra_index_metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``shards`` (lists of names) as HF-layout safetensors, asking ``produce(name)`` for one shard's tensors at a
    time.

    Files are written and fsynced in a temp dir next to ``directory``, then moved into place (see
    :func:`offload_core.atomic.atomic_write`): the whole dir is renamed when ``directory`` does not
    exist yet, otherwise file by file with the index last.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    if directory.exists():
        if not directory.is_dir():
            raise CheckpointError(
                f"{directory} exists and is not a directory; choose a directory to write the checkpoint into"
            )
        clash = [p.name for p in directory.iterdir() if p.suffix == ".safetensors" or p.name == SAFE_INDEX_NAME]
        if clash:
            raise CheckpointError(
                f"{directory} already holds weights ({clash[0]}); write into an empty or new directory"
            )
    directory.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    count = len(shards)
    names = (
        [SAFE_WEIGHTS_NAME]
        if count == 1
        else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    )
    with atomic_write(directory, folder=True, merge=True, last=(SAFE_INDEX_NAME,)) as tmp:
        weight_map: dict[str, str] = {}
        total = 0
        for file_name, keys in zip(names, shards):
            tensors = {}
            for key in keys:
                tensor = produce(key).detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                tensors[key] = tensor.contiguous()
                total += tensor.numel() * tensor.element_size()
                weight_map[key] = file_name
            save_file(tensors, str(tmp / file_name), metadata=meta)
            del tensors
            fsync_path(tmp / file_name)
        if count > 1:
            index = {"metadata": {"total_size": total, **(extra_index_metadata or {})}, "weight_map": weight_map}
            (tmp / SAFE_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            fsync_path(tmp / SAFE_INDEX_NAME)
    return directory


def write_sharded_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    max_shard_size: int,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``state_dict`` to ``directory`` as ``model-0000i-of-0000N.safetensors`` + index (or one
    ``model.safetensors``).

    Tensors that share storage as the same view (tied weights) are written once, under their first
    name; the others are left out of the files (the index's metadata lists them under ``"tied"``, and
    a single file's safetensors metadata under ``"offload_core.tied"``) and the loader reties them
    from the model's tied parameters. Writing is atomic (see :func:`write_safetensors_shards`).
    """
    if max_shard_size <= 0:
        raise CheckpointError(f"max_shard_size={max_shard_size} must be positive; give a size in bytes")
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"state_dict entry {name!r} is a {type(tensor).__name__}, not a tensor; pass tensors only"
            )
        if tensor.device.type == "meta":
            raise CheckpointError(
                f"state_dict entry {name!r} is on the meta device and has no data; load its weights first"
            )
        if tensor.numel():
            ident = (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.dtype,
            )
            first = seen.get(ident)
            if first is not None:
                tied[name] = first
                continue
            seen[ident] = name
        kept[name] = tensor
    # Distinct views of one storage cannot go through safetensors as they are: give each its own copy.
    storages: dict[tuple, str] = {}
    for name, tensor in list(kept.items()):
        if tensor.numel():
            key = (tensor.device, tensor.untyped_storage().data_ptr())
            if key in storages:
                kept[name] = tensor.clone()
            else:
                storages[key] = name
    shards = plan_shards(((n, t.numel() * t.element_size()) for n, t in kept.items()), max_shard_size)
    meta = dict(metadata or {})
    extra: dict[str, Any] = {}
    if tied:
        if len(shards) == 1:
            meta["offload_core.tied"] = json.dumps(tied, sort_keys=True)
        else:
            extra["tied"] = tied
    return write_safetensors_shards(directory, shards, kept.__getitem__, meta, extra)
