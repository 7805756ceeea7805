"""\
Kept set against the kernel's LRU on a model larger than the page cache: fresh ``run.py`` processes per configuration,
the disk's sequential bandwidth measured in the same session (buffered 16 MiB reads, and mapped reads as the prefetch
reader does them: the bound uses the faster), figures written to bench/results/keep-<preset>.{json,md}.

    OFFLOAD_CORE_CACHE=/tmp/bigcache flock /tmp/bench.lock python bench/keep.py --preset 30b --budget 4GB
    flock /tmp/bench.lock python bench/keep.py --preset 1.1b --budget 700MB --stores safetensors memmap --half
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from pagecache import drop_cache, mapped_read_bandwidth, sequential_read_bandwidth, whole_files  # noqa: E402

GB = 1e9


def checkpoint_files(preset: str) -> list[Path]:
    from offload_core.loading.sources import synthetic_checkpoint, synthetic_preset

    folder = Path(synthetic_checkpoint(**synthetic_preset(preset)))
    return sorted(folder.glob("*.safetensors"))


def one_run(preset: str, store: str, budget: str, page_cache: str, tokens: int, out: Path, folder: Path | None) -> dict:
    """One fresh ``run.py`` process (the checkpoint dropped from the page cache first); its metrics.json and swap
    use."""
    drop_cache(
        checkpoint_files(preset)
        + (sorted(p for p in folder.iterdir() if p.is_file()) if folder and folder.exists() else [])
    )
    swap_before = psutil.swap_memory().used
    command = [
        sys.executable,
        str(REPO / "run.py"),
        "model=synthetic",
        f"model.preset={preset}",
        f"storage={store}",
        "hook=prefetch",
        f"max_memory.cpu={budget}",
        f"max_new_tokens={tokens}",
        "prompt=Hello there",
        f"page_cache={page_cache}",
        "progress=false",
        f"hydra.run.dir={out}",
    ]
    if folder is not None:
        command.append(f"offload_folder={folder}")
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(command)}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    plan_line = next((line for line in done.stdout.splitlines() if line.startswith("page cache:")), "")
    return {
        "store": store,
        "page_cache": page_cache,
        "wall_s": wall,
        "plan": plan_line,
        "swap_used_delta": psutil.swap_memory().used - swap_before,
        "metrics": metrics,
    }


def summary_row(run: dict, bandwidth: float, budget_bytes: int) -> dict:
    m = run["metrics"]
    counters = m.get("prefetch", {})
    s_per_token = 1 / m["decode_tokens_per_s"] if m["decode_tokens_per_s"] else float("nan")
    kept = counters.get("kept_bytes", 0)
    bound = 1.25 * (m["offloaded_bytes"] - kept) / bandwidth
    return {
        "store": run["store"],
        "page_cache": run["page_cache"],
        "s_per_token": s_per_token,
        "bound_s": bound,
        "within_bound": s_per_token <= bound,
        "kept_bytes": kept,
        "offloaded_bytes": m["offloaded_bytes"],
        "disk_read_bytes_per_token": m.get("disk_read_bytes_per_token"),
        "disk_read_bytes_first_token": m.get("disk_read_bytes_first_token"),
        "disk_read_bytes_by_token": m.get("disk_read_bytes_by_token", []),
        "prefetch": counters,
        "kept_served_bytes_per_token": counters.get("kept_served_bytes", 0) / max(m["generated_tokens"], 1),
        "time_to_first_token_s": m["time_to_first_token_s"],
        "load_s": m["load_s"],
        "read_bandwidth_bytes_per_s": m.get("read_bandwidth_bytes_per_s"),
        "wait_s_per_token": counters.get("wait_s_per_token"),
        "kept_shrinks": counters.get("kept_shrinks", 0),
        "kept_shrunk_bytes": counters.get("kept_shrunk_bytes", 0),
        "kept_grows": counters.get("kept_grows", 0),
        "plan": run["plan"],
        "peak_anon_rss_bytes": m["peak_anon_rss_bytes"],
        "anon_within_budget": m["peak_anon_rss_bytes"] <= budget_bytes,
        "swap_used_delta": run["swap_used_delta"],
        "token_ids": m["token_ids"],
    }


def write_report(path: Path, args: argparse.Namespace, bandwidths: dict, rows: list[dict]) -> None:
    cache = f"OFFLOAD_CORE_CACHE={os.environ['OFFLOAD_CORE_CACHE']} " if os.environ.get("OFFLOAD_CORE_CACHE") else ""
    lru = {r["store"]: r["s_per_token"] for r in rows if r["page_cache"] == "lru"}
    lines = [
        f"# Kept set against the kernel's LRU: `{args.preset}`, max_memory.cpu={args.budget}, {args.tokens} tokens, "
        "hook=prefetch",
        "",
        f"Reproduce: `{cache}flock /tmp/bench.lock python bench/keep.py {' '.join(sys.argv[1:])}`",
        "",
        "Disk sequential read, cache dropped first, before and after the runs: "
        + "; ".join(
            f"{name} {b[1] / GB:.2f} GB in {b[2]:.1f} s = {b[0] / GB:.2f} GB/s" for name, b in bandwidths.items()
        )
        + f". The bound uses the faster, {max(b[0] for b in bandwidths.values()) / GB:.2f} GB/s.",
        "",
        "| store | page_cache | load s | first token s | s/token after it | × lru | bound s (1.25 × streamed ÷ bw) | "
        "within | kept GB | disk read GB first token | disk read GB/token after it | kept served GB/token | read GB/s "
        "| waited s/token | kept shrinks (GB) / grows | peak anon GB | swap Δ | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        disk = r["disk_read_bytes_per_token"]
        speedup = lru[r["store"]] / r["s_per_token"] if r["store"] in lru and r["s_per_token"] else float("nan")
        lines.append(
            f"| {r['store']} | {r['page_cache']} | {r['load_s']:.1f} | {r['time_to_first_token_s']:.1f} | "
            f"{r['s_per_token']:.2f} | {speedup:.2f} | {r['bound_s']:.2f} | {r['within_bound']} | "
            f"{r['kept_bytes'] / GB:.2f} | {(r['disk_read_bytes_first_token'] or 0) / GB:.2f} | {(disk or 0) / GB:.2f} "
            f"({', '.join(f'{b / GB:.2f}' for b in r['disk_read_bytes_by_token'][1:])}) | "
            f"{r['kept_served_bytes_per_token'] / GB:.2f} | {(r['read_bandwidth_bytes_per_s'] or 0) / GB:.2f} | "
            f"{r['wait_s_per_token'] or 0:.2f} | {r['kept_shrinks']} ({r['kept_shrunk_bytes'] / GB:.2f}) / "
            f"{r['kept_grows']} | {r['peak_anon_rss_bytes'] / GB:.2f} | {r['swap_used_delta']} | {r['token_ids']} |"
        )
    lines += ["", "Plans:", ""] + [f"- {r['store']} {r['page_cache']}: {r['plan'] or '(none printed)'}" for r in rows]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    from offload_core.values import parse_size

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--preset", default="30b")
    parser.add_argument("--budget", default="4GB")
    parser.add_argument("--stores", nargs="+", default=["safetensors"])
    parser.add_argument("--tokens", type=int, default=3)
    parser.add_argument(
        "--half", action="store_true", help="kept set: page_cache = half the offloaded bytes (else auto)"
    )
    parser.add_argument(
        "--page-caches",
        nargs="+",
        default=["lru", "kept"],
        help="lru: today's behaviour (the kernel's cache); kept: the kept set (auto, or half with --half); or sizes",
    )
    parser.add_argument(
        "--bandwidth-bytes", type=float, default=4e9, help="bytes of the checkpoint read to time the disk, each way"
    )
    args = parser.parse_args()
    results = REPO / "bench" / "results"
    files = checkpoint_files(args.preset)
    ranges, left = [], 2 * args.bandwidth_bytes
    for path, start, end in whole_files(files):
        if left <= 0:
            break
        ranges.append((path, start, start + int(min(end - start, left))))
        left -= end - start
    half = (
        len(ranges) // 2
    )  # two disjoint spans of the checkpoint: a second read of the same bytes may come from the host's cache

    def measure(when: str) -> dict:
        """The disk's sequential read bandwidth now: buffered reads of one span, mapped reads of the other."""
        found = {
            f"buffered 16 MiB reads, {when}": sequential_read_bandwidth(ranges[:half] or ranges),
            f"mapped reads (MADV_POPULATE_READ, dropped after), {when}": mapped_read_bandwidth(ranges[half:] or ranges),
        }
        print("disk: " + ", ".join(f"{name} {b[0] / GB:.2f} GB/s" for name, b in found.items()), flush=True)
        return found

    # Measured before and after the runs: a virtual disk can read a checkpoint's first pass far slower than the
    # next ones (the host caches what was read), and the runs' tokens after the first are such later passes.
    bandwidths = measure("before the runs")
    runs = []
    with tempfile.TemporaryDirectory(prefix="keep-bench-") as scratch:
        for store in args.stores:
            folder = Path(scratch) / "offload" if store == "memmap" else None
            offloaded = None
            for mode in args.page_caches:
                page_cache = mode
                if mode == "kept":
                    page_cache = str(offloaded // 2) if args.half and offloaded else "auto"
                run = one_run(
                    args.preset, store, args.budget, page_cache, args.tokens, Path(scratch) / f"{store}-{mode}", folder
                )
                offloaded = run["metrics"]["offloaded_bytes"]
                runs.append(run)
                print(json.dumps({k: v for k, v in run["metrics"].items() if k != "token_ids"})[:600], flush=True)
    bandwidths.update(measure("after the runs"))
    bandwidth = max(b[0] for b in bandwidths.values())
    rows = [summary_row(run, bandwidth, parse_size(args.budget)) for run in runs]
    stem = f"keep-{args.preset}" + ("" if args.page_caches == ["lru", "kept"] else "-" + "-".join(args.page_caches))
    (results / f"{stem}.json").write_text(
        json.dumps({"args": vars(args), "bandwidths": bandwidths, "rows": rows}, indent=1)
    )
    write_report(results / f"{stem}.md", args, bandwidths, rows)
    print(f"wrote {results / stem}.md")


if __name__ == "__main__":
    main()
