"""How well the time prediction plans: predicted against measured load, first token and decoding step over a sweep of
models x budgets x batch sizes x stores x policies, each configuration run twice in fresh processes (``run.py``): the
first run is predicted by the cost model alone (a fresh corrections file), the second with the correction the first
left. Per cell (model, budget, batch) it also asks ``auto=true plan_only=true`` for its pick and checks it against the
measured fastest of the same candidates. Writes ``bench/results/predict-sweep-<tag>.csv``, ``.md`` and ``.png``.

    python bench/predict_sweep.py --tag full                      # SmolLM2 and synthetic 0.3b, every policy, 2 stores,
                                                                  # budgets 30% and 60% of the model, batch 1 and 4
    python bench/predict_sweep.py --tag smoke --models synthetic:small --policies align_per_call,prefetch \\
        --stores memmap --budgets 0.5 --batches 1 --tokens 4      # a minute: that the script works
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIGURES = {
    "load": ("load_s", "predicted_load_s"),
    "ttft": ("time_to_first_token_s", "predicted_ttft_s"),
    "step": ("time_per_decode_step_s", "predicted_step_s"),
}
POLICIES = "align_per_call,functional_call,chained,prefetch"
COLUMNS = [
    "model",
    "budget",
    "batch",
    "storage",
    "hook",
    "run",
    "status",
    "prediction_runs",
    *[c for name in FIGURES for c in (FIGURES[name][0], FIGURES[name][1], f"{name}_error")],
    "total_s",
    "error",
]


def model_args(spec: str) -> list[str]:
    """``smollm2``, ``synthetic:<preset>`` or ``local:<checkpoint folder>`` (the MoE preset bench/moe.py builds)
    as run.py options."""
    if spec == "smollm2":
        return ["model=smollm2"]
    kind, _, preset = spec.partition(":")
    if kind == "local":
        from offload_core.runner.inputs import TOKENIZER_FILES

        # bench/moe.py's folders hold no tokenizer: their prompt is read one id per byte, as a synthetic model's
        own = any((Path(preset) / name).is_file() for name in TOKENIZER_FILES)
        return ["model=local", f"model.path={preset}", *([] if own else ["model.tokenizer=bytes"])]
    return [f"model={kind}", f"model.preset={preset or 'tiny'}"]


def run_py(args: list[str], folder: Path, env: dict[str, str], timeout: int) -> dict:
    """``run.py args`` in a fresh process writing into ``folder``: its metrics.json (an ``error`` when it failed)."""
    proc = subprocess.run(
        [sys.executable, "run.py", "progress=false", f"hydra.run.dir={folder}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    metrics = folder / "metrics.json"
    if proc.returncode != 0 or not metrics.exists():
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(metrics.read_text())


def model_bytes(spec: str, env: dict[str, str], work: Path, timeout: int) -> int:
    """The model's bytes, from a plan-only run with room for all of it."""
    found = run_py(
        [*model_args(spec), "plan_only=true", "max_memory.cpu=1TB"],
        work / f"size-{spec.replace(':', '-').replace('/', '-')}",
        env,
        timeout,
    )
    if "error" in found:
        raise SystemExit(f"{spec}: {found['error']}")
    return sum(info["bytes"] for info in found["devices"].values())


def total_s(row: dict, tokens: int) -> float | None:
    """The run's time as auto ranks it (one batch): load, first token and the other steps."""
    values = [row.get(FIGURES[n][0]) for n in ("load", "ttft", "step")]
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in values):
        return None
    return values[0] + values[1] + (tokens - 1) * values[2]


