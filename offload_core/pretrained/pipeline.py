"""``from_pretrained`` for a diffusers pipeline folder: one plan over every module component, one store, one policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from offload_core import defaults
from offload_core.loading.dispatch import default_execution_device, resolve_strategy
from offload_core.loading.pipeline import build_empty_pipeline
from offload_core.loading.pipeline_load import finish_dispatch, open_components
from offload_core.loading.pipeline_memory import default_call, pipeline_headroom
from offload_core.options import Offload
from offload_core.plan.request import PlanRequest, plan_and_dispatch
from offload_core.plan.reserve import whole_limit
from offload_core.planning import get_max_memory
from offload_core.planning.budgets import check_over_budget, read_max_memory
from offload_core.planning.headroom import less_headroom, read_headroom
from offload_core.values import device_key, parse_dtype


def pipeline_from_pretrained(
    path: str | Path,
    max_memory: Mapping[Any, int | str] | int | float | str | None,
    offload: Offload,
    dtype: torch.dtype | str | None,
    plan_call: Mapping[str, Any] | None = None,
) -> Any:
    """The diffusers pipeline of ``path``, its components planned in one device map within ``max_memory`` as
    ``offload`` says and dispatched (see :func:`offload_core.from_pretrained`);
    ``pipeline.offload_state`` as a model's. ``offload.headroom`` ``"auto"``: the activations of ``plan_call`` (the
    pipeline call's keyword arguments; default: one image of the pipeline's default size), traced on the empty
    pipeline, and the runtime's slack are held back from the execution device's budget (a size: that)."""
    policy = offload.policy or defaults.POLICY
    device = (
        torch.device(offload.execution_device) if offload.execution_device is not None else default_execution_device()
    )
    max_memory = read_max_memory(max_memory, device)
    budgets = get_max_memory(max_memory)
    empty = build_empty_pipeline(path, parse_dtype(dtype))
    held = read_headroom(offload.headroom)
    if held is None:
        call = {**default_call(), **(plan_call or {})}
        held = pipeline_headroom(empty, call, budgets.get(device_key(device)), device)
    limit = whole_limit(less_headroom(budgets, held, device), device, resolve_strategy("policy", policy))
    checkpoint, no_split = open_components(empty, path, limit, offload.no_split_module_classes)
    request = PlanRequest(
        execution_device=device,
        no_split=no_split,
        dtype=empty.dtype,
        max_memory=max_memory,
        placement=offload.placement,
        storage=offload.storage,
        policy=policy,
        page_cache=offload.page_cache,
        headroom=held,
        generation=None,
        device_map=offload.device_map,
        offload_folder=offload.offload_folder,
        progress=offload.progress,
        over_budget=check_over_budget(offload.over_budget),
    )
    plan_and_dispatch(empty.modules, checkpoint, request)
    return finish_dispatch(empty, device)
