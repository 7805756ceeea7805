"""Throughput against batch size: aggregate generated tokens/s of ours (prefetch, each store) and accelerate at several
batches.

Every run is a fresh process (``bench/worker.py``), systems alternate within each batch size, and with
``--cold`` the offloaded files are dropped from the page cache before each token. Writes
``bench/results/batch-<tag>.json``, ``.md`` (medians, ratios, predicted against measured, targets) and ``.png``.

    python bench/batch.py --preset 1.1b --budget 1GB --cold --tokens 4 --reps 1 --batches 1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from compare import checkpoint_for, code_snapshot, machine, median, parse_system, run_one  # noqa: E402

SYSTEMS = ["ours:prefetch:safetensors", "ours:prefetch:memmap", "accelerate"]


def medians(runs: list[dict], systems: list[str], batches: list[int]) -> dict:
    """Per system and batch: median aggregate tokens/s, decode step, predicted step, peak anonymous RSS."""
    table: dict = {}
    for system in systems:
        for batch in batches:
            ok = [r for r in runs if r.get("system") == system and r.get("batch") == batch and "error" not in r]
            table[f"{system}@{batch}"] = {
                "aggregate_tokens_per_s": median([r["aggregate_tokens_per_s"] for r in ok]),
                "step_s": median([r["decode_token_mean_s"] for r in ok]),
                "predicted_step_s": median([r.get("predicted_step_s") for r in ok]),
                "peak_anon_rss_bytes": median([r["peak_anon_rss_bytes"] for r in ok]),
                "planned_batch_bytes": median([r.get("planned_batch_bytes") for r in ok]),
                "runs": len(ok),
            }
    return table


def targets(table: dict, systems: list[str], batches: list[int], budget: int) -> list[str]:
    """Which of the issue's targets are met, one line each, with the numbers."""
    lines = []
    ours = [s for s in systems if s.startswith("ours")]
    for system in ours:
        one, sixteen = (table.get(f"{system}@{b}", {}).get("aggregate_tokens_per_s") for b in (1, 16))
        if one and sixteen:
            ratio = sixteen / one
            lines.append(
                f"{system}: batch 16 / batch 1 = {ratio:.1f}x (target >= 8x: {'met' if ratio >= 8 else 'NOT met'})"
            )
        for batch in batches:
            row, acc = table[f"{system}@{batch}"], table.get(f"accelerate@{batch}", {})
            if row["aggregate_tokens_per_s"] and acc.get("aggregate_tokens_per_s"):
                ratio = row["aggregate_tokens_per_s"] / acc["aggregate_tokens_per_s"]
                lines.append(
                    f"{system} batch {batch}: {ratio:.2f}x accelerate (target >= 2x: "
                    f"{'met' if ratio >= 2 else 'NOT met'})"
                )
            if row["peak_anon_rss_bytes"] is not None:
                within = row["peak_anon_rss_bytes"] <= budget
                lines.append(
                    f"{system} batch {batch}: peak anonymous RSS {row['peak_anon_rss_bytes'] / 1e9:.2f} GB against the "
                    f"{budget / 1e9:.2f} GB budget (planned batch memory {(row['planned_batch_bytes'] or 0) / 1e6:.0f} "
                    f"MB inside it): {'met' if within else 'NOT met'}"
                )
    errors = [
        abs(r["predicted_step_s"] - r["step_s"]) / r["step_s"]
        for k, r in table.items()
        if k.startswith("ours") and r["predicted_step_s"] and r["step_s"]
    ]
    if errors:
        lines.append(
            "prediction: median |predicted - measured| / measured time per decoding step = "
            f"{100 * median(errors):.0f}% over {len(errors)} system x batch cells"
        )
    return lines


