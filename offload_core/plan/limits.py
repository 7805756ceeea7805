"""The budgets a plan keeps, or refuses in one line naming the option to change: the disk budget, the units a policy
keeps in flight, a map a policy makes itself, and what a store holding offloaded weights in memory adds to the cpu's.
Where keeping one is impossible (a block larger than the budget), ``over_budget="warn"`` runs over it instead, a
warning line naming by how much."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import defaults
from offload_core.errors import ConfigError, OffloadError
from offload_core.planning.budgets import check_over_budget
from offload_core.registry.contracts import Policy, Storage
from offload_core.registry.manager import get_registry
from offload_core.values import format_size

log = logging.getLogger(__name__)


def check_disk_budget(summary: dict, max_memory: Mapping[Any, int], largest_block: int, headroom: int) -> None:
    """A ``disk`` budget is a limit: ``max_memory.disk=0`` means nothing may be offloaded to disk."""
    if "disk" not in max_memory:
        return
    on_disk = summary["devices"].get("disk", {}).get("bytes", 0)
    allowed = max_memory["disk"]
    if on_disk <= allowed:
        return
    short = on_disk - allowed
    needed = summary["devices"].get("cpu", {}).get("bytes", 0) + short + headroom
    memory = (
        ", ".join(f"max_memory.{k}={format_size(v)}" for k, v in max_memory.items() if k != "disk")
        or "no memory budget"
    )
    if headroom:
        memory += f" less headroom {format_size(headroom)}"
    raise ConfigError(
        f"the model ({format_size(summary['total_bytes'])}; largest unsplittable layer {format_size(largest_block)}) "
        f"does not fit in {memory} with max_memory.disk={format_size(allowed)}: {short} more bytes are needed; set "
        f"max_memory.cpu to at least {needed} ({format_size(needed)}) or allow disk (raise or remove max_memory.disk)"
    )


def check_reserve_in_budget(
    reserve: Mapping[Any, int],
    budgets: Mapping[Any, int],
    max_memory: Mapping[Any, int],
    block: int,
    policy_name: str,
    over_budget: str = defaults.OVER_BUDGET,
) -> None:
    """A device whose budget cannot hold the units the policy keeps in flight (the placement puts nothing else there
    and the run still takes them, over the budget by the difference): one warning line per such device saying by how
    much the run goes over it, or with ``over_budget="refuse"`` a :class:`ConfigError` in one line."""
    check_over_budget(over_budget)
    for dev, held in reserve.items():
        if dev not in budgets or held <= budgets[dev]:
            continue
        given = max_memory.get(dev, budgets[dev])
        needed = given + held - budgets[dev]
        what = (
            f"hook={policy_name} holds {format_size(held)} on {dev} for units in flight (the largest unsplittable "
            f"block is {format_size(block)}), over max_memory.{dev}={format_size(given)}"
            + (" less headroom" if budgets[dev] != given else "")
        )
        remedy = f"raise max_memory.{dev} to at least {needed} ({format_size(needed)})" + (
            " (hook=align_per_call holds one unit at a time, the fewest of any policy)"
            if policy_name == "align_per_call"
            else f", or choose a policy that holds fewer units ({_fewer(policy_name)}hook=align_per_call)"
        )
        over = format_size(held - budgets[dev])
        if over_budget == "refuse":
            raise ConfigError(f"{what}: the run would go over it by {over} (over_budget=refuse); {remedy}")
        log.warning(
            "%s: the run will go over it by %s; %s (over_budget=refuse refuses such a plan)", what, over, remedy
        )


def _fewer(policy_name: str) -> str:
    """``"hook.depth, "`` where policy ``policy_name`` has that option (a shallower look-ahead holds fewer units)."""
    try:
        config = get_registry().get("policy", policy_name).config
    except OffloadError:
        return ""
    return "hook.depth, " if "depth" in {field.name for field in dataclasses.fields(config)} else ""


def check_own_map_budgets(
    summary: dict,
    budgets: Mapping[Any, int],
    max_memory: Mapping[Any, int],
    reserve: Mapping[Any, int],
    policy: Policy,
    policy_name: str,
    model: nn.Module,
    execution_device: torch.device,
) -> None:
    """A map the policy made itself keeps every budget as the placement's does (with the units in flight and, on
    a CPU run, the headroom held back), or the run is refused in one line naming the option to change."""
    for dev, info in summary["devices"].items():
        if dev not in budgets:
            continue
        used = info["bytes"] + reserve.get(dev, 0)
        if used <= budgets[dev]:
            continue
        short = used - budgets[dev]
        held = budgets[dev] != max_memory[dev]
        key = f"max_memory.{dev}"
        room = f"{format_size(budgets[dev])} budget" + (
            f" ({key}={format_size(max_memory[dev])} less headroom {format_size(max_memory[dev] - budgets[dev])})"
            if held
            else ""
        )
        in_flight = f" ({format_size(reserve[dev])} of it held back for units in flight)" if reserve.get(dev) else ""
        remedy = policy.own_map_remedy(model, execution_device, dev, short)
        raise ConfigError(
            f"hook={policy_name}'s own device map puts {format_size(used)} on {dev}{in_flight}, over "
            f"its {room}: {remedy + ', or ' if remedy else ''}raise {key} to at least {max_memory[dev] + short} "
            f"({format_size(max_memory[dev] + short)})"
        )


def check_memory_store_budget(
    summary: dict,
    storage: Storage,
    max_memory: Mapping[Any, int],
    held: int,
    store_memory: int | None = None,
    over_budget: str = defaults.OVER_BUDGET,
) -> None:
    """A store that holds offloaded weights in this process's memory (``reads_from == "memory"``: ``pinned_cpu``)
    keeps the disk tier there too (``store_memory`` bytes where it holds them in fewer than they compute in, else the
    tier's own), beside the cpu tier and ``held`` (the cpu's units in flight and headroom): over ``max_memory.cpu``,
    refused in one line (``over_budget="warn"``: a warning line saying by how much)."""
    on_disk = summary["devices"].get("disk", {}).get("bytes", 0)
    budget = max_memory.get("cpu")
    if storage.reads_from != "memory" or not on_disk or budget is None:
        return
    kept = on_disk if store_memory is None else store_memory
    in_memory = summary["devices"].get("cpu", {}).get("bytes", 0) + kept + held
    if in_memory <= budget:
        return
    what = (
        f"storage={get_registry().name_of('storage', storage)} holds the {format_size(kept)} offloaded to "
        f"disk in memory too: {format_size(in_memory)} of anonymous memory over max_memory.cpu={format_size(budget)}"
    )
    remedy = (
        f"use storage=safetensors or storage=memmap (they read offloaded weights from files), or raise max_memory.cpu "
        f"to at least {in_memory} ({format_size(in_memory)})"
    )
    over = format_size(in_memory - budget)
    if check_over_budget(over_budget) == "refuse":
        raise ConfigError(f"{what}: the run would go over it by {over} (over_budget=refuse); {remedy}")
    log.warning("%s: the run will go over it by %s; %s (over_budget=refuse refuses such a plan)", what, over, remedy)
