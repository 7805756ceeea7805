"""What the plan chooses for the main job's GGUF (``python bench/gguf_main_job.py --plan``): the converted float32
default, ``storage=gguf`` and ``auto=true``, run in turn on a warm page cache and on a cold one (``page_cache=0``,
half the model offloaded); decode speeds, their ratios in each round, what ``auto=true`` picked, and the cost model's
the cost model's predicted step and first token beside the measured ones (medians of the rounds), and each GGUF choice
``auto=true`` weighed. Written to bench/results/gguf-plan.{json,md}."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "converted float32 (default)": [],
    "storage=gguf": ["storage=gguf"],
    "storage=gguf hook=prefetch": ["storage=gguf", "hook=prefetch"],
    "storage=gguf storage.resident=quantized": ["storage=gguf", "storage.resident=quantized"],
    "storage=gguf storage.resident=quantized hook=prefetch": [
        "storage=gguf",
        "storage.resident=quantized",
        "hook=prefetch",
    ],
    "auto=true": ["auto=true"],
}
BASE, AUTO, COLD = "converted float32 (default)", "auto=true", "cold (page_cache=0, half offloaded)"
#: the configurations reading the GGUF file (the cold target is met where the fastest of them is)
GGUF = [name for name in CONFIGS if name.startswith("storage=gguf")]
CONDITIONS = {"warm page cache": [], "cold (page_cache=0, half offloaded)": ["page_cache=0", "max_memory.cpu=330MiB"]}


def run(args: list[str], out: Path, env: dict[str, str]) -> dict:
    """One ``python run.py`` process: its metrics, wall time and the load average as it ended; ``{"refused": line}``
    where the run refused its configuration in one line (a plan over the budget)."""
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={out}", *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.startswith("offload_core: error:")]
        if said and "Traceback" not in done.stderr:
            return {"refused": said[0].removeprefix("offload_core: error: ")}
        raise SystemExit(f"{' '.join(args) or 'default'} failed:\n{done.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["process_s"] = time.perf_counter() - start
    metrics["load_average"] = os.getloadavg()[0]
    lines = done.stdout.splitlines()
    why = [line for line in lines if line.startswith(("auto: the", "auto: reading", "auto: holding", "  storage="))]
    # each GGUF choice auto weighed: its rank, predicted step, and what its plan keeps quantized and dequantizes
    choices = [i for i, line in enumerate(lines) if line.startswith("auto: #")]
    shown = [line for i in choices for line in lines[i : i + 4] if line.startswith(("auto: #", "    "))]
    metrics["auto_why"] = why[:3] + shown
    return metrics


def kept(metrics: dict) -> dict:
    """What the report keeps of a run's metrics."""
    names = (
        "decode_tokens_per_s",
        "time_per_decode_step_s",
        "predicted_step_s",
        "model_predicted_step_s",
        "predicted_dequant_s",
        "model_predicted_ttft_s",
        "time_to_first_token_s",
        "predicted_io_s",
        "bytes_moved_per_token",
        "offloaded_bytes",
        "process_s",
        "load_average",
        "auto",
        "auto_why",
    )
    row = {name: metrics.get(name) for name in names}
    row["storage"] = (metrics.get("choices") or {}).get("storage")
    row["token_ids"] = metrics.get("token_ids")
    return row


def compare(
    rounds: int, out_dir: Path, configs: list[str] | None = None, cold_only: bool = False, tag: str = ""
) -> None:
    """Run every configuration (``configs``: those named, the converted default always) of every condition (the cold
    one alone with ``cold_only``) ``rounds`` times, alternated, and write the report (``gguf-plan[-tag]``)."""
    chosen = [name for name in CONFIGS if configs is None or name in configs or name == BASE]
    conditions = {c: extra for c, extra in CONDITIONS.items() if not cold_only or c == COLD}
    results: dict[str, dict[str, list[dict]]] = {c: {name: [] for name in chosen} for c in conditions}
    refused: dict[str, dict[str, str]] = {c: {} for c in conditions}  # a configuration its plan refuses, once
    started_load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            # the calibration and the corrections of this comparison alone, kept however loaded the machine is (so
            # that auto=true measures its candidates once, not once per run)
            "OFFLOAD_CORE_CALIBRATION": str(Path(tmp) / "calibration.json"),
            "OFFLOAD_CORE_CORRECTIONS": str(Path(tmp) / "corrections.json"),
            "OFFLOAD_CORE_BUSY_LOAD": "inf",
        }
        for number in range(rounds):
            for condition, extra in conditions.items():
                names = list(chosen)
                names = names[number % len(names) :] + names[: number % len(names)]  # each goes first in turn
                for name in names:
                    if name in refused[condition]:
                        continue
                    folder = Path(tmp) / f"r{number}-{len(results[condition][name])}-{abs(hash((condition, name)))}"
                    metrics = run([*CONFIGS[name], *extra], folder, env)
                    if "refused" in metrics and name != BASE:
                        refused[condition][name] = metrics["refused"]
                        del results[condition][name]
                        print(f"{condition} | {name}: refused: {metrics['refused']}", flush=True)
                        continue
                    results[condition][name].append(kept(metrics))
                    print(f"{condition} | {name}: {metrics['decode_tokens_per_s']:.2f} tok/s", flush=True)
    summary = summarize(results)
    summary.update({"load_average_start": started_load, "load_average_end": os.getloadavg(), "rounds": rounds})
    summary["refused"] = refused
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "gguf-plan" + (f"-{tag}" if tag else "")
    (out_dir / f"{name}.json").write_text(json.dumps({"results": results, "summary": summary}, indent=2) + "\n")
    text = report(results, summary)
    (out_dir / f"{name}.md").write_text(text)
    print(text)


