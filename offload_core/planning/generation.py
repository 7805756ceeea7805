"""The generation a plan holds memory for (:class:`Generation`) and the one rule every door holds it by: its KV cache
and activations taken from the budget of the device that computes, and a generation past the model's context or its
budget refused before anything is loaded, naming the largest ``max_new_tokens`` (or batch) that fits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import defaults
from offload_core.errors import ConfigError
from offload_core.planning.batch_memory import BatchMemory, batch_memory, largest_batch
from offload_core.planning.headroom import runtime_slack
from offload_core.planning.sizing import largest_block_size
from offload_core.values import device_key, format_size


@dataclass(frozen=True)
class Generation:
    """The generation a plan holds the KV cache and activations for: ``batch_size`` sequences of ``prompt_tokens``
    (the longest prompt) plus ``max_new_tokens``; ``prefill_rows`` of them prefill at once (None: all)."""

    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    batch_size: int = defaults.BATCH_SIZE
    prompt_tokens: int = defaults.PROMPT_TOKENS
    prefill_rows: int | None = None


def read_generation(value: Generation | Mapping[str, Any] | None) -> Generation:
    """``value`` as a checked :class:`Generation` (None: the defaults; a dict: its fields); a value that cannot be
    used is one :class:`ConfigError` line."""
    if value is None:
        value = Generation()
    elif isinstance(value, Mapping):
        known = list(Generation.__dataclass_fields__)
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ConfigError(f"generation has unknown key(s) {', '.join(unknown)}: known keys are {', '.join(known)}")
        value = Generation(**value)
    elif not isinstance(value, Generation):
        raise ConfigError(f"generation={value!r} is not a Generation or a dict of its fields (max_new_tokens, ...)")
    for name in ("max_new_tokens", "batch_size", "prompt_tokens"):
        number, least = getattr(value, name), 0 if name == "max_new_tokens" else 1
        if not isinstance(number, int) or isinstance(number, bool) or number < least:
            raise ConfigError(f"generation.{name}={number!r} must be a whole number of at least {least}")
    return value


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


@dataclass(frozen=True)
class Held:
    """What holding a generation made of the budgets: ``max_memory`` (a GPU's less the KV cache, activations and the
    runtime's slack), the ``headroom`` held back from the cpu budget on a CPU run, and the batch's memory."""

    max_memory: dict[Any, int]
    headroom: int
    memory: BatchMemory


def hold_generation(
    model: nn.Module,
    dtype: torch.dtype,
    no_split: list[str],
    device: torch.device,
    max_memory: Mapping[Any, int],
    headroom: int | None,
    generation: Generation,
    what: str = "the prompt",
) -> Held:
    """The budgets with the memory of ``generation`` held back from the execution ``device``'s (on a CPU run as the
    headroom, unless one is given: ``headroom`` None plans it); a generation past the model's context, or whose memory
    does not fit beside one block, is a :class:`ConfigError` naming what fits (``what``: the prompt it is for)."""
    config, new, rows = model.config, generation.max_new_tokens, generation.batch_size
    longest = generation.prompt_tokens
    check_context(config, longest, new, what)
    need = batch_memory(config, rows, longest, new, dtype, generation.prefill_rows)
    key = device_key(device)
    max_memory = dict(max_memory)
    if key == "cpu" and headroom is not None:  # the user's headroom, checked when read
        return Held(max_memory, headroom, need)
    budget = max_memory.get(key)
    slack = runtime_slack(budget, device)
    if budget is None:
        return Held(max_memory, need.total + slack if key == "cpu" else 0, need)
    # A GPU computes each block in its own memory: the budget holds one beside the KV cache. A CPU run computes
    # offloaded blocks where the store maps or reads them (the reservation for units in flight is planned apart).
    block = largest_block_size(model, no_split, dtype=dtype) if key != "cpu" else 0
    room = budget - block - slack
    if need.total > room:
        name = "cpu" if key == "cpu" else str(key)
        where = (
            f"more than max_memory.{name}={format_size(budget)} leaves beside "
            + ("one block and " if block else "")
            + f"{format_size(slack)} for the runtime"
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
        return Held(max_memory, need.total + slack, need)
    max_memory[key] = budget - need.total - slack
    return Held(max_memory, headroom or 0, need)
