"""One call from a local checkpoint folder to a ready, offloaded model of the right class: ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn


def from_pretrained(
    path: str | Path,
    max_memory: Mapping[Any, int | str] | None = None,
    placement: str | Any = "sequential",
    storage: str | Any = "memmap",
    policy: str | Any = "align_per_call",
    offload_folder: str | Path | None = None,
    dtype: torch.dtype | str | None = None,
    task: str | None = None,
    *,
    device_map: Mapping[str, int | str] | None = None,
    execution_device: torch.device | str | None = None,
    no_split_module_classes: list[str] | None = None,
    progress: bool = False,
    page_cache: int | str | None = None,
) -> nn.Module:
    """Build the ``task`` model of the checkpoint folder ``path`` (default: what ``config.architectures`` names),
    plan where each weight lives within ``max_memory`` and load it, ready to call: the model has
    ``hf_device_map`` (as transformers sets it) and ``offload_state``.

    ``placement``, ``storage`` and ``policy`` are plugin names or built strategies; ``device_map`` (a dict)
    replaces the placement. The placement holds back what the policy's units in flight need, by the same
    rule as ``run.py``. ``dtype`` None runs in the checkpoint's dtype; ``execution_device`` defaults to
    ``cuda:0`` when present, else ``cpu``. ``model.offload_state.remove()`` undoes the offloading.

    ``page_cache``, as ``run.py``'s: a set of the offloaded blocks stays in the page cache across calls and the
    rest is streamed, each dropped once it has run (``"auto"``: the memory available less the cpu budget and a
    margin; a size such as ``"8GiB"``; ``0`` streams every block). None (or ``"lru"``) leaves what stays to the
    kernel's cache. The kept set's figures are in ``model.offload_state.handle.counters()``.
    """
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.dispatch import _resolve, load_checkpoint_and_dispatch
    from offload_core.loading.execution_device import resolve_execution_device
    from offload_core.loading.reserve import reserve_for
    from offload_core.loading.tasks import build_empty, check_task_fits, config_dtype, infer_task, read_config
    from offload_core.planning import PlacementRequest, get_max_memory
    from offload_core.values import parse_dtype

    config = read_config(path, what="path")
    given = task is not None
    task = task or infer_task(config)
    dtype = parse_dtype(dtype) or config_dtype(config)
    model = build_empty(config, task, dtype, what="task")
    device = resolve_execution_device(execution_device, device_map if isinstance(device_map, Mapping) else None)
    no_split = list(no_split_module_classes or getattr(model, "_no_split_modules", None) or [])
    storage, policy = _resolve("storage", storage), _resolve("policy", policy)
    checkpoint = Checkpoint.open(path)  # stays open while the model's store reads it
    try:
        if given:
            check_task_fits(model, checkpoint, task, what="task")
        budgets = get_max_memory(max_memory) if device_map is None or page_cache is not None else {}
        if device_map is None:
            reserve = reserve_for(model, checkpoint, policy, storage, device, no_split, dtype, budgets.get("cpu"))
            request = PlacementRequest(model=model, max_memory=budgets, no_split_module_classes=no_split,
                                       dtype=dtype, reserve=reserve)
            device_map = _resolve("placement", "balanced" if placement == "auto" else placement).make_device_map(request)
        residency = None if page_cache is None else _kept_set(model, device_map, page_cache, policy, device, no_split,
                                                              dtype, budgets)
        return load_checkpoint_and_dispatch(model, checkpoint, device_map, no_split_module_classes=no_split,
                                            offload_folder=offload_folder, dtype=dtype, storage=storage, policy=policy,
                                            execution_device=device, progress=progress,
                                            offload_buffers=policy.offload_buffers, residency=residency)
    except BaseException:
        checkpoint.close()
        raise


def _kept_set(model: nn.Module, device_map: Mapping[str, int | str], page_cache: int | str, policy: Any,
              device: torch.device, no_split: list[str], dtype: torch.dtype | None, budgets: dict) -> Any:
    """The kept set ``page_cache`` asks for (:func:`offload_core.storage.residency.page_cache_plan`, as a run plans
    it), or None where it keeps none."""
    from offload_core.planning import largest_block_size, normalize_device_map, summarize_device_map
    from offload_core.storage.residency import make_residency, page_cache_plan

    summary = summarize_device_map(model, normalize_device_map(dict(device_map)), budgets, dtype=dtype)
    plan = page_cache_plan(page_cache, summary, device, policy.keeps_page_cache, budgets.get("cpu", 0),
                           largest_block_size(model, no_split, dtype=dtype))
    return make_residency(plan)
