"""What the ``experts`` policy plans with: the offloaded experts of a device map, the bytes kept resident, and what
computing on a store's views gains on a CPU run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offload_core.module_hooks.experts.lists import listed_expert_units
from offload_core.module_hooks.experts.loader import expert_slots, is_fused_experts
from offload_core.planning.reservation import InFlight
from offload_core.values import format_size


def resident_bytes(model: nn.Module, offloaded: Any, dtype: torch.dtype | None) -> int:
    """Bytes of ``model``'s parameters and persistent buffers that are not ``offloaded`` (each tensor once)."""
    from offload_core.planning.sizing import tensor_bytes

    seen: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in offloaded:
            seen.setdefault(id(tensor), tensor)
    return sum(tensor_bytes(tensor, dtype) for tensor in seen.values())


@dataclass(frozen=True)
class OffloadedExperts:
    """The experts a device map offloads: of fused experts modules (``fused``: the bytes of one expert of the largest,
    and how many modules), of lists of expert modules (``listed``: the same), the most experts one module holds and
    the names of their offloaded tensors (which prefetch's blocks leave to them)."""

    fused: tuple[int, int]
    listed: tuple[int, int]
    experts: int
    names: frozenset[str]
    #: the fused modules' whole-tensor buffers on an accelerator, one per shape and dtype (:class:`Buffers`)
    buffers: int = 0


def offloaded_experts(model: nn.Module, offloaded: Any, dtype: torch.dtype | None) -> OffloadedExperts:
    """:class:`OffloadedExperts` of ``model`` with the ``offloaded`` tensors (name -> store key), as
    :meth:`Experts.attach` finds them: a fused module's offloaded expert-indexed parameters, a listed expert's
    offloaded subtree."""
    from offload_core.planning.sizing import tensor_bytes

    names: set[str] = set()
    shapes: dict[tuple, torch.Tensor] = {}
    fused_row, fused_layers, experts = 0, 0, 0
    for name, module in model.named_modules():
        if is_fused_experts(module) and (slots := expert_slots(name, module, offloaded)):
            fused_layers += 1
            experts = max(experts, module.num_experts)
            fused_row = max(fused_row, sum(tensor_bytes(slot.original[0], dtype) for slot in slots))
            names.update(slot.full for slot in slots)
            shapes.update({(tuple(slot.original.shape), slot.original.dtype): slot.original for slot in slots})
    listed_row, listed_layers = 0, 0
    for units, _ in listed_expert_units(model, offloaded):
        listed_layers += 1
        for unit in units:
            listed_row = max(
                listed_row, sum(tensor_bytes(t, dtype) for t in {s.key: s.original for s in unit.slots}.values())
            )
            names.update(slot.full for slot in unit.slots)
    buffers = sum(tensor_bytes(tensor, dtype) for tensor in shapes.values())
    return OffloadedExperts((fused_row, fused_layers), (listed_row, listed_layers), experts, frozenset(names), buffers)


def page_cache_note(need: InFlight, experts: int, top_k: int) -> str:
    """What experts gains on this CPU run: with the whole model in the page cache, once warm every policy computes on
    the same cached pages and experts gains little (measured side by side: bench/results/compare-moe-mixtral-2.6g.md);
    otherwise, and cold, it reads top_k of every layer's experts where a block policy reads them all."""
    import psutil

    model = sum(
        p.numel() * (need.dtype.itemsize if need.dtype is not None and p.is_floating_point() else p.element_size())
        for p in need.model.parameters()
    )
    available = psutil.virtual_memory().available
    if model <= available:
        return (
            f"the whole model ({format_size(model)}) fits in the page cache ({format_size(available)} available): "
            f"once warm every policy computes on the same cached pages (chained and functional_call as fast as "
            f"experts, prefetch slower, measured); experts reads less while pages are not cached ({top_k} of "
            f"{experts} experts per layer)"
        )
    return (
        f"the model ({format_size(model)}) is larger than the memory available ({format_size(available)}): experts "
        f"reads {top_k} of {experts} experts per layer where a block policy would read them all"
    )


def placed_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes of ``model``'s parameters and buffers on ``device`` now (a tied one once): the weights placed there."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.device == device}
    return sum(t.numel() * t.element_size() for t in seen.values())


def every_expert(model: nn.Module, dtype: torch.dtype | None) -> OffloadedExperts:
    """:class:`OffloadedExperts` of ``model`` were every tensor offloaded: all its experts."""
    return offloaded_experts(model, {name: name for name in model.state_dict(keep_vars=True)}, dtype)