def sweep(args: argparse.Namespace, env: dict[str, str], work: Path) -> tuple[list[dict], list[dict]]:
    rows, picks = [], []
    for spec in args.models.split(","):
        size = model_bytes(spec, env, work, args.timeout)
        for fraction in [float(b) for b in args.budgets.split(",")]:
            budget = f"max_memory.cpu={int(size * fraction)}"
            for batch in [int(b) for b in args.batches.split(",")]:
                prompts = work / f"prompts-{batch}.txt"
                prompts.write_text("".join(f"Tell me about the number {i}.\n" for i in range(batch)))
                common = [
                    *model_args(spec),
                    budget,
                    f"prompts={prompts}",
                    f"batch_size={batch}",
                    f"max_new_tokens={args.tokens}",
                    "page_cache=auto",
                ]
                cell = {"model": spec, "budget": fraction, "batch": batch}
                configs = [(s, h) for s in args.stores.split(",") for h in args.policies.split(",")]
                for run in (1, 2):  # every configuration once, then each again with its correction
                    for storage, hook in configs:
                        folder = work / f"{len(rows):04d}"
                        found = run_py([*common, f"storage={storage}", f"hook={hook}"], folder, env, args.timeout)
                        row = {
                            **cell,
                            "storage": storage,
                            "hook": hook,
                            "run": run,
                            "status": "error" if "error" in found else "ok",
                            "error": found.get("error", ""),
                            "prediction_runs": found.get("prediction_runs", ""),
                        }
                        for name, (measured, predicted) in FIGURES.items():
                            row[measured], row[predicted] = found.get(measured), found.get(predicted)
                            ok = isinstance(row[measured], (int, float)) and row[measured] > 0 and row[predicted]
                            row[f"{name}_error"] = (row[predicted] - row[measured]) / row[measured] if ok else None
                        row["total_s"] = total_s(row, args.tokens)
                        rows.append(row)
                        print(
                            f"{spec} {fraction} b{batch} {storage} {hook} run {run}: "
                            + (
                                row["error"]
                                or " | ".join(
                                    f"{n} {row[m] or float('nan'):.3g}/{row[p] or float('nan'):.3g}"
                                    for n, (m, p) in FIGURES.items()
                                )
                            ),
                            flush=True,
                        )
                picks.append(auto_pick(cell, common, configs, rows, env, work, args))
    return rows, picks


def auto_pick(
    cell: dict,
    common: list[str],
    configs: list[tuple[str, str]],
    rows: list[dict],
    env: dict[str, str],
    work: Path,
    args: argparse.Namespace,
) -> dict:
    """auto=true's pick among the measured configurations against the fastest measured (second runs: the pick is
    made with the corrections the sweep left, as a user's second plan would be)."""
    folder = work / f"auto-{cell['model'].replace(':', '-')}-{cell['budget']}-{cell['batch']}"
    found = run_py(
        [*common, "plan_only=true", "auto=true", "batch_size=" + str(cell["batch"])], folder, env, args.timeout
    )
    measured = {
        (r["storage"], r["hook"]): r["total_s"]
        for r in rows
        if all(r[k] == cell[k] for k in cell) and r["run"] == 2 and r["total_s"]
    }
    pick = None
    if "error" not in found and (folder / "auto.json").exists():
        for entry in json.loads((folder / "auto.json").read_text()):
            words = dict(w.split("=", 1) for w in entry["configuration"].split())
            key = (words["storage"], words["hook"])
            default_depth = words.get("hook.depth", "2") == "2"
            if key in measured and not entry["problem"] and words.get("page_cache") == "auto" and default_depth:
                pick = key
                break
    fastest = min(measured, key=measured.get) if measured else None
    ratio = measured[pick] / measured[fastest] if pick and fastest else None
    return {
        **cell,
        "auto_pick": " ".join(pick) if pick else found.get("error", "none"),
        "measured_fastest": " ".join(fastest) if fastest else "none",
        "pick_over_fastest": ratio,
    }


