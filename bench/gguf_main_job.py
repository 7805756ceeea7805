"""The main job from SmolLM2's GGUF read in place (``storage=gguf``) against today's default (the GGUF converted once
into a float32 safetensors cache, ``storage=safetensors``): bytes moved per generated token, time to the first answer
on a fresh cache (the whole ``python run.py`` process, conversion included), and decode speed on a warm one. Figures
written to bench/results/gguf-main-job.{json,md}.

    python bench/gguf_main_job.py            # two configurations, a fresh cache each, then two warm runs each
    python bench/gguf_main_job.py --plan     # what the plan chooses: warm and cold (page_cache=0, half offloaded)

``--plan`` runs the converted default, ``storage=gguf`` and ``auto=true`` in turn, ``--rounds`` times (alternated, so a
shared machine's load falls on each alike), on a warm page cache and on a cold one (``page_cache=0``: every offloaded
byte read from the disk each token) with half the model offloaded (``max_memory.cpu=330MiB``), and writes the decode
speeds, their ratios, what ``auto=true`` picked and the prediction of each to bench/results/gguf-plan.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"default (converted float32, safetensors)": [], "storage=gguf (read in place)": ["storage=gguf"]}


def run(args: list[str], cache: Path, out: Path) -> tuple[float, dict, str]:
    """One ``python run.py`` process: its wall time, its metrics and its answer."""
    env = {**os.environ, "OFFLOAD_CORE_CACHE": str(cache)}
    command = [sys.executable, "run.py", "progress=false", f"hydra.run.dir={out}", *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args) or 'default'} failed:\n{done.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    return wall, metrics, metrics["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--plan", action="store_true", help="compare what the plan chooses, warm and cold")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", help="with --plan: the configurations to run (the default always)")
    parser.add_argument("--cold-only", action="store_true", help="with --plan: the cold page cache alone")
    parser.add_argument("--tag", default="", help="with --plan: written to gguf-plan-<tag>.{json,md}")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    if args.plan:
        from gguf_plan import compare

        return compare(args.rounds, args.out, args.configs, args.cold_only, args.tag)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CONFIGS.items():
            cache = Path(tmp) / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            fresh_wall, fresh, text = run(extra, cache, Path(tmp) / "fresh")
            warm = [run(extra, cache, Path(tmp) / f"warm{i}") for i in range(args.warm_runs)]
            best = max(warm, key=lambda item: item[1]["decode_tokens_per_s"])[1]
            rows.append(
                {
                    "config": name,
                    "args": extra,
                    "answer": text,
                    "token_ids": best["token_ids"],
                    "fresh_cache_process_s": fresh_wall,
                    "fresh_cache_load_s": fresh["load_s"],
                    "fresh_cache_ttft_s": fresh["time_to_first_token_s"],
                    "warm_decode_tokens_per_s": best["decode_tokens_per_s"],
                    "warm_process_s": min(item[0] for item in warm),
                    "bytes_moved_per_token": best["bytes_moved_per_token"],
                    "cache_bytes": sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()),
                }
            )
    base, gguf = rows
    summary = {
        "bytes_moved_ratio": gguf["bytes_moved_per_token"] / base["bytes_moved_per_token"],
        "fresh_process_speedup": base["fresh_cache_process_s"] / gguf["fresh_cache_process_s"],
        "warm_decode_ratio": gguf["warm_decode_tokens_per_s"] / base["warm_decode_tokens_per_s"],
        "same_tokens": base["token_ids"] == gguf["token_ids"],
        "load_average": os.getloadavg()[0],
        "cores": psutil.cpu_count(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gguf-main-job.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")
    lines = [
        "# Main job from the GGUF read in place vs the converted float32 default",
        "",
        f"{platform.machine()}, {summary['cores']} cores, load average {summary['load_average']:.1f} at the end "
        "(a shared machine: figures are noisy). `python bench/gguf_main_job.py` reproduces it.",
        "",
        "| configuration | bytes moved / token | fresh cache: process to answer | warm decode | cache written |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['config']} | {row['bytes_moved_per_token'] / 2**20:.1f} MiB | "
            f"{row['fresh_cache_process_s']:.1f} s | {row['warm_decode_tokens_per_s']:.2f} tok/s | "
            f"{row['cache_bytes'] / 2**20:.1f} MiB |"
        )
    lines += [
        "",
        f"bytes moved ratio {summary['bytes_moved_ratio']:.3f}; fresh-cache process "
        f"{summary['fresh_process_speedup']:.2f}x faster; warm decode {summary['warm_decode_ratio']:.2f}x the "
        f"default; same tokens: {summary['same_tokens']}.",
    ]
    (args.out / "gguf-main-job.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
