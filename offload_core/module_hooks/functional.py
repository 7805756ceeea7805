"""functional_call (as vLLM's --cpu-offload-gb does it): offloaded parameters are passed to
``torch.func.functional_call``; the module's own parameters are never rebound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from offload_core.module_hooks.align import attach_io_hooks
from offload_core.module_hooks.base import ModuleHook, add_hook_to_module, send_to_device
from offload_core.module_hooks.keeper import keep_page_cache
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.units import TransferStats, Unit, check_granularity, find_units
from offload_core.planning.reservation import InFlight, reserve_units
from offload_core.module_hooks.policy import Policy
from offload_core.values import budget_key, format_size, parse_size


class FunctionalCallHook(ModuleHook):
    """Runs the unit's forward through ``functional_call`` with its offloaded tensors copied to the device."""

    name = "functional_call_offload"

    def __init__(
        self,
        unit: Unit,
        store: Mapping[str, torch.Tensor],
        execution_device: torch.device,
        stats: TransferStats,
        non_blocking: bool = False,
    ) -> None:
        self.unit = unit
        self.store = store
        self.execution_device = execution_device
        self.stats = stats
        self.non_blocking = non_blocking
        prefix = unit.name + "." if unit.name else ""
        self._names = [(s.full[len(prefix) :], s.key) for s in unit.slots]

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    def call_forward(self, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        fetched = self.unit.fetch(self.store, self.execution_device, self.non_blocking)
        self.stats.add_unit(fetched, self.store)
        params = self.unit.as_params(fetched)
        tensors = {_CALL_PREFIX + name: params.get(key, fetched[key]) for name, key in self._names}
        # functional_call calls the module it is given: give it a bare one around the inner forward, so
        # the block's own forward hooks and pre-hooks run once, around this call, as in memory.
        try:
            return torch.func.functional_call(
                _InnerCall(module, forward), tensors, args, kwargs, tie_weights=False, strict=False
            )
        finally:
            self.unit.used()


_CALL_PREFIX = "block."


class _InnerCall(nn.Module):
    """Runs ``forward`` with ``block``'s tensors swapped by functional_call, without going through
    ``block.__call__``."""

    def __init__(self, block: nn.Module, forward: Callable) -> None:
        super().__init__()
        self.block = block
        self._inner = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner(*args, **kwargs)


def offload_by_budget(model: nn.Module, budget: int, tier: str = "cpu") -> dict[str, int | str]:
    """vLLM's rule: walk parameters front to back and offload each to ``tier`` until ``budget`` bytes
    are spent (a module may end up half offloaded). Returns a tensor-level device map whose other
    entries say ``"resident"``-style placement on the execution device is the caller's to fill in.
    """
    offloaded: dict[str, int | str] = {}
    spent = 0
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            offloaded[name] = tier  # a tied alias follows its first name
            continue
        seen.add(id(param))
        size = param.numel() * param.element_size()
        if spent + size > budget:
            continue
        spent += size
        offloaded[name] = tier
    return offloaded


def _spent(model: nn.Module, budget: int | None) -> int:
    """Bytes :func:`offload_by_budget` offloads with ``budget`` (None: every parameter)."""
    params = {id(p): p for p in model.parameters()}
    if budget is None:
        return sum(p.numel() * p.element_size() for p in params.values())
    offloaded = offload_by_budget(model, budget)
    named = dict(model.named_parameters(remove_duplicate=False))
    return sum(named[n].numel() * named[n].element_size() for n in {id(named[n]): n for n in offloaded}.values())


@dataclass
class FunctionalCallConfig:
    name: str = "functional_call"
    #: "block": one functional_call per no-split block (vLLM wraps each layer); "module": per owning module
    granularity: str = "block"
    #: vLLM's --cpu-offload-gb: when set (e.g. "4GiB" or bytes), parameters are offloaded front to back
    #: until this many bytes are offloaded, instead of following the placement's map
    cpu_offload: Optional[str] = None


class FunctionalCall(Policy):
    """Policy: offloaded tensors go in as ``functional_call`` arguments for the duration of one call."""

    auto = True
    keeps_page_cache = True

    def __init__(self, config: FunctionalCallConfig) -> None:
        check_granularity(config.granularity)
        self.config = config
        self.cpu_offload = parse_size(config.cpu_offload, what="hook.cpu_offload") if config.cpu_offload else None

    def own_device_map(self, model: nn.Module, execution_device: torch.device) -> dict[str, int | str] | None:
        """With ``cpu_offload`` set, vLLM's map instead of the placement's: parameters offloaded front to
        back until that many bytes are (to ``cpu`` for a GPU run, ``disk`` for a CPU run); None otherwise."""
        if self.cpu_offload is None:
            return None
        cpu_run = execution_device.type == "cpu"
        main = budget_key(execution_device)
        offloaded = offload_by_budget(model, self.cpu_offload, "disk" if cpu_run else "cpu")
        return {name: offloaded.get(name, main) for name in model.state_dict(keep_vars=True)}

    def own_map_remedy(self, model: nn.Module, execution_device: torch.device, device: Any, short: int) -> str:
        """The ``hook.cpu_offload`` that moves ``short`` bytes off ``device``: more offloaded when the run's own
        device is over its budget, less when the offload tier is."""
        assert self.cpu_offload is not None, "only a cpu_offload map is the policy's own"
        main = budget_key(execution_device)
        if device != main:
            fits = max(self.cpu_offload - short, 0)
            return f"set hook.cpu_offload to at most {fits} ({format_size(fits)})"
        wanted = _spent(model, self.cpu_offload) + short
        total = _spent(model, None)
        if wanted > total:
            return "no hook.cpu_offload fits (the buffers and the run's own memory alone exceed it)"
        low, value = wanted, total  # the walk skips a tensor that does not fit: the least budget that offloads enough
        while low < value:
            middle = (low + value) // 2
            low, value = (low, middle) if _spent(model, middle) >= wanted else (middle + 1, value)
        return f"set hook.cpu_offload to at least {value} ({format_size(value)})"

    @property
    def granularity(self) -> str:
        return self.config.granularity

    def reserve(self, need: InFlight) -> dict:
        """One unit in flight: a block, or a module at ``granularity=module``."""
        return reserve_units(need, need.module_bytes if self.config.granularity == "module" else need.block_bytes)

    def attach(self, model: nn.Module, context: PolicyContext) -> PolicyHandle:
        units = find_units(model, context.offloaded, context.no_split_module_classes, self.config.granularity)
        handles = attach_io_hooks(model, context, True, ())
        for unit in units:
            hook = FunctionalCallHook(
                unit, context.store, context.execution_device, context.stats, context.non_blocking
            )
            handles.append(add_hook_to_module(unit.module, hook))
        handles += keep_page_cache(model, context.store, context.residency, units)
        return PolicyHandle(model, context, units, handles)