def summary_lines(rows: list[dict], picks: list[dict]) -> list[str]:
    lines = []
    for run in (1, 2):
        for name in FIGURES:
            errors = [abs(r[f"{name}_error"]) for r in rows if r["run"] == run and r[f"{name}_error"] is not None]
            if errors:
                lines.append(
                    f"- run {run} {name}: median |error| {100 * statistics.median(errors):.0f}%, worst "
                    f"{100 * max(errors):.0f}% over {len(errors)} runs"
                )
    within = [p for p in picks if p["pick_over_fastest"] is not None]
    if within:
        good = sum(p["pick_over_fastest"] <= 1.10 for p in within)
        lines.append(f"- auto's pick within 10% of the measured fastest: {good} of {len(within)} cells")
    return lines


def write(rows: list[dict], picks: list[dict], out: Path, header: list[str]) -> None:
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    def fmt(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v if v is not None else "")

    md = [
        *header,
        "",
        "## Errors ((predicted - measured) / measured)",
        "",
        *summary_lines(rows, picks),
        "",
        "## Runs",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    md += ["| " + " | ".join(fmt(r.get(c)).replace("|", "/") for c in COLUMNS) + " |" for r in rows]
    md += [
        "",
        "## auto=true against the measured fastest (second runs)",
        "",
        "| model | budget | batch | auto's pick | measured fastest | pick / fastest |",
        "|---|---|---|---|---|---|",
    ]
    md += [
        f"| {p['model']} | {p['budget']} | {p['batch']} | {p['auto_pick']} | {p['measured_fastest']} | "
        f"{fmt(p['pick_over_fastest'])} |"
        for p in picks
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (name, (measured, predicted)) in zip(axes, FIGURES.items()):
        for run, marker in ((1, "o"), (2, "x")):
            pts = [(r[measured], r[predicted]) for r in rows if r["run"] == run and r[f"{name}_error"] is not None]
            if pts:
                ax.scatter(
                    *zip(*pts), marker=marker, label=f"run {run}" + (" (cost model)" if run == 1 else " (corrected)")
                )
        values = [v for r in rows for v in (r[measured], r[predicted]) if isinstance(v, (int, float)) and v > 0]
        if values:
            low, high = min(values) * 0.8, max(values) * 1.25
            ax.plot([low, high], [low, high], "k--", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"measured {measured} (s)")
        ax.set_ylabel("predicted (s)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--tag", default="full")
    parser.add_argument(
        "--models", default="smollm2,synthetic:0.3b", help="smollm2, synthetic:<preset> and/or local:<folder>"
    )
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--stores", default="memmap,safetensors")
    parser.add_argument("--budgets", default="0.3,0.6", help="max_memory.cpu as fractions of the model's bytes")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument(
        "--keep-calibration", action="store_true", help="use the machine's calibration.json instead of a fresh one"
    )
    parser.add_argument("--note", default="", help="a line for the report (the machine's state)")
    parser.add_argument("--out", default=str(HERE / "results"), help="the folder the report goes to")
    args = parser.parse_args()
    out = Path(args.out) / f"predict-sweep-{args.tag}"
    with tempfile.TemporaryDirectory(prefix="predict-sweep-") as tmp:
        work = Path(tmp)
        # a fresh corrections file: first runs are the cost model's alone; and unless told to keep the machine's,
        # a fresh calibration, measured by the sweep's first run of each model as on a new machine (one measured
        # another day, under another load, is no measure of the cost model)
        env = {**os.environ, "OFFLOAD_CORE_CORRECTIONS": str(work / "corrections.json")}
        if not args.keep_calibration:
            env["OFFLOAD_CORE_CALIBRATION"] = str(work / "calibration.json")
        started = time.time()
        rows, picks = sweep(args, env, work)
    header = [
        f"# Predicted against measured: {args.tag}",
        "",
        f"`python bench/predict_sweep.py {shlex.join(sys.argv[1:])}` ({time.time() - started:.0f} s, "
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')})",
    ] + (["", args.note] if args.note else [])
    write(rows, picks, out, header)
    print("\n".join(summary_lines(rows, picks)))
    print(f"wrote {out}.csv, .md and .png")


if __name__ == "__main__":
    main()
