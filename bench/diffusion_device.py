"""``bench/diffusion.py --device cuda``: a synthetic pipeline of a few GB on an accelerator, ours (the policy the plan
chooses, and ``chained``) against diffusers' own offloading (model, sequential, block- and leaf-level group offloading
with streams) at the same GPU memory; time per image, peak GPU memory, same pixels as the in-memory run.

Each system runs in a fresh process, one round after another (``--reps``), diffusers' modes first: the budget ours
gets (``max_memory.0``) is the largest peak GPU memory of diffusers' sequential and group modes (``--budget`` sets
it instead). ``--device cpu`` (ours on the host, diffusers' modes skipped: they need an accelerator) and
``--device fake`` (ours on the fake accelerator) check the harness where no GPU is.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SYSTEMS = [
    "in-memory",
    "diffusers-model",
    "diffusers-sequential",
    "diffusers-group-block",
    "diffusers-group-leaf",
    "ours-auto",
    "ours-chained",
]
#: diffusers' modes whose peak sets the budget (model offload keeps the whole denoiser: it is compared where it fits)
BUDGET_FROM = ("diffusers-sequential", "diffusers-group-block", "diffusers-group-leaf")
TARGET = 1.3
PROMPT = "a photo of a red cat"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _diffusers(pipe, system: str, device) -> None:
    import torch

    if system == "diffusers-model":
        pipe.enable_model_cpu_offload(device=device)
    elif system == "diffusers-sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    elif system in ("diffusers-group-block", "diffusers-group-leaf"):
        level = "block_level" if system.endswith("block") else "leaf_level"
        blocks = {"num_blocks_per_group": 1} if level == "block_level" else {}
        pipe.enable_group_offload(
            onload_device=torch.device(device), offload_type=level, use_stream=True, non_blocking=True, **blocks
        )
    else:
        raise SystemExit(f"unknown system {system!r}: one of {', '.join(SYSTEMS)} or ours-<policy>")


def worker(system: str, folder: str, device: str, budget: int, steps: int, size: int, images: int, scratch: str):
    """One system in this fresh process: load, one image to warm up, then ``images`` timed ones (at least one, fewer
    once 6 s have passed); prints its row as JSON."""
    import torch
    from diffusers import DiffusionPipeline

    import offload_core
    from offload_core.jobs.metrics import MemoryMonitor

    accelerator, target, using = None, device, None
    if device == "fake":
        from offload_core import devices
        from offload_core.devices.fake import FakeAccelerator

        accelerator = FakeAccelerator(count=1, memory=8 * max(budget, 2**30))
        accelerator.install()
        using = devices.use(accelerator)  # kept: the context ends when it is collected
        using.__enter__()
        target = "fakegpu:0"
    memory = MemoryMonitor().__enter__()
    row: dict = {"system": system}
    started = time.perf_counter()
    stats = None
    if system.startswith("ours-"):
        policy = system.removeprefix("ours-")
        policy, _, store = policy.partition(":")
        store = store or ("safetensors" if device == "cpu" else "pinned_cpu")
        pipe = offload_core.from_pretrained(
            folder,
            offload={
                "storage": store,
                "policy": None if policy == "auto" else policy,
                "offload_folder": tempfile.mkdtemp(dir=scratch),
                "execution_device": target,
            },
            max_memory=budget,
            plan_call={"height": size, "width": size},
        )
        stats = pipe.offload_state.stats
        row["policy"] = "prefetch" if policy == "auto" else policy
        row["store"] = store
        row["headroom_bytes"] = pipe.offload_modules.offload_plan.headroom
        row["offloaded_bytes"] = pipe.offload_state.offloaded_bytes()
    else:
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=_dtype(folder))
        if system == "in-memory":
            pipe.to(target)
        else:
            _diffusers(pipe, system, target)
    _sync(device)
    row["load_s"] = time.perf_counter() - started
    if device == "cuda":
        row["gpu_after_load_bytes"] = torch.cuda.memory_allocated(0)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt=PROMPT, num_inference_steps=steps, height=size, width=size, output_type="pt")

    def one() -> tuple[torch.Tensor, float]:
        _sync(device)
        began = time.perf_counter()
        out = pipe(**call, generator=torch.Generator().manual_seed(0)).images
        _sync(device)
        return out, time.perf_counter() - began

    image, row["warmup_s"] = one()
    if stats is not None:
        stats.reset()
    times: list[float] = []
    while not times or (len(times) < images and sum(times) < 6):
        image, spent = one()
        times.append(spent)
    row["s_per_image"] = statistics.median(times)
    row["s_per_image_all"] = times
    if stats is not None:
        row["bytes_moved_per_image"] = stats.bytes // len(times)
    memory.__exit__(None, None, None)
    if device == "cuda":
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(0)
        row["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved(0)
    elif accelerator is not None:
        row["peak_gpu_bytes"] = accelerator.peak[0]
        image = image.elem
    else:
        row["peak_anon_rss_bytes"] = memory.anon_delta
    torch.save(image.detach().cpu(), Path(scratch) / f"{system}.pt")
    if device == "cuda" and system == "in-memory":
        sys.path.insert(0, str(REPO / "bench"))
        from gpu import pinned_h2d_bandwidth

        row["h2d_bytes_per_s"] = pinned_h2d_bandwidth()
    print(json.dumps(row))


def _dtype(folder: str):
    import torch

    return torch.bfloat16 if "bfloat16" in Path(folder).name else torch.float32


def _run(system: str, args, folder: Path, budget: int | None, scratch: str) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).with_name("diffusion.py")),
        "--device",
        args.device,
        "--worker",
        system,
        "--folder",
        str(folder),
        "--budget",
        str(budget or 0),
        "--steps",
        str(args.steps),
        "--size",
        str(args.size),
        "--images",
        str(args.images),
        "--scratch",
        scratch,
    ]
    began = time.perf_counter()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"timed out after {args.timeout} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["?"]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        return {"system": system, "error": (errors or lines)[-1][:300]}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["wall_s"] = time.perf_counter() - began
    return row


def main(args, build) -> None:
    """Build the pipeline (``build(folder, width, dtype)``), run every system ``args.reps`` times, write the report."""
    import torch

    from offload_core.values import parse_size

    started = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device (--device cpu or fake checks the harness)")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    name = f"offload-bench-diffusion-{args.width}-{str(dtype).removeprefix('torch.')}"
    cache = Path(os.environ.get("OFFLOAD_CORE_CACHE") or tempfile.gettempdir())
    folder = args.folder or cache / name
    total = build(folder, args.width, dtype)
    systems = list(args.systems or SYSTEMS)
    notes = []
    if args.device != "cuda":
        skipped = [s for s in systems if s.startswith("diffusers-")]
        systems = [s for s in systems if s not in skipped]
        if skipped:
            notes.append(f"skipped on {args.device}: {', '.join(skipped)} (diffusers' offload modes need a GPU)")
    systems.sort(key=lambda s: s.startswith("ours-"))  # diffusers' first: their peaks set the budget
    budget = parse_size(args.budget) if args.budget else None
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as scratch:
        for rep in range(args.reps):
            for system in systems:
                if system.startswith("ours-") and budget is None:
                    budget, how = auto_budget(runs, total)
                    notes.append(how)
                row = _run(system, args, folder, budget, scratch)
                row["rep"] = rep
                image = Path(scratch) / f"{system}.pt"
                reference = Path(scratch) / "in-memory.pt"
                if "error" not in row and reference.exists() and system != "in-memory":
                    row["same_image"] = bool(torch.equal(torch.load(image), torch.load(reference)))
                runs[system].append(row)
                print(json.dumps(row), flush=True)
    rows = [summary(system, runs[system], budget) for system in systems]
    compare(rows, budget)
    meta = {
        "device": device_name(args.device),
        "device_kind": args.device,
        "command": "python bench/diffusion.py " + shlex.join(sys.argv[1:]),
        "pipeline_bytes": total,
        "dtype": str(dtype).removeprefix("torch."),
        "budget_bytes": budget,
        "steps": args.steps,
        "size": args.size,
        "reps": args.reps,
        "notes": notes,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
    }
    write(rows, runs, meta, Path(args.out or REPO / "bench" / "results"), args)


def auto_budget(runs: dict[str, list[dict]], total: int) -> tuple[int, str]:
    """The largest peak GPU memory of diffusers' sequential and group modes that ran (so each fits), else half the
    pipeline's bytes; and a line saying which."""
    peaks = {s: r["peak_gpu_bytes"] for s in BUDGET_FROM for r in runs.get(s, []) if r.get("peak_gpu_bytes")}
    if not peaks:
        return total // 2, f"budget: half the pipeline's weights ({total // 2 / 1e9:.2f} GB; no diffusers mode ran)"
    system = max(peaks, key=peaks.get)
    return peaks[system], (
        f"budget: the peak GPU memory of {system} ({peaks[system] / 1e9:.3f} GB), the largest of "
        f"{', '.join(sorted(peaks))}"
    )


