"""The expert-granular policy ``experts``: prefetch's block units for everything but the MoE experts, whose routed rows
alone are read, cached and guessed ahead (a list of expert modules: each expert read when called, and cached)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from offload_core.module_hooks.base import ModuleHook, add_hook_to_module
from offload_core.module_hooks.experts.cache import ExpertCache
from offload_core.module_hooks.experts.lists import (
    ListedExpertHook,
    listed_expert_sizes,
    listed_expert_units,
    routed_shares,
)
from offload_core.module_hooks.experts.loader import (
    Buffers,
    ExpertCounters,
    ExpertLayer,
    ExpertsHook,
    expert_sizes,
    expert_slots,
    is_fused_experts,
    most_experts,
)
from offload_core.module_hooks.experts.mapped import MappedLayer, mapped_views
from offload_core.module_hooks.experts.rows import RowsLayer
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.reader import Reader
from offload_core.module_hooks.prefetch.policy import Prefetch, PrefetchConfig, PrefetchHandle
from offload_core.module_hooks.units import Unit
from offload_core.planning.reservation import InFlight
from offload_core.values import format_size

GUESSES = ("router", "previous", "none")
AUTO_SLOTS = 2  # the most cache slots per layer chosen from the budget


@dataclass
class ExpertsConfig(PrefetchConfig):
    name: str = "experts"
    #: experts of each MoE layer kept in host memory (LFRU); 0 turns the cache off; None (the default):
    #: as many as the cpu budget holds beside the experts being read, at most AUTO_SLOTS
    cache_slots: Optional[int] = None
    #: how the next MoE layer's experts are guessed and read ahead: "router" (its router on this
    #: layer's hidden state), "previous" (what it selected for the previous token) or "none"
    guess: str = "router"
    #: a call that selects at least this fraction of a layer's experts reads the whole tensors at once
    whole_fraction: float = 0.75


class ExpertsHandle(PrefetchHandle):
    """The handle of the ``experts`` policy: prefetch's counters for the blocks, the experts' own beside them."""

    def __init__(
        self,
        *args: Any,
        layers: list[ExpertLayer],
        counters: ExpertCounters,
        reader: Reader,
        cache_slots: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.layers = layers
        self.expert_counters = counters
        self.reader = reader
        self.cache_slots = cache_slots

    def counters(self) -> dict[str, int | float]:
        """Prefetch's block counters, and for the experts: cache ``expert_hits``, guesses read ahead and
        used (``expert_guess_hits``), reads on demand (``expert_misses``), whole-tensor reads, bytes read
        (in all and per decode token), the cache hit rate and how often a guessed expert was selected."""
        c = self.expert_counters
        served = c.hits + c.predicted_hits + c.misses
        counters = dict(super().counters())
        counters.update(
            {
                "expert_cache_slots": self.cache_slots,
                "expert_hits": c.hits,
                "expert_guess_hits": c.predicted_hits,
                "expert_misses": c.misses,
                "expert_whole_reads": c.whole_reads,
                "expert_bytes": c.bytes,
                "expert_bytes_per_token": c.decode_bytes / c.decode_tokens if c.decode_tokens else 0.0,
                "expert_hit_rate": c.hits / served if served else 0.0,
                "expert_guess_accuracy": c.guessed_right / c.routed if c.routed else 0.0,
                "expert_guessing": int(c.guessing),
                "expert_guess_pauses": c.guess_pauses,
            }
        )
        return counters

    def _stop_reading(self) -> None:
        """End the reader (what it is reading finishes, the rest is cancelled), then let go of every guess."""
        self.reader.stop()
        for layer in self.layers:
            layer.drop_guesses([])

    def offload_all(self) -> None:
        self._stop_reading()
        super().offload_all()

    def remove(self, restore_device: torch.device | str = "cpu") -> nn.Module:
        self._stop_reading()
        return super().remove(restore_device)


class TokenCounter(ModuleHook):
    """On the model's root: counts decode tokens (one new position per sequence) and the expert bytes they read."""

    name = "experts_tokens"

    def __init__(self, counters: ExpertCounters) -> None:
        self.counters = counters
        self.start = 0
        self.decode = 0

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        self.decode = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] == 1 else 0
        self.start = self.counters.bytes
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.decode:
            self.counters.decode_tokens += self.decode
            self.counters.decode_bytes += self.counters.bytes - self.start
        return output


