"""graphs: decoding steps captured once and replayed (CUDA graphs), for a model in memory or offloaded with prefetch.

With ``graphs=true`` a model offloaded with the prefetch policy from a pinned store streams its offloaded blocks by a
static schedule (:class:`StaticRing`: unit i in slot i mod K of a ring, copies and compute ordered by events alone),
and generation uses a static KV cache: a one-token step is then the same stream work every token, captured once
(:class:`DecodeGraphs`) and replayed, so neither the resident layers' kernel launches nor the streamed ones' copies
and waits cost the host anything per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload_core import devices
from offload_core.module_hooks.base import add_hook_to_module, module_hooks, no_auto_compile
from offload_core.module_hooks.graphs.decode import DecodeGraphs
from offload_core.module_hooks.graphs.ring import StaticRing
from offload_core.module_hooks.prefetch.layout import _max_nesting
from offload_core.module_hooks.prefetch.policy import PrefetchHandle
from offload_core.module_hooks.prefetch.prefetcher import PrefetchHook

__all__ = ["DecodeGraphs", "StaticRing", "apply_graphs", "graph_pool_bytes", "graphs_refusal"]


def graphs_refusal(
    device: torch.device | str, policy: str | None, store_pinned: bool | None, speculative: bool
) -> str | None:
    """Why ``graphs=true`` cannot apply to a run (one line that says what to do), or None where it can.

    ``policy`` is the module-hook policy's name (None: the model is in memory); ``store_pinned`` whether the store
    holding the offloaded weights is page-locked (None: nothing is offloaded)."""
    device = torch.device(device)
    if not devices.for_device(device).supports_graphs(device):
        return f"graphs=true captures decoding steps on a CUDA GPU; this run computes on {device}: drop graphs"
    if speculative:
        return "graphs=true captures one-token decoding steps; speculative decoding verifies several: drop one of them"
    if policy is not None and policy != "prefetch":
        return f"graphs=true streams offloaded blocks by the prefetch schedule; hook={policy}: use hook=prefetch"
    if policy is not None and store_pinned is False:
        return (
            "graphs=true copies offloaded blocks from page-locked memory inside the graph; this store is not pinned: "
            "use storage=pinned_cpu"
        )
    return None


def graph_pool_bytes(
    config: Any, batch: int = 1, dtype: torch.dtype | None = None, max_length: int | None = None
) -> int:
    """What the graph's memory pool holds for one decoding step of ``batch`` tokens (planned inside the budget):
    the step's activations as the caching allocator would hold them at their peak (a dozen hidden-size vectors and
    two of the MLP's width per token), the attention scores over ``max_length`` cached positions in float32, the
    logits in the model's dtype and in float32, and the step's static inputs; doubled for the allocator's rounding.
    ``max_length`` defaults to the model's longest context, at most 4096; ``dtype`` to bfloat16."""
    dtype = dtype or torch.bfloat16
    if max_length is None:
        max_length = min(int(getattr(config, "max_position_embeddings", 0) or 4096), 4096)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    width = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    size = dtype.itemsize
    per_token = (12 * hidden + 2 * width) * size + heads * max_length * 4 + vocab * (size + 4) + max_length * 8
    return 2 * batch * per_token


def apply_graphs(model: nn.Module, device: torch.device | str | None = None) -> DecodeGraphs:
    """Capture ``model``'s one-token decoding steps and replay them (its generation config is set to a static KV
    cache). An offloaded model must be dispatched with the prefetch policy from a pinned store: its prefetcher is
    replaced by a :class:`StaticRing` of as many slots as the prefetcher's pool. Raises :class:`GraphsError` where
    graphs cannot apply."""
    from offload_core.errors import GraphsError

    state = getattr(model, "offload_state", None)
    handle = state.handle if state is not None else None
    if device is None:
        device = state.execution_device if state is not None else next(model.parameters()).device
    device = torch.device(device)
    policy = None
    if handle is not None and handle.units:
        policy = "prefetch" if isinstance(handle, PrefetchHandle) else type(handle).__name__
    store = state.store if state is not None else None
    refusal = graphs_refusal(device, policy, (store is not None and store.pinned) if policy else None, False)
    if refusal is not None:
        raise GraphsError(refusal)
    ring = None
    if policy is not None:
        if _max_nesting(handle.units) > 1:
            raise GraphsError(
                "graphs=true streams blocks one at a time; this model's offloaded units nest: drop graphs"
            )
        old = handle.prefetcher
        old.close()
        ring = StaticRing(handle.units, store, device, old.depth, handle.context.stats)
        for one in handle.handles:
            if isinstance(getattr(one, "hook", None), PrefetchHook):
                one.hook.prefetcher = ring
        handle.prefetcher = ring
    existing = [h for h in module_hooks(model) if isinstance(h, DecodeGraphs)]
    if existing:
        return existing[0]
    hook = DecodeGraphs(devices.for_device(device), device, ring)
    add_hook_to_module(model, hook)
    no_auto_compile(model)  # the graph replaces transformers' own compiled one
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.cache_implementation = "static"
    return hook
