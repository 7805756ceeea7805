"""What a plan predicts a module-hook policy moves per generated token: each offloaded unit's bytes read per forward
(a tensor read in part at its share), and where a store reads a GGUF file in place, the quantized bytes each read
moves and what the store does with each tensor type."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from offload_core.planning.sizing import kept_dtypes
from offload_core.registry.contracts import Policy, Storage
from offload_core.storage.checkpoint import Checkpoint
from offload_core.values import format_size, parse_dtype


def predicted_bytes_per_token(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    policy: Policy,
    execution_device: torch.device | str,
    dtype: torch.dtype | str | None,
    no_split_module_classes: list[str] | None = None,
    count: bool = False,
    stored: Mapping[str, int] | None = None,
) -> int:
    """Bytes the module-hook policy will bring in per generated token, predicted from the plan alone.

    A decoder runs one forward per generated token and calls each unit (a module, or a no-split block:
    the policy's ``granularity``) once per forward; a policy that brings each
    unit in per call (``align_per_call``, ``functional_call``, ``prefetch``) reads every offloaded tensor
    once per forward: the sum of the offloaded units' bytes. A tensor tied between two units (embeddings
    and head) is read by each, so it counts twice. A policy that keeps units longer says what it moves
    with ``predict_moved(unit_bytes: list[int]) -> int`` (``chained``: nothing when a single unit is
    offloaded). Offloaded means on ``disk`` for a CPU run, on ``cpu`` or ``disk`` for a GPU run.
    ``no_split_module_classes`` defaults to the model's own. Works on a meta model (nothing is read).
    The measured ``bytes_moved_per_token`` also averages the first forward over the prompt, which moves
    the same bytes. ``count``: the tensors brought in instead of their bytes (``transfers_per_token``), the
    policy's rule applied to each unit's tensor count. ``stored``: the bytes a read moves per store key where the
    store holds tensors in fewer bytes than the model computes on (a GGUF file's quantized blocks).
    """
    from offload_core.loading.routes import route_tensors
    from offload_core.module_hooks.units import find_units
    from offload_core.planning import no_split_classes, normalize_device_map

    device = torch.device(execution_device)
    dtype = parse_dtype(dtype)
    tensors = route_tensors(model, normalize_device_map(device_map), device)
    units = find_units(model, tensors.offloaded, no_split_classes(model, no_split_module_classes), policy.granularity)
    shares = policy.read_shares(model)
    kept = kept_dtypes(model)
    return int(policy.predict_moved([unit_reads(unit, dtype, shares, count, stored or {}, kept) for unit in units]))


def stored_bytes(checkpoint: Checkpoint | None, storage: Storage, dtype: torch.dtype | None = None) -> dict[str, int]:
    """The bytes a read of each tensor moves where the store reads a GGUF file's quantized blocks in place (its
    ``stored_nbytes``), or holds tensors packed (:meth:`Storage.predicted_stored`, in the run's ``dtype``); empty
    for the other stores, whose reads move the tensors' own bytes."""
    if checkpoint is None:
        return {}
    if not storage.reads_gguf or not checkpoint.is_gguf:
        return storage.predicted_stored(checkpoint, dtype)
    return {key: checkpoint.stored_nbytes(key) for key in checkpoint.keys()}


def stored_lines(
    checkpoint: Checkpoint,
    stored: Mapping[str, int],
    summary: dict,
    device_map: Mapping[str, int | str],
    model: nn.Module,
    execution_device: torch.device,
    held: bool = False,
) -> list[str]:
    """What the store does with each tensor of a GGUF file it reads in place, by GGML type: offloaded ones stay
    quantized in the file (``held``: are held quantized in memory) and are dequantized on every read; resident ones
    are dequantized once, at load."""
    if not stored:
        return []
    from offload_core.loading.routes import route_tensors
    from offload_core.planning import normalize_device_map

    offloaded = set(route_tensors(model, normalize_device_map(dict(device_map)), execution_device).offloaded.values())
    if not checkpoint.is_gguf:  # a store that packs tensors losslessly
        packed = [key for key in offloaded if key in stored]
        raw = sum(torch.Size(checkpoint.shape(key)).numel() * 2 for key in packed)  # the code holds bf16 only
        kept = sum(stored[key] for key in packed)
        return [
            f"packed: {len(packed)} offloaded tensors held losslessly in {format_size(kept)} of {format_size(raw)} "
            f"({kept / raw if raw else 1:.3f}), copied packed and decoded on the execution device"
        ]
    kinds: dict[tuple[bool, str], list[int]] = {}
    for key in checkpoint.keys():
        if checkpoint.computes_quantized(key):  # listed apart (gguf_qcompute.quantized_lines)
            continue
        row = kinds.setdefault((key in offloaded, checkpoint.tensor_type(key)), [0, 0, 0])
        row[0] += 1
        row[1] += stored[key]
        row[2] += checkpoint.nbytes(key)

    def listed(read_in_place: bool) -> str:
        rows = sorted((kind, row) for (place, kind), row in kinds.items() if place == read_in_place)
        return ", ".join(f"{kind} x{n} ({format_size(q)} -> {format_size(f)})" for kind, (n, q, f) in rows) or "none"

    offloaded_how = "held quantized in memory" if held else "read quantized in place"
    return [
        f"gguf, offloaded: {offloaded_how}, dequantized before each use: {listed(True)}",
        f"gguf, resident: dequantized once at load: {listed(False)}",
    ]


def unit_reads(
    unit: Any,
    dtype: torch.dtype | None,
    shares: Mapping[str, tuple[float, int]],
    count: bool,
    stored: Mapping[str, int],
    kept: frozenset[str] = frozenset(),
) -> float:
    """A unit's offloaded bytes read per forward (``count``: the reads), each store key once (two names tied inside
    one unit are read once), a tensor the policy reads in part (``shares``: by name) at its share; ``kept`` names
    the tensors read in their own dtype (a quantized layer's packed tensors)."""
    from offload_core.planning.sizing import tensor_bytes

    originals: dict[str, Any] = {}
    names: dict[str, str] = {}
    for slot in unit.slots:
        originals.setdefault(slot.key, slot.original)
        names.setdefault(slot.key, slot.full)
    total = 0.0
    for key, tensor in originals.items():
        share, reads = shares.get(names[key], (1.0, 1))
        width = None if names[key] in kept else dtype
        total += reads if count else share * stored.get(key, tensor_bytes(tensor, width))
    return total
