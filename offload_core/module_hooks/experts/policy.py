"""The expert-granular policy ``experts``: prefetch's block units for everything but the MoE experts, whose routed rows
alone are read, cached and guessed ahead (a list of expert modules: each expert read when called, and cached)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

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
from offload_core.module_hooks.experts.device import DEVICE_GUESS_PAYS, DeviceLayer
from offload_core.module_hooks.experts.slots import DeviceExperts
from offload_core.module_hooks.experts.mapped import MappedLayer, mapped_views
from offload_core.module_hooks.experts.router import router_guess
from offload_core.module_hooks.experts.sizes import (
    every_expert,
    offloaded_experts,
    page_cache_note,
    placed_bytes,
    resident_bytes,
)
from offload_core.module_hooks.experts.rows import RowsLayer
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.reader import Reader
from offload_core.module_hooks.prefetch.policy import Prefetch, PrefetchConfig, PrefetchHandle
from offload_core.module_hooks.units import Unit
from offload_core.planning.reservation import InFlight
from offload_core.values import budget_key, format_size

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
        shared: DeviceExperts | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.layers = layers
        self.expert_counters = counters
        self.reader = reader
        self.cache_slots = cache_slots
        self.shared = shared

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
                "expert_transfers": c.transfers,
                "expert_transfers_per_token": c.decode_transfers / c.decode_tokens if c.decode_tokens else 0.0,
                "expert_hit_rate": c.hits / served if served else 0.0,
                "expert_guess_accuracy": c.guessed_right / c.routed if c.routed else 0.0,
                "expert_guessing": int(c.guessing),
                "expert_guess_pauses": c.guess_pauses,
            }
        )
        if self.shared is not None:  # the device cache, over all layers
            counters["expert_device_cache_slots"] = self.shared.cache_slots
            counters["expert_device_evictions"] = self.shared.cache.evictions
        return counters

    def _stop_reading(self) -> None:
        """End the reader (what it is reading finishes, the rest is cancelled), then let go of every guess."""
        self.reader.stop()
        for layer in self.layers:
            layer.drop_guesses([])
        if self.shared is not None:
            self.shared.close()

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
        self.start_transfers = 0
        self.decode = 0

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        self.decode = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] == 1 else 0
        self.start = self.counters.bytes
        self.start_transfers = self.counters.transfers
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.decode:
            self.counters.decode_tokens += self.decode
            self.counters.decode_bytes += self.counters.bytes - self.start
            self.counters.decode_transfers += self.counters.transfers - self.start_transfers
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
        self.device_slots: Optional[int] = None  # experts the device cache holds, over all layers (:meth:`reserve`)
        self.ahead: Optional[int] = None  # read-ahead slots on the device
        #: (device budget, bytes held back on it, one expert's bytes, MoE layers) from :meth:`reserve`
        self.device_left: tuple[Optional[int], int, int, int] = (None, 0, 0, 0)

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
        if not self.takes_part_in(need.model):
            self.cache_note = "hook=experts: this model has no experts; its blocks are read as hook=prefetch reads them"
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
                gpu = budget_key(need.execution_device)
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
                + page_cache_note(need, experts, top_k)
            )
            return reserve
        if need.execution_device.type != "cpu" and fused_layers:
            return self._reserve_device(need, reserve, (fused_row, fused_layers), (listed_row, listed_layers), top_k)
        if self.config.cache_slots is None and need.cpu_budget is not None and row * layers:
            left = need.cpu_budget - reserve.get("cpu", 0) - in_flight  # after the blocks and the rows in flight
            if need.offloaded is not None and need.execution_device.type == "cpu":
                left -= resident_bytes(need.model, need.offloaded, need.dtype)  # a kept expert beats a cached one
            self.slots = max(0, min(AUTO_SLOTS, left // (row * layers)))
        cache = self.slots * row * layers
        reserve["cpu"] = reserve.get("cpu", 0) + cache + in_flight
        if listed_layers and need.execution_device.type != "cpu":
            gpu = budget_key(need.execution_device)
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

    def _reserve_device(
        self, need: InFlight, reserve: dict, fused: tuple[int, int], listed: tuple[int, int], top_k: int
    ) -> dict:
        """On an accelerator: the fused experts' read-ahead slots on the device (:mod:`.device`) and their cache:
        ``cache_slots`` per MoE layer held back here, or by default no reservation: the cache takes what the device
        budget has left once the placement has put its weights there (:meth:`_device_experts`), so weights every token
        reads stay on the device first; a store that packs the experts, scratch to decode them there (one per stream).
        Host memory only to stage the rows of a store that is not page-locked."""
        (row, layers), (listed_row, listed_layers) = fused, listed
        gpu = budget_key(need.execution_device)
        self.ahead = top_k if self.config.guess != "none" else 0
        self.device_slots = None if self.config.cache_slots is None else self.config.cache_slots * layers
        cache = (self.device_slots or 0) * row
        reserve[gpu] = reserve.get(gpu, 0) + cache + self.ahead * row + self.slots * listed_row * listed_layers
        decoding = need.experts_scratch * (2 if self.ahead else 1)  # the packed experts' decoding, one per stream
        reserve[gpu] += decoding
        if need.offloaded is None:  # a bound for any map: the buffers of every expert tensor's shape
            reserve[gpu] += every_expert(need.model, need.dtype).buffers
        self.device_left = (need.device_budget, reserve[gpu], row, layers)
        staging = 0 if need.store_pinned else 2 * top_k * row  # the misses and the guesses being staged
        reserve["cpu"] = reserve.get("cpu", 0) + staging
        held = (
            f"{self.device_slots} experts over {layers} MoE layers = {format_size(cache)}"
            if self.device_slots is not None
            else f"what the device budget has left once the weights are placed (at most {AUTO_SLOTS} per layer"
            f" of {layers})"
        )
        self.cache_note = (
            f"expert cache on {need.execution_device}: {held}, experts of {format_size(row)}; {self.ahead} read-ahead "
            f"slots ({format_size(self.ahead * row)}); {format_size(staging)} of host memory to stage rows"
            + (f"; {format_size(decoding)} to dequantize the routed experts there" if decoding else "")
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
        shared = self._device_experts(model, plan, len(expert_units))
        if shared is not None:
            counters.pays = DEVICE_GUESS_PAYS
        layers: list[ExpertLayer] = []
        for index, unit in enumerate(expert_units):
            if shared is not None:
                layers.append(DeviceLayer(unit, plan.store, shared, counters, config.whole_fraction, reader, index))
                continue
            views = mapped_views(plan.store, unit.keys)
            kind = RowsLayer if views is None else MappedLayer
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
            shared=shared,
        )

    def _device_experts(self, model: nn.Module, plan: PolicyContext, layers: int) -> DeviceExperts | None:
        """On an accelerator, what the fused MoE layers share (:class:`DeviceExperts`), sized as :meth:`reserve` held
        back (without a reservation: ``cache_slots`` per layer, no cache by default); None on a CPU run."""
        if plan.execution_device.type == "cpu" or not layers:
            return None
        slots = self.device_slots
        if slots is None and self.config.cache_slots is not None:
            slots = self.config.cache_slots * layers
        elif slots is None:  # what the budget has left beside the weights placed there and the units in flight
            budget, held, row, _ = self.device_left
            placed = placed_bytes(model, plan.execution_device)
            free = budget - placed - held - row if budget is not None else 0  # an expert to spare
            slots = max(0, min(AUTO_SLOTS * layers, free // max(row, 1)))
        ahead = self.ahead
        if ahead is None:
            top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
            ahead = (top_k if isinstance(top_k, int) else AUTO_SLOTS) if self.config.guess != "none" else 0
        return DeviceExperts(plan.execution_device, slots, ahead)
