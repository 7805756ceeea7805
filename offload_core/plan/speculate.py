"""A run's speculative decoding, around the shared runner steps: the option checked against the batches, the
draft's bytes and KV cache held back from the budget before the target is placed, the self draft's layers checked
resident, the plan's estimate, the in-memory comparisons and the printed figures."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from offload_core.errors import ConfigError
from offload_core.speculative import SpeculativeConfig
from offload_core.speculative.config import expected_tokens_per_pass
from offload_core.values import format_size


def check_batches(spec: SpeculativeConfig, batches: Any) -> None:
    """transformers' assisted generation checks one sequence at a time: a prompts run with speculation is refused."""
    if spec.active and batches is not None:
        raise ConfigError(
            f"speculative={spec.name} generates one prompt at a time (transformers' assisted generation takes "
            "batch 1): give prompt=... instead of prompts=..., or set speculative=none"
        )


def reserve_speculation(settings: Any, spec: SpeculativeConfig, run_model: Any, prompt_tokens: int) -> tuple[Any, dict]:
    """``settings`` with the draft's resident bytes taken from the execution device's budget before the target is
    placed, and those bytes (:func:`offload_core.speculative.drafts.hold_speculation`, the rule of every door)."""
    from offload_core.planning.generation import Generation
    from offload_core.speculative.drafts import hold_speculation

    generation = Generation(settings.sampling.max_new_tokens, 1, prompt_tokens)
    max_memory, held = hold_speculation(
        spec, run_model.model, run_model.dtype, settings.budget_key, settings.max_memory, settings.headroom, generation
    )
    return dataclasses.replace(settings, max_memory=max_memory), held


def check_self_resident(
    spec: SpeculativeConfig, run_model: Any, device_map: dict, device: torch.device, placement: str | None = None
) -> None:
    """A self draft runs the target's first layers, norm and head between passes: they must not be streamed. The
    remedy names only what would change the plan: another placement where the run's (``placement``; None: a
    ``device_map`` file made it) is not sequential, the file where one made it."""
    if spec.name != "self":
        return
    from offload_core.speculative.drafts import check_self_resident as check

    remedies = ["raise max_memory", "lower speculative.layers"]
    if placement is None:
        remedies.append("keep them on the execution device in the device_map file")
    elif placement != "sequential":
        remedies.append("use placement=sequential")
    check(
        run_model.model,
        spec.layers,
        device_map,
        device,
        "speculative=self",
        ", ".join(remedies) + ", or set speculative=prompt_lookup",
    )


def plan_lines(spec: SpeculativeConfig, held: dict, predicted: dict) -> list[str]:
    """The plan's speculation lines: what the draft holds resident and the estimated time per token."""
    if not spec.active:
        return []
    lines = []
    if held:
        lines.append(
            f"  speculative={spec.name}: resident beside the target {format_size(held['weights'])} of weights and "
            f"{format_size(held['kv_cache'])} of KV cache (taken from the budget before placing the target)"
        )
    if "predicted_tokens_per_pass" in predicted:
        lines.append(
            f"  speculative={spec.name} (estimate, assuming acceptance {spec.expected_acceptance:.2f} of "
            f"{spec.tokens} drafted): {predicted['predicted_tokens_per_pass']:.2f} tokens per pass, "
            f"{predicted['predicted_s_per_token']:.3f} s per token (draft compute not counted)"
        )
    return lines


def predicted(spec: SpeculativeConfig, times: dict[str, float]) -> dict[str, float]:
    """The plan's step prediction divided by the expected tokens per pass (an estimate: the acceptance is assumed)."""
    if not spec.active or "predicted_step_s" not in times:
        return {}
    per_pass = expected_tokens_per_pass(spec)
    return {"predicted_tokens_per_pass": per_pass, "predicted_s_per_token": times["predicted_step_s"] / per_pass}


def compare(figures: dict, spec: SpeculativeConfig, tokens: list[int], reference: Any) -> None:
    """With speculation: the in-memory model running the same speculation (``reference(spec, decisions)``: the
    drafts the run checked, checked again) must give the same tokens bit for bit; against plain greedy decoding
    (``figures['in_memory_tokens']``) the differing positions are counted (a several-token pass may round
    differently from one-token steps)."""
    if not spec.active:
        return
    same = reference(spec, figures.get("draft_decisions"))
    plain = figures["in_memory_tokens"]
    figures["in_memory_speculative_tokens"] = same
    figures["matches_in_memory_speculative"] = same == tokens
    figures["tokens_differing_from_plain"] = sum(a != b for a, b in zip(tokens, plain)) + abs(len(tokens) - len(plain))


def per_generated_token(figures: dict) -> dict:
    """Disk bytes per generated token (``disk_read_bytes_per_token`` is per forward pass, several tokens apart with
    speculation)."""
    reads = figures.get("disk_read_bytes_by_token")
    if not reads or not figures.get("generated_tokens"):
        return {}
    return {"disk_read_bytes_per_generated_token": sum(reads) / figures["generated_tokens"]}


def result_line(figures: dict) -> str | None:
    """The printed speculation figures, or None without speculation."""
    if figures.get("speculative", "none") == "none":
        return None
    rate = figures["acceptance_rate"]
    line = (
        f"speculative={figures['speculative']}: {figures['tokens_per_pass']:.2f} tokens per pass "
        f"({figures['target_passes']} passes), acceptance {rate if math.isnan(rate) else round(rate, 3)} "
        f"({figures['accepted_tokens']} of {figures['drafted_tokens']} drafted)"
    )
    if "matches_in_memory_speculative" in figures:
        line += (
            f" | same tokens as in memory with the same speculation: {figures['matches_in_memory_speculative']}, "
            f"{figures['tokens_differing_from_plain']} differ from plain greedy"
        )
    return line
