"""MoE designs with a list of expert modules (``experts = nn.ModuleList([...])``, each called only for the tokens
routed to it): every expert is a unit of its own, read when it is called and kept in its layer's cache."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import nn

from offload_core.module_hooks.base import ModuleHook
from offload_core.module_hooks.experts.cache import ExpertCache
from offload_core.module_hooks.experts.loader import ExpertCounters
from offload_core.module_hooks.units import Unit, subtree_slots


def expert_lists(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Each container of experts: a ``ModuleList`` or ``ModuleDict`` whose name says ``expert`` and whose
    two or more members are modules of one class with parameters of the same shapes."""
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or "expert" not in name.rpartition(".")[2].lower():
            continue
        members = list(module.children())
        if len(members) < 2 or len({type(m) for m in members}) != 1:
            continue
        shapes = {tuple((n, tuple(p.shape)) for n, p in m.named_parameters()) for m in members}
        if len(shapes) == 1 and next(iter(shapes)):
            yield name, module


def listed_expert_sizes(model: nn.Module, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """The bytes of one expert in the largest list of experts, and how many such lists the model has."""
    largest, layers = 0, 0
    for _, container in expert_lists(model):
        layers += 1
        first = next(iter(container.children()))
        largest = max(
            largest,
            sum(
                p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
                for p in first.parameters()
            ),
        )
    return largest, layers


def listed_expert_units(model: nn.Module, offloaded: Mapping[str, str]) -> list[tuple[list[Unit], list[int]]]:
    """Per list of experts: one unit per member with offloaded tensors (its whole subtree), and their positions."""
    layers = []
    for name, container in expert_lists(model):
        units, positions = [], []
        for position, (child_name, child) in enumerate(container.named_children()):
            prefix = f"{name}.{child_name}"
            slots = subtree_slots(prefix, child, offloaded)
            if slots:
                units.append(Unit(prefix, child, slots))
                positions.append(position)
        if units:
            layers.append((units, positions))
    return layers


class ListedExpertHook(ModuleHook):
    """On one expert of a list: its tensors come in for its call (none while it is cached) and go after it,
    unless the layer's cache keeps them (the expert evicted for it goes then)."""

    name = "listed_expert_offload"

    def __init__(
        self,
        unit: Unit,
        position: int,
        cache: ExpertCache,
        store: Mapping[str, torch.Tensor],
        device: torch.device,
        counters: ExpertCounters,
    ) -> None:
        self.unit = unit
        self.position = position
        self.cache = cache
        self.store = store
        self.device = device
        self.counters = counters

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.cache.request([self.position])
        if self.cache.get(self.position) is not None:
            self.counters.hits += 1
            return args, kwargs
        fetched = self.unit.fetch(self.store, self.device)
        self.unit.load(self.store, self.device, None, fetched=fetched)
        self.counters.misses += 1
        self.counters.add_bytes(len(fetched), sum(t.numel() * t.element_size() for t in fetched.values()))
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.cache.get(self.position) is None:
            if self.cache.wants(self.position):
                evicted = self.cache.spare()
                if evicted is not None:
                    evicted["unit"].release()
                self.cache.admit(self.position, {"unit": self.unit})
            else:
                self.unit.release()
        return output

    def on_error(self, module: nn.Module) -> None:
        if self.cache.get(self.position) is None:
            self.unit.release()

    def detach_hook(self, module: nn.Module) -> None:
        self.cache.resident.pop(self.position, None)
        self.unit.release()


def routed_shares(model: nn.Module) -> dict[str, tuple[float, int]]:
    """Per expert tensor of ``model`` (a fused experts module's per-expert parameters, a list of experts' members'
    parameters): the share of its bytes a token's routing reads, ``num_experts_per_tok`` (the model's config; all
    where it names none) of the experts, and the reads that takes (a fused tensor's routed rows are read one by one)."""
    from offload_core.module_hooks.experts.loader import is_fused_experts

    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)

    def routed_of(experts: int) -> int:
        return min(top_k, experts) if isinstance(top_k, int) else experts

    shares: dict[str, tuple[float, int]] = {}
    for name, module in model.named_modules():
        if is_fused_experts(module):
            routed = routed_of(module.num_experts)
            for local, tensor in module.named_parameters(recurse=False):
                if tensor.dim() == 3 and tensor.shape[0] == module.num_experts:
                    shares[f"{name}.{local}" if name else local] = (routed / module.num_experts, routed)
    for name, container in expert_lists(model):
        members = len(container)
        routed = routed_of(members)
        for local, _ in container.named_parameters():
            shares[f"{name}.{local}"] = (routed / members, routed / members)
    return shares
