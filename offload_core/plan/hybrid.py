"""``hybrid=true``: the plan's split of the offloaded blocks between host compute and streaming to the GPU, solved from
this machine's calibrated rates (pinned host-to-device bandwidth, a decoding step of one block on the host and on the
GPU), and the prefetch policy that runs it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from offload_core.errors import ConfigError
from offload_core.plan.make import Plan
from offload_core.module_hooks.prefetch import Prefetch
from offload_core.module_hooks.prefetch.hybrid import HybridPrefetch, check_hybrid_device, host_threads
from offload_core.planning import device_of
from offload_core.planning.hybrid import Rates, Split, solve_split
from offload_core.plan.calibrate import calibrate
from offload_core.runner.settings import Settings, Strategies
from offload_core.values import is_offloaded

#: the shape a decoding step of one sequence computes: one row, one new position
DECODE = {"decode": (1, 1)}


def check_hybrid(settings: Settings, policy_name: str) -> None:
    """``hybrid=true`` needs a GPU run streaming with prefetch; anything else is one line saying what to change."""
    if not settings.hybrid:
        return
    check_hybrid_device(settings.execution_device)
    if policy_name != "prefetch":
        raise ConfigError(
            f"hybrid=true streams the other blocks with hook=prefetch, not hook={policy_name}: add hook=prefetch"
        )
    if settings.auto:
        raise ConfigError("hybrid=true is not ranked by auto=true: give hook=prefetch and leave auto out")


def offloaded_units(model: nn.Module, device_map: dict, no_split: list[str], device: torch.device) -> dict[str, tuple]:
    """Per offloaded block (a module of a no-split class with every tensor offloaded), in module order: its bytes;
    the other offloaded bytes (streamed always) under ``""``, with the block names that can go to the host."""
    blocks: dict[str, int] = {}
    other = 0
    inside: set[str] = set()
    for name, module in model.named_modules():
        if type(module).__name__ not in no_split or any(name.startswith(f"{b}.") for b in blocks):
            continue
        tensors = [*module.named_parameters(prefix=name), *module.named_buffers(prefix=name)]
        places = [is_offloaded(device_of(device_map, key), device) for key, _ in tensors]
        if tensors and all(places):
            blocks[name] = sum(t.numel() * t.element_size() for _, t in tensors)
            inside.update(key for key, _ in tensors)
    for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if key not in inside and is_offloaded(device_of(device_map, key), device):
            other += tensor.numel() * tensor.element_size()
    return {"blocks": blocks, "other": other}


def measured_rates(settings: Settings, run_model: Any, block_bytes: int, resident_blocks: int) -> Rates:
    """This machine's rates for ``run_model`` (cached in the calibration file, ``calibrate=true`` measures again)."""
    model, no_split, dtype = run_model.model, run_model.no_split, run_model.dtype
    device = settings.execution_device
    on_gpu = calibrate(model, no_split, dtype, device, {}, DECODE, refresh=settings.calibrate)
    before = torch.get_num_threads()
    torch.set_num_threads(host_threads())  # the host computes with these (the calibration is keyed by them)
    try:
        on_host = calibrate(model, no_split, dtype, torch.device("cpu"), {}, DECODE, refresh=settings.calibrate)
    finally:
        torch.set_num_threads(before)
    host_s = on_host["compute"]["decode"].get("block_s")
    gpu_s = on_gpu["compute"]["decode"].get("block_s")
    if not host_s:
        raise ConfigError("hybrid=true needs a block of this model timed on the host, which failed: leave hybrid out")
    if not gpu_s:  # said in a line by the calibration: the split is solved with the GPU's compute as free
        return Rates(on_gpu["h2d_bps"], block_bytes / host_s)
    return Rates(on_gpu["h2d_bps"], block_bytes / host_s, block_bytes / gpu_s, resident_blocks * gpu_s)


def plan_split(model: nn.Module, plan: Plan, no_split: list[str], device: torch.device, rates: Rates) -> tuple:
    """The split of ``plan``'s offloaded blocks for ``rates``: (block names on the host, :class:`Split`)."""
    found = offloaded_units(model, plan.device_map, no_split, device)
    names = list(found["blocks"])
    sizes = [found["blocks"][n] for n in names] + ([found["other"]] if found["other"] else [])
    split = solve_split(sizes, list(range(len(names))), rates)
    return [names[i] for i in split.host], split


def hybrid_strategies(settings: Settings, strategies: Strategies, run_model: Any, plan: Plan) -> Strategies:
    """``strategies`` with prefetch made hybrid, its host blocks solved for this machine (unchanged without
    ``hybrid``)."""
    if not settings.hybrid:
        return strategies
    policy = strategies.policy
    assert isinstance(policy, Prefetch), "check_hybrid refused another policy"
    model, device = run_model.model, settings.execution_device
    found = offloaded_units(model, plan.device_map, run_model.no_split, device)
    blocks = [m for m in model.modules() if type(m).__name__ in run_model.no_split]
    if not found["blocks"] or not blocks:
        split, host = Split(), []
    else:
        block_bytes = max(found["blocks"].values())
        rates = measured_rates(settings, run_model, block_bytes, len(blocks) - len(found["blocks"]))
        host, split = plan_split(model, plan, run_model.no_split, device, rates)
    hybrid = HybridPrefetch(policy.config, host, split)
    return dataclasses.replace(strategies, policy=hybrid)