def summary(system: str, rows: list[dict], budget: int | None) -> dict:
    done = [r for r in rows if "error" not in r]
    if not done:
        return {"system": system, "error": rows[-1]["error"] if rows else "did not run"}
    out = dict(done[-1])
    out["s_per_image"] = statistics.median(r["s_per_image"] for r in done)
    out["s_per_image_min"] = min(min(r["s_per_image_all"]) for r in done)
    out["s_per_image_max"] = max(max(r["s_per_image_all"]) for r in done)
    out["runs"] = len(done)
    if any("peak_gpu_bytes" in r for r in done):
        out["peak_gpu_bytes"] = max(r["peak_gpu_bytes"] for r in done)
        out["fits"] = None if system == "in-memory" or not budget else out["peak_gpu_bytes"] <= budget
    if any("same_image" in r for r in done):
        out["same_image"] = all(r.get("same_image") for r in done)
    return out


def compare(rows: list[dict], budget: int | None) -> None:
    """Each of ours against the fastest diffusers mode that fits the budget: the speed ratio and whether it meets the
    target (ours' own peak within the budget and its image the in-memory one)."""
    theirs = [r for r in rows if r["system"].startswith("diffusers-") and "error" not in r and r.get("fits")]
    best = min(theirs, key=lambda r: r["s_per_image"]) if theirs else None
    for row in rows:
        if not row["system"].startswith("ours-") or "error" in row or best is None:
            continue
        row["versus"] = best["system"]
        row["speedup"] = best["s_per_image"] / row["s_per_image"]
        row["met"] = bool(row["speedup"] >= TARGET and row.get("fits") and row.get("same_image", True))


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "the fake accelerator (CPU-backed)" if device == "fake" else "CPU"


