"""The memory a generating run needs beside its weights, planned the same way for every run (a single prompt is a
batch of one): its KV cache and activations held back from the execution device's budget, and a run that cannot fit
its context or its budget refused before anything is loaded, naming the largest ``max_new_tokens`` (or batch) that
fits."""

from __future__ import annotations

import dataclasses
from typing import Any

from offload_core.errors import ConfigError
from offload_core.planning.batch_memory import BatchMemory, batch_memory, largest_batch
from offload_core.planning.headroom import FORWARD_HEADROOM, check_headroom, runtime_slack
from offload_core.runner.settings import Settings
from offload_core.values import format_size


def forward_headroom(settings: Settings) -> Settings:
    """``settings`` of a run that does not generate, with ``headroom=auto`` resolved to :data:`FORWARD_HEADROOM`."""
    if settings.headroom is not None:
        return settings
    check_headroom(settings.max_memory, FORWARD_HEADROOM, settings.execution_device)
    return dataclasses.replace(settings, headroom=FORWARD_HEADROOM)


def context_length(config: Any) -> int | None:
    """The positions a decoder-only model was made for (``max_position_embeddings`` or ``n_positions``); None when
    its config names none or it is an encoder-decoder (whose prompt goes to the encoder)."""
    if getattr(config, "is_encoder_decoder", False):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(config: Any, prompt_tokens: int, new_tokens: int, what: str) -> None:
    """``prompt_tokens + new_tokens`` within the model's context, else one line naming the largest max_new_tokens."""
    context = context_length(config)
    if context is None or prompt_tokens + new_tokens <= context:
        return
    room = context - prompt_tokens
    advice = f"use max_new_tokens={room} or less" if room > 0 else "shorten the prompt"
    raise ConfigError(
        f"{what} ({prompt_tokens} tokens) and max_new_tokens={new_tokens} exceed the model's context of "
        f"{context} tokens (max_position_embeddings); {advice}"
    )


def largest_new_tokens(config: Any, budget: int, prompt_tokens: int, dtype: Any, upto: int) -> int:
    """The largest ``max_new_tokens`` (at most ``upto``) whose memory for one sequence fits ``budget``; 0 when none."""
    low, high = 0, upto
    while low < high:
        mid = (low + high + 1) // 2
        if batch_memory(config, 1, prompt_tokens, mid, dtype).total <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def plan_run_memory(
    settings: Settings, run_model: Any, rows: int, longest: int, prefill_rows: int | None = None
) -> tuple[Settings, BatchMemory]:
    """``settings`` with the memory of ``rows`` sequences of ``longest`` prompt tokens plus ``max_new_tokens`` held
    back from the execution device's budget (on a CPU run as the ``headroom``, unless the user gave one); a run past
    the model's context, or whose memory does not fit beside one block, is a :class:`ConfigError` naming what fits.
    ``prefill_rows``: how many of them prefill at once (default all)."""
    from offload_core.planning import largest_block_size

    config, dtype, new = run_model.model.config, run_model.dtype, settings.sampling.max_new_tokens
    check_context(config, longest, new, "the longest prompt" if settings.prompts_file else "the prompt")
    need = batch_memory(config, rows, longest, new, dtype, prefill_rows)
    device = settings.execution_device
    key = "cpu" if device.type == "cpu" else device.index
    given = settings.headroom
    if key == "cpu" and given is not None:  # the user's headroom, checked when read
        return settings, need
    budget = settings.max_memory.get(key)
    if budget is not None and settings.graphs:  # the graph's pool: one decoding step's activations, kept
        from offload_core.module_hooks.graphs import graph_pool_bytes

        budget -= graph_pool_bytes(config, rows, dtype, longest + new)
    slack = runtime_slack(budget, gpu=key != "cpu")
    if budget is None:
        return dataclasses.replace(settings, headroom=need.total + slack if key == "cpu" else 0), need
    # A GPU computes each block in its own memory: the budget holds one beside the KV cache. A CPU run computes
    # offloaded blocks where the store maps or reads them (the reservation for units in flight is planned apart).
    block = largest_block_size(run_model.model, run_model.no_split, dtype=dtype) if key != "cpu" else 0
    room = budget - block - slack
    if need.total > room:
        name = "cpu" if key == "cpu" else str(key)
        where = f"more than max_memory.{name}={format_size(budget)} leaves beside " + (
            "one block" if block else f"{format_size(slack)} for the runtime"
        )
        if rows > 1:
            fits = largest_batch(config, room, longest, new, dtype, rows)
            advice = (
                f"use batch_size={fits} or less" if fits else "no batch fits: shorten the prompts or max_new_tokens"
            )
            raise ConfigError(
                f"batch_size={rows} needs {format_size(need.total)} for its KV cache and activations, {where}; "
                f"{advice}, or raise max_memory.{name}"
            )
        fits = largest_new_tokens(config, room, longest, dtype, new)
        advice = f"use max_new_tokens={fits} or less" if fits else "no max_new_tokens fits: shorten the prompt"
        raise ConfigError(
            f"max_new_tokens={new} after a prompt of {longest} tokens needs {format_size(need.total)} for "
            f"the KV cache and activations, {where}; {advice}, or raise max_memory.{name}"
        )
    if key == "cpu":
        return dataclasses.replace(settings, headroom=need.total + slack), need
    budgets = dict(settings.max_memory)
    budgets[key] = budget - need.total - slack
    return dataclasses.replace(settings, max_memory=budgets, headroom=given or 0), need