def summarize(results: dict) -> dict:
    """Per condition: median decode speed of each configuration, the per-round ratios to the converted default and
    their median, what auto picked, and whether every run gave the same tokens."""
    summary: dict = {"conditions": {}}
    for condition, runs in results.items():
        base = runs[BASE]
        entry = {"median_tokens_per_s": {}, "ratio_to_converted": {}, "round_ratios": {}, "same_tokens": True}
        for name, rows in runs.items():
            entry["median_tokens_per_s"][name] = statistics.median(r["decode_tokens_per_s"] for r in rows)
            ratios = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rows, base)]
            entry["round_ratios"][name] = ratios
            entry["ratio_to_converted"][name] = statistics.median(ratios)
            entry["same_tokens"] &= all(r["token_ids"] == base[0]["token_ids"] for r in rows)
        if AUTO in runs:
            entry["auto_picked"] = sorted({r["storage"] for r in runs[AUTO]})
            entry["auto_configuration"] = runs[AUTO][0]["auto"]
            entry["auto_why"] = runs[AUTO][0]["auto_why"]
        summary["conditions"][condition] = entry
    return summary


def _loads(values) -> str:
    return "/".join(f"{value:.1f}" for value in values)


def _run_loads(results: dict) -> list[float]:
    loads = sorted(r["load_average"] for runs in results.values() for rows in runs.values() for r in rows)
    return [loads[0], statistics.median(loads), loads[-1]]


def targets(summary: dict) -> list[str]:
    """The issue's two targets on this machine: cold, the fastest configuration reading the GGUF file at least 1.5x
    the converted float32 default; warm, what auto=true picks within 5% of it (the default itself is unchanged)."""
    lines = []
    if COLD in summary["conditions"]:
        cold = summary["conditions"][COLD]["ratio_to_converted"]
        best = max((name for name in GGUF if name in cold), key=lambda name: cold[name])
        lines.append(
            f"- cold (page_cache=0, half offloaded): the fastest GGUF configuration, {best}, decodes at "
            f"{cold[best]:.2f}x the converted float32 default "
            f"(target 1.5x: {'met' if cold[best] >= 1.5 else 'not met'})"
            + (f"; auto=true at {cold[AUTO]:.2f}x." if AUTO in cold else ".")
        )
    warm = summary["conditions"].get("warm page cache", {}).get("ratio_to_converted", {})
    if AUTO in warm:
        lines.append(
            f"- warm page cache: auto=true at {warm[AUTO]:.2f}x the converted default (target: no more than 5% "
            f"slower: {'met' if warm[AUTO] >= 0.95 else 'not met'}); the default store is still the converted one, "
            "so the default itself runs as before"
            + (f"; storage=gguf at {warm['storage=gguf']:.2f}x." if "storage=gguf" in warm else ".")
        )
    return lines


def _median(rows: list[dict], name: str) -> float | None:
    """The median of a figure over the rounds (None where no run has it)."""
    values = [r[name] for r in rows if r.get(name)]
    return statistics.median(values) if values else None


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(results: dict, summary: dict) -> str:
    lines = [
        "# What the plan chooses for the main job's GGUF: warm and cold page cache",
        "",
        f"{platform.machine()}, {os.cpu_count()} cores, shared (load average over 1/5/15 min "
        f"{_loads(summary['load_average_start'])} at the start, {_loads(summary['load_average_end'])} at the end, "
        f"{_loads(_run_loads(results))} as runs ended: min, median, max); {summary['rounds']} rounds, the "
        "configurations alternated in each (ratios are per round, then their median). "
        "`python bench/gguf_main_job.py --plan` reproduces it.",
        "",
        *targets(summary),
        "",
    ]
    for condition, runs in results.items():
        entry = summary["conditions"][condition]
        lines += [
            f"## {condition}",
            "",
            "| configuration | median decode | ratio to converted (median of rounds) | rounds | predicted step "
            "(cost model, median) | measured step (median) | step error | predicted first token | measured first "
            "token | dequantizing (predicted) | moved / token |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, rows in runs.items():
            last = rows[-1]
            step, measured = _median(rows, "model_predicted_step_s"), _median(rows, "time_per_decode_step_s")
            error = f"{step / measured - 1:+.0%}" if step and measured else "-"
            lines.append(
                f"| {name} | {entry['median_tokens_per_s'][name]:.2f} tok/s | "
                f"{entry['ratio_to_converted'][name]:.2f}x | "
                f"{', '.join(f'{r:.2f}' for r in entry['round_ratios'][name])} | "
                f"{_cell(step, '.3f')} s | {_cell(measured, '.3f')} s | {error} | "
                f"{_cell(_median(rows, 'model_predicted_ttft_s'), '.2f')} s | "
                f"{_cell(_median(rows, 'time_to_first_token_s'), '.2f')} s | "
                f"{_cell(last['predicted_dequant_s'], '.3f')} s | "
                f"{_cell(last['bytes_moved_per_token'] and last['bytes_moved_per_token'] / 2**20, '.1f')} MiB |"
            )
        refused = summary["refused"][condition].items()
        lines += [f"| {name} | refused: {why} | | | | | | | | | |" for name, why in refused]
        if "auto_picked" not in entry:
            lines += ["", f"Same tokens in every run: {entry['same_tokens']}.", ""]
            continue
        lines += [
            "",
            f"auto=true picked storage={', '.join(map(str, entry['auto_picked']))} "
            f"(`{entry['auto_configuration']}`); same tokens in every run: {entry['same_tokens']}.",
            "",
            *[f"    {line}" for line in entry["auto_why"]],
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"