def slug(device: str) -> str:
    name = device_name(device).lower()
    kinds = [k for k in ("h200", "h100", "a100", "l40s", "l4", "a10g", "t4") if k in name]
    return f"cuda-{kinds[0]}" if device == "cuda" and kinds else ("cuda" if device == "cuda" else device)


def write(rows: list[dict], runs: dict, meta: dict, out: Path, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = f"diffusion-{slug(args.device)}"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    gb = 1e9
    budget = meta["budget_bytes"]
    lines = [
        f"# Diffusion pipeline offload on {meta['device']}: ours against diffusers' offloading at the same memory",
        "",
        f"A synthetic Stable-Diffusion-shaped pipeline of {meta['pipeline_bytes'] / gb:.2f} GB ({meta['dtype']}), "
        f"{meta['steps']} denoising steps of a {meta['size']}x{meta['size']} image with guidance; each system in a "
        f"fresh process, {meta['reps']} round(s) in alternation, one warm-up image then timed ones (medians). "
        f"Budget (ours' max_memory.0): {'none' if budget is None else f'{budget / gb:.3f} GB'}. "
        f"{meta['cpus']} CPUs, load average {meta['load_average'][0]:.1f}, torch {meta['torch']}; "
        f"the whole run took {meta['wall_s']:.0f} s.",
        "",
        *(f"- {note}" for note in meta["notes"]),
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        "Peak GPU memory: torch.cuda.max_memory_allocated over the whole process (load included); fits: at most the "
        f"budget. Met: ours at least {TARGET}x as fast as the fastest diffusers mode that fits, within the budget, "
        "with the in-memory image's pixels.",
        "",
        "| system | s/image (min-max) | load s | peak GPU GB | fits budget | moved/image GB | same image | "
        "x fastest fitting diffusers | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | failed: {r['error']} | | | | | | | |")
            continue
        peak = r.get("peak_gpu_bytes")
        moved = r.get("bytes_moved_per_image")
        ratio = f"{r['speedup']:.2f} ({r['versus']})" if "speedup" in r else ""
        lines.append(
            f"| {r['system']}{' (' + r['policy'] + ')' if r.get('policy') else ''} | {r['s_per_image']:.3f} "
            f"({r['s_per_image_min']:.3f}-{r['s_per_image_max']:.3f}) | {r['load_s']:.1f} | "
            f"{'' if peak is None else f'{peak / gb:.3f}'} | {'' if r.get('fits') is None else r['fits']} | "
            f"{'' if moved is None else f'{moved / gb:.2f}'} | {r.get('same_image', '')} | {ratio} | "
            f"{r.get('met', '')} |"
        )
    h2d = next((r.get("h2d_bytes_per_s") for r in rows if r.get("h2d_bytes_per_s")), None)
    if h2d:
        lines += ["", f"Pinned host-to-GPU bandwidth: {h2d / gb:.1f} GB/s; transfer bound of ours per image:"]
        for r in rows:
            if r.get("bytes_moved_per_image") is not None and "error" not in r:
                bound = r["bytes_moved_per_image"] / h2d
                lines.append(f"- {r['system']}: {bound:.3f} s ({r['s_per_image'] / bound:.2f}x of it)")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
