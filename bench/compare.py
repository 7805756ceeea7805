"""Compare, on one checkpoint and one CPU budget: the in-memory model, accelerate's disk offload and ours (each policy
and store).

Every measurement runs in a fresh process (``bench/worker.py``) so RSS baselines are honest, and the
systems run in alternation, one round per repetition. Writes ``bench/results/compare-<tag>.json``
(every run and the medians), ``.md`` (tables, ratios, targets) and ``.png``.

    python bench/compare.py --preset 1.1b --budget 1GB --tokens 16 --reps 3
    python bench/compare.py --preset 1.1b --budget 1GB --tokens 8 --reps 3 --cold
    python bench/compare.py --report bench/results/compare-1.1b.json     # redo .md/.png from a .json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from report import _with, write_reports  # noqa: E402 (a sibling script, found through the path above)
from systems import SYSTEM_FORM, parse_system  # noqa: E402
from targets import HYBRID_FIGURES, agreement, evaluate_targets  # noqa: E402

POLICIES = ("align_per_call", "chained", "functional_call", "prefetch")
STORES = ("memmap", "safetensors")
DEFAULT_SYSTEMS = [
    "inmem",
    "accelerate",
    *(f"ours:{p}:{s}" for p in POLICIES for s in STORES),
    "ours:align_per_call:pinned_cpu",
    "ours:prefetch:safetensors:fit",
]
COLD_SYSTEMS = ["inmem", "accelerate", *(f"ours:{p}:{s}" for p in POLICIES for s in STORES)]
#: --device cuda: --budget is GPU 0's; the rest sits in (pinned) host memory and is streamed to the GPU
GPU_SYSTEMS = [
    "inmem",
    "accelerate",
    "ours:prefetch:pinned_cpu",
    "ours:functional_call:pinned_cpu",
    "ours:align_per_call:pinned_cpu",
    "ours:prefetch:memmap",
    "ours:prefetch:safetensors",
    "ours:prefetch:pinned_cpu:fit",
]

#: figures a run reports that we take medians of
FIGURES = [
    "load_s",
    "time_to_first_token_s",
    "load_to_first_token_s",
    "decode_tokens_per_s",
    "decode_token_mean_s",
    "peak_anon_rss_bytes",
    "peak_file_rss_bytes",
    "anon_rss_after_load_bytes",
    "bytes_read_per_token",
    "bytes_moved_per_decode_token",
    "read_bandwidth_bytes_per_s",
    "disk_read_bytes_per_token",
    "disk_read_bytes_per_decode_token",
    "offloaded_bytes",
    "store_bytes_written",
    "sequential_read_bytes_per_s",
    "ideal_read_s_per_token",
    "cold_token_over_ideal",
    "disk_read_bandwidth_bytes_per_s",
    "cached_fraction_after_drop_max",
    "peak_gpu_bytes",
    "h2d_bytes_per_s",
    "ideal_h2d_s_per_token",
    "h2d_token_over_ideal",
    "prefetch_wait_s_per_token",
]


def machine() -> dict:
    import psutil
    import torch
    import transformers

    cpu = "unknown"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import accelerate

        acc = accelerate.__version__
    except ImportError:
        acc = None
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": acc,
        "commit": commit,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def checkpoint_for(args) -> tuple[Path, int, list[str]]:
    from offload_core.loading import sources
    from offload_core.loading.checkpoint import Checkpoint

    if args.checkpoint:
        path = Path(args.checkpoint)
    else:
        print(f"building (or finding) the synthetic {args.preset} checkpoint ...", flush=True)
        path = sources.synthetic_checkpoint(**sources.synthetic_preset(args.preset))
    with Checkpoint.open(path) as ckpt:
        total = ckpt.total_bytes()
        files = [str(f) for f in ckpt.files]
    return path, total, files


def code_snapshot(mode: str, log_dir: Path) -> tuple[dict, str]:
    """Freeze the code the runs import, so that edits or commits landing mid-run cannot leak into a
    measurement: ``head`` extracts the committed HEAD into ``log_dir``; ``worktree`` copies the working
    tree's ``offload_core``, ``plugins`` and ``conf`` as they are at the start. Returns (environment
    for the workers, a description of the code)."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    env = dict(os.environ)
    root = log_dir / "code"
    if mode == "worktree":
        import shutil

        dirty = git("status", "--porcelain", "--", "offload_core", "plugins", "conf")
        for name in ("offload_core", "plugins", "conf"):
            shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        description = commit + ("+uncommitted changes (copied at start)" if dirty else "")
    else:
        root.mkdir()
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        description = commit
    path = root / ".path"
    path.mkdir()
    (path / "offload_core").symlink_to(root / "offload_core")
    (path / "offload_core_plugins").symlink_to(root / "plugins")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    env["BENCH_CODE_ROOT"] = str(root)
    return env, description


