"""The read-ahead guess of a MoE layer's experts from its router: the next layer's router applied to this layer's
hidden state, as a device tensor of expert indices (brought to the host with the routing) or a list."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from offload_core.module_hooks.policy import PolicyContext


class RouterGuess:
    """The router beside one experts module (its MoE block's ``gate``: weight ``[E, hidden]``, ``top_k``) as a guess
    of that module's experts from a hidden state."""

    def __init__(self, gate: nn.Module, top_k: int, num_experts: int, store: Any, key: Optional[str]) -> None:
        self.gate = gate
        self.top_k = top_k
        self.num_experts = num_experts
        self.store = store
        self.key = key

    def indices(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The guessed experts' indices (with repeats) where ``hidden`` is: None where many tokens route to most
        experts (nothing worth guessing). An offloaded router weight is copied there (a small, asynchronous copy
        from a page-locked store), so a guess on a GPU costs no host wait of its own."""
        if hidden.dim() != 2 or hidden.shape[0] * self.top_k > self.num_experts:
            return None
        w = self.store[self.key] if self.key is not None else self.gate.weight
        if w.device != hidden.device:
            w = w.to(hidden.device, non_blocking=True)
        logits = torch.nn.functional.linear(hidden.to(dtype=w.dtype), w)
        return torch.topk(logits, self.top_k, dim=-1).indices

    def __call__(self, hidden: torch.Tensor) -> Any:
        """The guessed experts as a sorted list, or None."""
        indices = self.indices(hidden)
        return None if indices is None else torch.unique(indices).tolist()


def router_guess(model: nn.Module, experts_name: str, plan: PolicyContext) -> Optional[RouterGuess]:
    """The :class:`RouterGuess` of the experts module ``experts_name``; None where its block has no such router."""
    parent_name, _, _ = experts_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    gate = getattr(parent, "gate", None)
    experts = model.get_submodule(experts_name)
    top_k = getattr(gate, "top_k", getattr(parent, "top_k", None))
    weight = getattr(gate, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != experts.num_experts or not top_k:
        return None
    weight_name = f"{parent_name}.gate.weight" if parent_name else "gate.weight"
    return RouterGuess(gate, top_k, experts.num_experts, plan.store, plan.offloaded.get(weight_name))
