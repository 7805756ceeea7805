"""``from_pretrained`` for a diffusers pipeline folder: one plan over every module component, one store, one policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from offload_core import defaults
from offload_core.module_hooks.policy import Policy
from offload_core.loading.pipeline import EmptyPipeline, attach_entries, build_empty_pipeline, component_no_split
from offload_core.values import budget_key


def whole_limit(budgets: Mapping[Any, int], device: torch.device, policy: Policy | None = None) -> int | None:
    """The largest component (or block) that moves whole: the execution device's budget shared by the units the
    policy holds in flight at once and what runs beside them (half of it for a policy holding one unit); None
    (any) when that device has no budget."""
    from offload_core.plan.reserve import units_in_flight

    key = budget_key(device)
    budget = budgets.get(key)
    if budget is None:
        return None
    return budget // (units_in_flight(policy, device) + 1)


def open_pipeline(
    path: str | Path, dtype: torch.dtype | None, limit: int | None, no_split: list[str] | None = None
) -> tuple[EmptyPipeline, Any, list[str]]:
    """The empty pipeline, its components' weights as one checkpoint, and the no-split classes its plan uses
    (:func:`open_components`)."""
    empty = build_empty_pipeline(path, dtype)
    return (empty, *open_components(empty, path, limit, no_split))


def open_components(
    empty: EmptyPipeline, path: str | Path, limit: int | None, no_split: list[str] | None = None
) -> tuple[Any, list[str]]:
    """The components' weights of the pipeline folder ``path`` as one checkpoint, and the no-split classes its plan
    uses: ``no_split`` when given, else each component of at most ``limit`` bytes whole (:func:`component_no_split`)."""
    from offload_core.loading.pipeline_checkpoint import PipelineCheckpoint

    classes = list(no_split) if no_split else component_no_split(empty, limit, empty.dtype)
    checkpoint = PipelineCheckpoint.open_components(Path(path).expanduser(), list(empty.modules._modules))
    return checkpoint, classes


def finish_dispatch(empty: EmptyPipeline, device: torch.device) -> Any:
    """After the components are dispatched: their entries run the module hooks; the pipeline, ready, is returned."""
    entries = attach_entries(empty, device)
    empty.modules.offload_state.extra_handles.append(entries)
    return empty.pipeline


def pipeline_from_pretrained(
    path: str | Path,
    max_memory: Mapping[Any, int | str] | int | float | str | None,
    placement: str | Any,
    storage: str | Any,
    policy: str | Any,
    offload_folder: str | Path | None,
    dtype: torch.dtype | str | None,
    *,
    device_map: Mapping[str, int | str] | None = None,
    execution_device: torch.device | str | None = None,
    progress: bool = False,
    page_cache: int | str | None = defaults.PAGE_CACHE,
    no_split_module_classes: list[str] | None = None,
    headroom: int | str | None = "auto",
    plan_call: Mapping[str, Any] | None = None,
    over_budget: str = "warn",
) -> Any:
    """The diffusers pipeline of ``path``, its components planned in one device map within ``max_memory`` and
    dispatched (see :func:`offload_core.loading.pretrained.from_pretrained`); ``pipeline.offload_state`` as a
    model's. ``headroom`` ``"auto"``: the activations of ``plan_call`` (the pipeline call's keyword arguments;
    default: one image of the pipeline's default size), traced on the empty pipeline, and the runtime's slack are
    held back from the execution device's budget (a size: that)."""
    from offload_core.loading.dispatch import default_execution_device, resolve_strategy
    from offload_core.loading.pipeline_memory import default_call, pipeline_headroom
    from offload_core.plan.request import PlanRequest
    from offload_core.loading.pretrained import plan_and_dispatch
    from offload_core.planning import get_max_memory
    from offload_core.planning.budgets import read_max_memory
    from offload_core.planning.headroom import less_headroom, read_headroom
    from offload_core.values import device_key, parse_dtype

    device = torch.device(execution_device) if execution_device is not None else default_execution_device()
    max_memory = read_max_memory(max_memory, device)
    budgets = get_max_memory(max_memory)
    empty = build_empty_pipeline(path, parse_dtype(dtype))
    held = read_headroom(headroom)
    if held is None:
        call = {**default_call(), **(plan_call or {})}
        held = pipeline_headroom(empty, call, budgets.get(device_key(device)), device)
    limit = whole_limit(less_headroom(budgets, held, device), device, resolve_strategy("policy", policy))
    checkpoint, no_split = open_components(empty, path, limit, no_split_module_classes)
    request = PlanRequest(
        execution_device=device,
        no_split=no_split,
        dtype=empty.dtype,
        max_memory=max_memory,
        placement=placement,
        storage=storage,
        policy=policy,
        page_cache=page_cache,
        headroom=held,
        generation=None,
        device_map=device_map,
        offload_folder=offload_folder,
        progress=progress,
        over_budget=over_budget,
    )
    plan_and_dispatch(empty.modules, checkpoint, request)
    return finish_dispatch(empty, device)