def run_one(spec: dict, log_dir: Path, timeout: float, env: dict) -> dict:
    out = log_dir / f"{spec['tag']}.json"
    log = log_dir / f"{spec['tag']}.log"
    started = time.perf_counter()
    with open(log, "w") as handle:
        try:
            # cwd is the log folder: a checkout in the cwd would shadow the code snapshot on sys.path
            proc = subprocess.run(
                [sys.executable, str(HERE / "worker.py"), json.dumps(spec), str(out)],
                cwd=log_dir,
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env=env,
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - started
    if rc != 0 or not out.exists():
        tail = log.read_text()[-1500:]
        print(f"  {spec['system']}: FAILED ({rc}) after {wall:.0f} s; log {log}\n{tail}", flush=True)
        return {**spec, "error": f"exit {rc}", "log": str(log)}
    result = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


def median(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and v == v]
    return statistics.median(values) if values else None


def aggregate(
    runs: list[dict], systems: list[str], budget_bytes: int, cold: bool, gpu: bool = False
) -> tuple[dict, dict]:
    reference = next((r["token_ids"] for r in runs if r.get("system") == "inmem" and "error" not in r), None)
    medians: dict[str, dict] = {}
    for system in systems:
        ok = [r for r in runs if r.get("system") == system and "error" not in r]
        row = {"runs": len(ok), "failed": sum(1 for r in runs if r.get("system") == system and "error" in r)}
        for key in FIGURES + HYBRID_FIGURES:
            row[key] = median([r.get(key) for r in ok])
            values = [r.get(key) for r in ok if isinstance(r.get(key), (int, float))]
            if values and key in ("decode_tokens_per_s", "load_to_first_token_s", "peak_anon_rss_bytes"):
                row[key + "_min"], row[key + "_max"] = min(values), max(values)
        row["token_agreement"] = median([agreement(r["token_ids"], reference) for r in ok])
        row["matches_in_memory"] = (
            all(r["token_ids"] == reference for r in ok) if reference is not None and ok else None
        )
        if ok:
            row["device_bytes"] = ok[0].get("device_bytes")
            row["device_map"] = ok[0].get("device_map")
        medians[system] = row

    def ratio(a, b):
        return a / b if a is not None and b else None

    inmem, acc = medians.get("inmem", {}), medians.get("accelerate", {})
    for system, row in medians.items():
        row["decode_vs_inmem"] = ratio(row["decode_tokens_per_s"], inmem.get("decode_tokens_per_s"))
        row["decode_vs_accelerate"] = ratio(row["decode_tokens_per_s"], acc.get("decode_tokens_per_s"))
        row["load_to_first_token_vs_accelerate"] = ratio(row["load_to_first_token_s"], acc.get("load_to_first_token_s"))
        row["load_to_first_token_vs_inmem"] = ratio(row["load_to_first_token_s"], inmem.get("load_to_first_token_s"))
        row["anon_rss_vs_budget"] = ratio(row["peak_anon_rss_bytes"], budget_bytes)
    targets = evaluate_targets(medians, budget_bytes, cold, gpu)
    return medians, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--preset", default="1.1b", help="synthetic model size: tiny, small, 0.3b, 1.1b, 3.4b, 30b")
    parser.add_argument("--checkpoint", help="a local checkpoint folder instead of a synthetic preset")
    parser.add_argument("--budget", default="1GB", help="max_memory.cpu for ours and accelerate")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per run (greedy, EOS suppressed)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--cold", action="store_true", help="drop offloaded files from the page cache before each token"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: run on GPU 0 with --budget as its budget, the rest in host memory",
    )
    parser.add_argument("--systems", help=f"comma-separated: inmem[-static|-graphs], accelerate, {SYSTEM_FORM}")
    parser.add_argument("--dtype", default="bfloat16", help="the run's dtype (all systems)")
    parser.add_argument(
        "--threads", type=int, help="torch compute threads in every run (default: torch's own, one per core)"
    )
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument(
        "--tag", help="results file suffix (default: preset, plus -cold and -<dtype> when not bfloat16)"
    )
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument(
        "--code",
        choices=("head", "worktree"),
        default="head",
        help=(
            "head: run a copy of the committed HEAD (default); worktree: a copy of the working tree taken at the start"
        ),
    )
    parser.add_argument("--report", help="only rewrite .md and .png from this results .json")
    parser.add_argument(
        "--note",
        action="append",
        help="a line for the report's Notes section (repeatable; with --report, replaces them)",
    )
    args = parser.parse_args()

    if args.report:
        path = Path(args.report)
        data = json.loads(path.read_text())
        if args.note:
            data["notes"] = args.note
        write_reports(data, path.parent / path.name.removesuffix(".json"))
        return

    from offload_core.values import parse_size

    import pagecache

    gpu = args.device == "cuda"
    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                "--device cuda: this machine has no CUDA device (run without --device for the CPU benchmark)"
            )
        if args.cold:
            raise SystemExit("--device cuda measures streaming from host memory: leave out --cold")
    default = GPU_SYSTEMS if gpu else COLD_SYSTEMS if args.cold else DEFAULT_SYSTEMS
    systems = args.systems.split(",") if args.systems else default
    parsed = [p for p in (parse_system(s, gpu) for s in systems) if p is not None]
    systems = [p["system"] for p in parsed]
    if args.checkpoint:
        args.preset = None
    tag = args.tag or "-".join(
        filter(
            None,
            [
                args.preset or Path(args.checkpoint).name,
                "cold" if args.cold else None,
                "cuda" if gpu else None,
                None if args.dtype == "bfloat16" else args.dtype,
            ],
        )
    )
    checkpoint, total_bytes, shard_files = checkpoint_for(args)
    budget_bytes = parse_size(args.budget, what="--budget")
    log_dir = Path("/tmp") / f"offload-bench-{tag}-{int(time.time())}"
    log_dir.mkdir(parents=True)
    stem = Path(args.out) / f"compare-{tag}"
    command = (
        "OFFLOAD_CORE_CACHE="
        + os.environ.get("OFFLOAD_CORE_CACHE", "~/.cache/offload_core")
        + " python "
        + " ".join(shlex.quote(a) for a in ["bench/compare.py", *sys.argv[1:]])
    )
    env, code = code_snapshot(args.code, log_dir)
    print(f"checkpoint {checkpoint} ({total_bytes / 1e9:.2f} GB); offload_core {code}; logs in {log_dir}", flush=True)
    pagecache.warm(shard_files)
    data = {
        "args": vars(args),
        "command": command,
        "machine": {**machine(), "commit": code},
        "checkpoint": str(checkpoint),
        "checkpoint_bytes": total_bytes,
        "budget_bytes": budget_bytes,
        "systems": systems,
        "prompt_tokens": len(args.prompt.encode()),
        "notes": args.note or [],
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "runs": [],
    }
    for rep in range(args.reps):
        order = parsed[rep % len(parsed) :] + parsed[: rep % len(parsed)]  # rotate: no system always runs first
        for system in order:
            spec = {
                **system,
                "preset": args.preset,
                "checkpoint": str(checkpoint),
                "dtype": args.dtype,
                "budget": str(2 * total_bytes) if system.get("fit") else args.budget,
                "tokens": args.tokens,
                "cold": args.cold,
                "prompt": args.prompt,
                "rep": rep,
                "threads": args.threads,
                "device": args.device,
                "cpu_budget": 2 * total_bytes,
                "tag": f"{system['system'].replace(':', '_').replace('+', '_').replace('=', '-')}-{rep}",
            }
            spec.setdefault("overrides", [])
            result = run_one(spec, log_dir, args.timeout, env)
            data["runs"].append(result)
            if "error" not in result:
                print(
                    f"  rep {rep} {system['system']:<40} load {result['load_s']:6.2f} s  first "
                    f"{result['time_to_first_token_s']:6.2f} s  decode {result['decode_tokens_per_s']:6.3f} tok/s  "
                    f"anon +{result['peak_anon_rss_bytes'] / 1e9:.2f} GB  file "
                    f"+{result['peak_file_rss_bytes'] / 1e9:.2f} GB",
                    flush=True,
                )
            data["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
            data["medians"], data["targets"] = aggregate(data["runs"], systems, budget_bytes, args.cold, gpu)
            stem.parent.mkdir(parents=True, exist_ok=True)
            _with(stem, ".json").write_text(json.dumps(data, indent=1, default=str))
    write_reports(data, stem)
    print(f"wrote {stem}.json, .md and .png")


if __name__ == "__main__":
    main()