class Experts(Prefetch):
    """Policy: block-granular prefetch, except the experts of MoE layers: only the routed ones are read."""

    #: ``auto=true`` considers it for a model with experts, its moved bytes counted for the routed ones
    #: (:meth:`read_shares`)
    auto = True

    def __init__(self, config: ExpertsConfig) -> None:
        from offload_core.errors import ConfigError

        super().__init__(config)
        if config.cache_slots is not None and config.cache_slots < 0:
            raise ConfigError(
                f"hook.cache_slots={config.cache_slots} is negative: give the experts to keep per layer (0: no cache)"
            )
        if config.guess not in GUESSES:
            raise ConfigError(f"hook.guess={config.guess!r} is unknown: use one of {', '.join(GUESSES)}")
        if not 0 < config.whole_fraction <= 1:
            raise ConfigError(
                f"hook.whole_fraction={config.whole_fraction} is not in (0, 1]: give a fraction such as 0.75"
            )
        self.cache_note = ""
        self.slots = AUTO_SLOTS if config.cache_slots is None else config.cache_slots

    def takes_part_in(self, model: nn.Module) -> bool:
        """Only a model with experts: on another it reads as ``prefetch`` does."""
        return bool(routed_shares(model))

    def read_shares(self, model: nn.Module) -> dict[str, tuple[float, int]]:
        """Each expert tensor is read for the routed experts only: ``num_experts_per_tok`` of its experts a token
        (as many reads for a fused tensor, one per routed expert), the router's choice taken as even."""
        return routed_shares(model)

    def reserve(self, need: InFlight) -> dict:
        """Prefetch's reservation for the blocks, and from the cpu budget the expert cache (``cache_slots``
        experts per MoE layer) and the rows being read: on a CPU run all of a fused layer's experts (a prompt
        may route to every one; on an accelerator they go to the device, ``num_experts_per_tok`` at a
        time through host memory) and the next layer's guesses (``num_experts_per_tok`` where the
        model's config says; else as many as the layer has). A list of expert modules is cached where it
        runs: on a GPU run, on the device."""
        if need.model is None:
            return dict(super().reserve(need))
        if need.offloaded is None:
            reserve = dict(super().reserve(need))
            (fused_row, fused_layers), (listed_row, listed_layers) = (
                expert_sizes(need.model, need.dtype),
                listed_expert_sizes(need.model, need.dtype),
            )
            experts = most_experts(need.model)
        else:  # the experts the map offloads; prefetch's blocks are the rest, as :meth:`attach` makes them
            held = offloaded_experts(need.model, need.offloaded, need.dtype)
            (fused_row, fused_layers), (listed_row, listed_layers), experts = held.fused, held.listed, held.experts
            rest = {name: key for name, key in need.offloaded.items() if name not in held.names}
            copied = (
                need.copied if need.copied is not None else frozenset(need.offloaded if need.store_converts else ())
            )
            reserve = dict(super().reserve(replace(need, offloaded=rest, store_converts=not copied.isdisjoint(rest))))
            need = replace(need, store_converts=not copied.isdisjoint(held.names))
            if held.buffers and need.execution_device.type != "cpu":  # the routed experts' whole tensors
                gpu = need.execution_device.index or 0
                reserve[gpu] = reserve.get(gpu, 0) + held.buffers
        row, layers = max(fused_row, listed_row), fused_layers + listed_layers
        top_k = getattr(getattr(need.model, "config", None), "num_experts_per_tok", None)
        top_k = top_k if isinstance(top_k, int) else experts
        in_flight = ((experts if need.execution_device.type == "cpu" else top_k) + top_k) * fused_row
        if need.execution_device.type == "cpu" and need.store_maps and not need.store_converts and layers:
            # computed on the store's mapped views: routed and cached experts are page cache, never copies
            self.slots = AUTO_SLOTS if self.config.cache_slots is None else self.config.cache_slots
            self.cache_note = (
                f"experts: computed on the store's views ({layers} MoE layers, {format_size(row)} experts): "
                f"only routed rows are read or mapped, nothing is held from the cpu budget; "
                + _page_cache_note(need, experts, top_k)
            )
            return reserve
        if self.config.cache_slots is None and need.cpu_budget is not None and row * layers:
            left = need.cpu_budget - reserve.get("cpu", 0) - in_flight  # after the blocks and the rows in flight
            if need.offloaded is not None and need.execution_device.type == "cpu":
                left -= _resident_bytes(need.model, need.offloaded, need.dtype)  # a kept expert beats a cached one
            self.slots = max(0, min(AUTO_SLOTS, left // (row * layers)))
        cache = self.slots * row * layers
        reserve["cpu"] = reserve.get("cpu", 0) + cache + in_flight
        if listed_layers and need.execution_device.type != "cpu":
            gpu = need.execution_device.index or 0
            reserve[gpu] = reserve.get(gpu, 0) + self.slots * listed_row * listed_layers
        chosen = " (as many as the cpu budget holds)" if self.config.cache_slots is None else ""
        self.cache_note = (
            (
                f"expert cache: {self.slots} slots per layer{chosen} x {layers} MoE layers of "
                f"{format_size(row)} experts = {format_size(cache)} of the cpu budget "
                f"(and {format_size(in_flight)} for experts being read)"
            )
            if layers
            else ""
        )
        return reserve

    def plan_lines(self) -> list[str]:
        return [self.cache_note] if self.cache_note else []

    def attach(self, model: nn.Module, plan: PolicyContext) -> PolicyHandle:
        config = self.config
        expert_units = []
        for name, module in model.named_modules():
            if is_fused_experts(module):
                slots = expert_slots(name, module, plan.offloaded)
                if slots:
                    expert_units.append(Unit(name, module, slots))
        listed = listed_expert_units(model, plan.offloaded)
        listed_units = [unit for units, _ in listed for unit in units]
        taken = {slot.full for unit in expert_units + listed_units for slot in unit.slots}
        rest = {name: key for name, key in plan.offloaded.items() if name not in taken}
        blocks = super().attach(model, replace(plan, offloaded=rest))
        counters = ExpertCounters(stats=plan.stats)
        reader = Reader("experts")
        buffers = Buffers(plan.execution_device)
        # On a CPU run each layer computes on the store's mapped views where it hands them out (no copy), else
        # reads into rows of its own (a cached expert stays in place); on an accelerator the layers share one
        # buffer per shape, filled from host-memory rows.
        layers = []
        for unit in expert_units:
            views = mapped_views(plan.store, unit.keys) if plan.execution_device.type == "cpu" else None
            kind = ExpertLayer if plan.execution_device.type != "cpu" else RowsLayer if views is None else MappedLayer
            extra = {"views": views} if views is not None else {}
            layers.append(
                kind(
                    unit, plan.store, buffers, ExpertCache(self.slots), counters, config.whole_fraction, reader, **extra
                )
            )
        for layer, following in zip(layers, layers[1:]):
            if config.guess != "none":
                layer.next = following
            if config.guess == "router":
                layer.router = router_guess(model, following.unit.name, plan)
        handles = list(blocks.handles)
        handles.append(add_hook_to_module(model, TokenCounter(counters)))
        handles.extend(add_hook_to_module(layer.unit.module, ExpertsHook(layer)) for layer in layers)
        for units, positions in listed:  # a list of expert modules: each read when called, cached per layer
            cache = ExpertCache(self.slots)
            handles.extend(
                add_hook_to_module(
                    unit.module, ListedExpertHook(unit, position, cache, plan.store, plan.execution_device, counters)
                )
                for unit, position in zip(units, positions)
            )
        return ExpertsHandle(
            model,
            plan,
            blocks.units + expert_units + listed_units,
            handles,
            prefetcher=blocks.prefetcher,
            layers=layers,
            counters=counters,
            reader=reader,
            cache_slots=self.slots,
        )


def _resident_bytes(model: nn.Module, offloaded: Any, dtype: torch.dtype | None) -> int:
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


def _page_cache_note(need: InFlight, experts: int, top_k: int) -> str:
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


def router_guess(model: nn.Module, experts_name: str, plan: PolicyContext) -> Optional[Callable[[torch.Tensor], Any]]:
    """The router beside ``experts_name`` (its MoE block's ``gate``: weight ``[E, hidden]``, ``top_k``) as a
    guess of that block's experts from a hidden state; None where the block has no such router."""
    parent_name, _, _ = experts_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    gate = getattr(parent, "gate", None)
    experts = model.get_submodule(experts_name)
    top_k = getattr(gate, "top_k", getattr(parent, "top_k", None))
    weight = getattr(gate, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != experts.num_experts or not top_k:
        return None
    weight_name = f"{parent_name}.gate.weight" if parent_name else "gate.weight"
    key = plan.offloaded.get(weight_name)

    def guess(hidden: torch.Tensor) -> Any:
        if hidden.dim() != 2 or hidden.shape[0] * top_k > experts.num_experts:
            return None  # many tokens route to most experts: nothing worth guessing
        w = plan.store[key] if key is not None else gate.weight
        logits = torch.nn.functional.linear(hidden.to(device=w.device, dtype=w.dtype), w)
        return torch.unique(torch.topk(logits, top_k, dim=-1).indices).tolist()

    return guess
