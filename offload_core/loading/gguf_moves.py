"""What a plan reading a GGUF file in place dequantizes per generated token, by GGML type: the quantized bytes read
and the float32 bytes written, by the policy's own rule for what it brings in (the time prediction prices them at
this machine's dequantization rates)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.registry.contracts import Policy
from offload_core.storage.checkpoint import Checkpoint
from offload_core.storage.gguf.device import device_form, experts_form, pass_elements
from offload_core.values import parse_dtype


def dequant_rows(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    policy: Policy,
    execution_device: torch.device,
    dtype: torch.dtype | None,
    no_split: list[str],
    checkpoint: Checkpoint,
    stored: Mapping[str, int],
) -> list[dict[str, Any]]:
    """Per GGML type of the offloaded tensors (and whether they take transformers' processor's extra pass,
    ``converted``: llama's q and k, or every tensor of a run in another dtype than float32; ``device``: dequantized on
    the device of a GPU run, a type with a torch kernel, read whole or a routed expert's rows at a time):
    ``tensors`` offloaded, ``read_bytes`` (quantized) and ``dequant_bytes`` (float32) per generated token. Empty
    unless ``checkpoint`` is a GGUF file the store reads in place (``stored``: its quantized bytes per key)."""
    from offload_core.loading.moves import unit_reads
    from offload_core.loading.routes import route_tensors
    from offload_core.module_hooks.units import find_units
    from offload_core.planning import no_split_classes, normalize_device_map

    if not stored or not checkpoint.is_gguf:
        return []
    dtype = parse_dtype(dtype)
    tensors = route_tensors(model, normalize_device_map(dict(device_map)), execution_device)
    offloaded = {key for key in tensors.offloaded.values() if not checkpoint.computes_quantized(key)}
    if not offloaded:
        return []
    units = find_units(model, tensors.offloaded, no_split_classes(model, no_split), policy.granularity)
    shares = policy.read_shares(model)
    in_float32 = dtype in (None, torch.float32)
    elements = pass_elements(max((math.prod(checkpoint.shape(key)) for key in offloaded), default=0))
    groups: dict[tuple[str, bool, bool], set[str]] = {}
    routed = {tensors.offloaded[name] for name in shares if name in tensors.offloaded}  # read by expert
    for key in offloaded:
        converted = not (in_float32 and checkpoint.fills(key))
        run_dtype = dtype or torch.float32  # read whole as it lies, else an expert at a time (a merged one too)
        whole = key not in routed and device_form(checkpoint, key, run_dtype, elements) is not None
        device = whole or experts_form(checkpoint, key, run_dtype, elements) is not None
        groups.setdefault((checkpoint.tensor_type(key), converted, device), set()).add(key)

    def per_token(sizes: dict[str, int]) -> int:
        return int(policy.predict_moved([unit_reads(unit, dtype, shares, False, sizes) for unit in units]))

    rows = []
    for (kind, converted, device), keys in sorted(groups.items()):
        none = dict.fromkeys(stored, 0)
        rows.append(
            {
                "type": kind,
                "converted": converted,
                "device": device,  # a GPU run with a policy that decodes on the device dequantizes it there
                "tensors": len(keys),
                "read_bytes": per_token({**none, **{k: stored[k] for k in keys}}),
                "dequant_bytes": per_token({**none, **{k: checkpoint.nbytes(k) for k in keys}}),
            }
        )
    return rows