def write_reports(data: dict, stem: Path) -> None:
    table, systems, batches = data["medians"], data["systems"], data["batches"]
    lines = [
        f"# Throughput against batch size: {data['checkpoint']}",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Machine: {data['machine']['cpu']}, {data['machine']['nproc']} cores, torch {data['machine']['torch']}, "
        f"offload_core {data['machine']['commit']}; load average {data['loadavg_start']} -> "
        f"{data.get('loadavg_end', '')}",
        "",
        "| system | batch | aggregate tok/s | s per step | predicted s per step | peak anon RSS (GB) | runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for system in systems:
        for batch in batches:
            r = table[f"{system}@{batch}"]
            fmt = lambda v, d=3: "" if v is None else f"{v:.{d}f}"  # noqa: E731
            rss = None if r["peak_anon_rss_bytes"] is None else r["peak_anon_rss_bytes"] / 1e9
            lines.append(
                f"| {system} | {batch} | {fmt(r['aggregate_tokens_per_s'])} | {fmt(r['step_s'])} | "
                f"{fmt(r['predicted_step_s'])} | {fmt(rss, 2)} | {r['runs']} |"
            )
    lines += ["", "## Targets", ""] + [f"- {line}" for line in data["targets"]]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in systems:
        points = [(b, table[f"{system}@{b}"]["aggregate_tokens_per_s"]) for b in batches]
        points = [(b, v) for b, v in points if v]
        if points:
            ax.plot(*zip(*points), marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("aggregate generated tokens/s")
    ax.set_title(
        f"{Path(data['checkpoint']).name}, max_memory.cpu={data['args']['budget']}"
        + (", cold" if data["args"]["cold"] else "")
    )
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--preset", default="1.1b")
    parser.add_argument("--checkpoint", help="a local checkpoint folder instead of a synthetic preset")
    parser.add_argument("--budget", default="1GB")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt", default="Hi")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--report", help="only rewrite .md and .png from this results .json")
    args = parser.parse_args()
    if args.report:
        path = Path(args.report)
        write_reports(json.loads(path.read_text()), path.parent / path.name.removesuffix(".json"))
        return
    import pagecache

    from offload_core.values import parse_size

    systems, batches = args.systems.split(","), [int(b) for b in args.batches.split(",")]
    if args.checkpoint:
        args.preset = None
    checkpoint, _, shard_files = checkpoint_for(args)
    budget = parse_size(args.budget, what="--budget")
    tag = "-".join(filter(None, [args.preset or Path(args.checkpoint).name, "cold" if args.cold else None]))
    log_dir = Path("/tmp") / f"offload-bench-batch-{tag}-{int(time.time())}"
    log_dir.mkdir(parents=True)
    env, code = code_snapshot("worktree", log_dir)
    stem = Path(args.out) / f"batch-{tag}"
    data = {
        "args": vars(args),
        "command": "python " + " ".join(shlex.quote(a) for a in ["bench/batch.py", *sys.argv[1:]]),
        "machine": {**machine(), "commit": code},
        "checkpoint": str(checkpoint),
        "systems": systems,
        "batches": batches,
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "runs": [],
    }
    pagecache.warm(shard_files)
    for rep in range(args.reps):
        for batch in batches:
            order = systems[(rep + batch) % len(systems) :] + systems[: (rep + batch) % len(systems)]
            for system in order:
                spec = {
                    **parse_system(system),
                    "preset": args.preset,
                    "checkpoint": str(checkpoint),
                    "dtype": args.dtype,
                    "budget": args.budget,
                    "tokens": args.tokens,
                    "cold": args.cold,
                    "prompt": args.prompt,
                    "rep": rep,
                    "batch": batch,
                    "device": "cpu",
                    "cpu_budget": budget,
                    "threads": None,
                    "tag": f"{system.replace(':', '_')}-b{batch}-{rep}",
                }
                spec.setdefault("overrides", [])
                result = run_one(spec, log_dir, args.timeout, env)
                data["runs"].append(result)
                if "error" not in result:
                    print(
                        f"  rep {rep} batch {batch:>3} {system:<28} {result['aggregate_tokens_per_s']:8.3f} tok/s  "
                        f"step {result['decode_token_mean_s']:.2f} s (predicted "
                        f"{result.get('predicted_step_s', float('nan')):.2f})  anon "
                        f"+{result['peak_anon_rss_bytes'] / 1e9:.2f} GB",
                        flush=True,
                    )
                data["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
                data["medians"] = medians(data["runs"], systems, batches)
                data["targets"] = targets(data["medians"], systems, batches, budget)
                stem.parent.mkdir(parents=True, exist_ok=True)
                Path(f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    write_reports(data, stem)
    print("\n".join(data["targets"]))
    print(f"wrote {stem}.json, .md and .png")


if __name__ == "__main__":
    main()
