"""Stream a checkpoint into a model's resident tensors and a store's offloaded ones: ``load_checkpoint_in_model``."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from offload_core.alignment import empty_at, maps_checkpoint
from offload_core.errors import CheckpointError
from offload_core.planning.sizing import kept_dtypes
from offload_core.storage import Store
from offload_core.storage.base import read_tensor
from offload_core.loading.routes import TensorRoutes, retie, set_tensor
from offload_core.storage.checkpoint import Checkpoint

log = logging.getLogger(__name__)


def computed_by_model(model: nn.Module, keys: set[str]) -> set[str]:
    """The checkpoint ``keys`` that the model makes itself, which transformers ignores without a word: its
    non-persistent buffers (``position_ids``, ``inv_freq``: older checkpoints saved them), and the names its class
    says to ignore (``_keys_to_ignore_on_load_unexpected``, and transformers' own ``position_ids`` and
    ``rotary_emb.inv_freq`` rule for a model that has such buffers)."""
    buffers = {name for name, _ in model.named_buffers()}
    made = buffers - set(model.state_dict().keys())
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    for suffix, pattern in (("position_ids", r"(^|\.)position_ids$"), ("rotary_emb.inv_freq", r"rotary_emb\.inv_freq")):
        if any(name.endswith(suffix) for name in buffers):
            patterns.append(pattern)
    ignored = re.compile("|".join(f"({pattern})" for pattern in patterns)) if patterns else None
    return {key for key in keys if key in made or (ignored is not None and ignored.search(key))}


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: Checkpoint,
    routes: TensorRoutes,
    store: Store | None,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    strict: bool = False,
) -> dict[str, list[str]]:
    """Stream ``checkpoint`` shard by shard into ``model`` (resident tensors) and ``store`` (offloaded ones).

    Resident tensors are copied once from the mapped shard to their device; offloaded ones go to the
    store (which may only record where they are). Peak anonymous memory is the resident bytes: shards
    are mapped, never read whole into memory. Returns ``{"missing": [...], "unexpected": [...]}``;
    missing weights or shape mismatches raise :class:`CheckpointError`, and so do unused ones with ``strict``.
    """
    ckpt_keys = set(checkpoint.keys())
    # Which checkpoint key feeds each canonical name (a tied group may be saved under any of its names).
    source: dict[str, str] = {}
    for name, canonical in routes.canonical.items():
        if name in ckpt_keys:
            source.setdefault(canonical, name)
    missing = sorted({c for c in routes.canonical.values() if c not in source})
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"checkpoint {checkpoint.path} lacks {len(missing)} weight(s) the model needs: {shown}; "
            "check that the checkpoint matches the model's config"
        )
    wanted = {key: canonical for canonical, key in source.items()}
    unexpected = sorted(ckpt_keys - set(routes.canonical) - computed_by_model(model, ckpt_keys))
    if unexpected and strict:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) the model does not use ({', '.join(unexpected[:5])}): "
            "load it with strict=False to ignore them, or use the checkpoint that matches the model"
        )
    if unexpected:
        log.warning(
            "checkpoint has %d tensor(s) the model does not use (ignored): %s",
            len(unexpected),
            ", ".join(unexpected[:5]),
        )
    state = model.state_dict(keep_vars=True)
    expected = {name: tuple(t.shape) for name, t in state.items()}
    kinds = {name: _dtype_kind(t.dtype) for name, t in state.items()}
    store_keys = set(routes.offloaded.values())
    kept = kept_dtypes(model)  # a quantized layer's packed tensors: read as saved
    in_place = maps_checkpoint(model)
    total = sum(len(keys) for _, keys in checkpoint.shards())
    bar = tqdm(total=total, desc="loading", unit="tensor", disable=not progress, leave=False)
    for shard, keys in checkpoint.shards():
        for key in keys:
            bar.update(1)
            canonical = wanted.get(key)
            if canonical is None:
                continue
            shape = tuple(checkpoint.shape(key))
            if shape != expected[canonical]:
                raise CheckpointError(
                    f"checkpoint tensor {key!r} in {Path(shard).name} has shape {list(shape)} but the model expects "
                    f"{list(expected[canonical])}; the checkpoint does not match the model's config"
                )
            stored = checkpoint.dtype(key)
            if _dtype_kind(stored) != kinds[canonical]:
                raise CheckpointError(
                    f"checkpoint tensor {key!r} in {Path(shard).name} is {str(stored).removeprefix('torch.')} but the "
                    f"model expects a {kinds[canonical]} tensor "
                    f"({str(state[canonical].dtype).removeprefix('torch.')}); the checkpoint does not match the "
                    "model's config"
                )
            read_as = None if canonical in kept else dtype
            if canonical in store_keys:
                if store is not None and not store.reused:
                    store.add_from_checkpoint(canonical, checkpoint, key, read_as)
                continue
            held = read_tensor(checkpoint, key, read_as, in_place, _allocator(routes.resident[canonical]))
            set_tensor(model, canonical, held, routes.is_param[canonical])
    bar.close()
    if store is not None:
        store.finalize()
    retie(model, routes)
    return {"missing": missing, "unexpected": unexpected}


def _allocator(device: torch.device) -> Any:
    """Memory for a resident tensor on ``device``: on the CPU where the in-memory load has it (at its reference
    offset: this machine's kernels may depend on it)."""
    if device.type == "cpu":
        return empty_at
    return lambda shape, dtype, offset: torch.empty(shape, dtype=dtype, device=device)


def _dtype_kind(dtype: torch.dtype) -> str:
    """``floating``, ``complex``, ``bool`` or ``integer``: floats convert to the run's dtype, other kinds never do."""
    if dtype.is_floating_point:
        return "floating-point"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"
