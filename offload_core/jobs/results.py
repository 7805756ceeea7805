"""What a run measured while it generated, and how it reports it: RunResult, metrics.json and the printed summary."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from offload_core import devices
from offload_core.values import format_size


@dataclass
class RunResult:
    """What :func:`offload_core.runner.job.run` returns (and writes as ``metrics.json`` / ``device_map.json``):
    ``figures`` are the run's measurements, ``summary`` the plan's bytes per device, ``plan`` its figures."""

    text: str
    token_ids: list[int]
    device_map: dict[str, Any]
    figures: dict[str, Any]
    summary: dict[str, Any]
    matches_in_memory: bool | None = None
    output_dir: Path | None = None
    plan: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_plan(
        cls, plan: Any, output_dir: Path, figures: dict[str, Any], text: str = "", token_ids: list[int] | None = None
    ) -> "RunResult":
        """The result of a run of ``plan`` (:class:`offload_core.plan.make.Plan`): its device map, summary and
        figures beside what the run made."""
        return cls(
            text=text,
            token_ids=list(token_ids or []),
            device_map=plan.device_map,
            figures=figures,
            summary=plan.summary,
            output_dir=output_dir,
            plan=plan.as_dict(),
        )


def per_token_counters(counters: dict[str, int | float], tokens: int) -> dict[str, int | float]:
    """A policy's counters as reported: a time (a name ending in ``_s``) per generated token, counts as they are."""
    return {
        (f"{name}_per_token" if name.endswith("_s") else name): (
            value / max(tokens, 1) if name.endswith("_s") else value
        )
        for name, value in counters.items()
    }


def generation_figures(state: Any, tokens: list[int], timer: Any, load_s: float, policy_name: str) -> dict[str, Any]:
    """The figures of one generation on a dispatched model (``state`` is its ``offload_state``)."""
    moved = state.stats.snapshot()
    count = max(len(tokens), 1)
    figures: dict[str, Any] = {
        "load_s": load_s,
        "time_to_first_token_s": timer.time_to_first_token,
        "decode_tokens_per_s": timer.decode_tokens_per_s,
        "generated_tokens": len(tokens),
        "bytes_moved_per_token": moved["bytes"] / count,
        "transfers_per_token": moved["loads"] / count,
        "offloaded_bytes": state.offloaded_bytes(),
        "store_bytes_written": state.store.bytes_written if state.store is not None else 0,
        "store_reused": bool(state.store is not None and state.store.reused),
    }
    if devices.is_accelerator(state.execution_device):
        accelerator = devices.active()
        figures["peak_gpu_bytes"] = {str(i): accelerator.max_memory_allocated(i) for i in range(accelerator.count())}
    counters = state.handle.counters()
    if counters:
        figures[policy_name] = per_token_counters(counters, len(tokens))
    return figures


def write_outputs(result: RunResult, prompt: Any, labels: dict) -> None:
    """Write ``device_map.json`` and ``metrics.json`` (labels, prompt, text, tokens, figures, devices)."""
    out = result.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_map.json").write_text(json.dumps(result.device_map, indent=1))
    payload = {
        **labels,
        "prompt": prompt,
        "text": result.text,
        "token_ids": result.token_ids,
        "matches_in_memory": result.matches_in_memory,
        **result.figures,
        "devices": result.summary["devices"],
    }
    (out / "metrics.json").write_text(json.dumps(payload, indent=1, default=str))


def counter_text(name: str, value: Any) -> str:
    """A policy counter as printed: sizes (a name holding ``bytes``) as MiB, GiB…, other fractions to three places."""
    if "bytes" in name and isinstance(value, (int, float)) and value == value:
        return format_size(int(value))
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def print_result(result: RunResult, policy_name: str) -> None:
    """Print the generated text, the figures, the policy's counters and where the outputs went."""
    f = result.figures
    print(f"\n{result.text}\n")
    print(
        f"load {f['load_s']:.2f} s | first token {f['time_to_first_token_s']:.3f} s | "
        f"decode {f['decode_tokens_per_s']:.1f} tok/s | peak anon RSS +{format_size(f['peak_anon_rss_bytes'])} | "
        f"file-backed RSS +{format_size(f['peak_file_rss_bytes'])} | moved "
        f"{format_size(int(f['bytes_moved_per_token']))}/token"
    )
    counters = f.get(policy_name)
    if counters:
        shown = ", ".join(f"{name} {counter_text(name, value)}" for name, value in counters.items())
        print(f"{policy_name}: {shown}")
    from offload_core.plan.speculate import result_line

    line = result_line(f)
    if line:
        print(line)
    if result.matches_in_memory is not None:
        print(f"same tokens as in memory: {result.matches_in_memory}")
    print(f"wrote {result.output_dir / 'metrics.json'} and device_map.json")
