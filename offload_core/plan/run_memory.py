"""The memory a generating run needs beside its weights, planned by the rule every door shares
(:func:`offload_core.planning.generation.hold_generation`; a single prompt is a batch of one), and the fixed headroom
of a run that does not generate."""

from __future__ import annotations

import dataclasses
from typing import Any

from offload_core.planning.batch_memory import BatchMemory
from offload_core.planning.generation import Generation, context_length, hold_generation
from offload_core.planning.headroom import FORWARD_HEADROOM, check_headroom
from offload_core.runner.settings import Settings
from offload_core.values import budget_key

__all__ = ["context_length", "forward_headroom", "plan_run_memory"]


def forward_headroom(settings: Settings) -> Settings:
    """``settings`` of a run that does not generate, with ``headroom=auto`` resolved to :data:`FORWARD_HEADROOM`."""
    if settings.headroom is not None:
        return settings
    check_headroom(settings.max_memory, FORWARD_HEADROOM, settings.execution_device)
    return dataclasses.replace(settings, headroom=FORWARD_HEADROOM)


def plan_run_memory(
    settings: Settings, run_model: Any, rows: int, longest: int, prefill_rows: int | None = None
) -> tuple[Settings, BatchMemory]:
    """``settings`` with the memory of ``rows`` sequences of ``longest`` prompt tokens plus ``max_new_tokens`` held
    back from the execution device's budget (:func:`hold_generation`); ``prefill_rows``: how many of them prefill at
    once (default all)."""
    generation = Generation(settings.sampling.max_new_tokens, rows, longest, prefill_rows)
    what = "the longest prompt" if settings.prompts_file else "the prompt"
    budgets, device = dict(settings.max_memory), settings.execution_device
    key = budget_key(device)
    if settings.graphs and device.type != "cpu" and budgets.get(key) is not None:
        from offload_core.module_hooks.graphs import graph_pool_bytes  # the graph's pool: one step's activations, kept

        new = settings.sampling.max_new_tokens
        budgets[key] -= graph_pool_bytes(run_model.model.config, rows, run_model.dtype, longest + new)
    held = hold_generation(
        run_model.model,
        run_model.dtype,
        run_model.no_split,
        device,
        budgets,
        settings.headroom,
        generation,
        what,
    )
    return dataclasses.replace(settings, max_memory=held.max_memory, headroom=held.headroom), held.memory
