"""A synthetic Stable-Diffusion-shaped pipeline larger than its cpu budget (about a third of it in RAM, the rest on
disk): offload_core (chained whole components, prefetch) against diffusers' own offloading (sequential cpu offload,
block-level group offloading to disk) where they run on this CPU. Fresh processes, same seed; per configuration the
time per image and per denoising step, peak anonymous RSS, bytes moved and bytes read from disk per step, and whether
the image equals the in-memory one. Figures go to bench/results/diffusion-<size>[-cold].{json,md}.

    python bench/diffusion.py --width 192            # about 0.4 GB float32 (the loaded-machine default)
    flock /tmp/bench.lock python bench/diffusion.py --width 448   # about 2 GB
    python bench/diffusion.py --width 448 --cache cold   # every step reads what is offloaded from the disk
    python bench/diffusion.py --device cuda --out bench/results   # on a GPU: against diffusers' offload modes

Ours is ``ours_<policy>[:<store>]`` (default store safetensors). Cold: the pipeline's files and every offload
folder are dropped from the page cache before the timed image and after each of its steps, and ours runs with
``page_cache=0`` (a streamed block's pages are dropped once it has run).

``--device cuda`` runs bench/diffusion_device.py instead: a 3.0 GB bfloat16 pipeline on GPU 0, ours against diffusers'
model, sequential and group offloading (block and leaf level, with streams) at the same GPU memory, writing
diffusion-cuda-<gpu>.{json,md}; ``--device cpu`` and ``--device fake`` check that harness without a GPU.
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

REPO = Path(__file__).resolve().parent.parent
CONFIGS = [
    "in_memory",
    "ours_chained",
    "ours_prefetch",
    "ours_chained:memmap",
    "ours_prefetch:memmap",
    "diffusers_sequential",
    "diffusers_group_disk",
]


def build(folder: Path, width: int, dtype=None) -> int:
    """Save a seeded pipeline whose UNet has channels (width, 2 width, 2 width) to ``folder`` (its components in
    ``dtype``, default float32); its bytes."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from offload_core.testing import _tiny_clip_tokenizer

    if (folder / "model_index.json").is_file():
        return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)  # built in its dtype: half the memory and time in bfloat16
    unet = UNet2DConditionModel(
        block_out_channels=(width, 2 * width, 2 * width),
        layers_per_block=2,
        sample_size=16,
        cross_attention_dim=2 * width,
        attention_head_dim=8,
        norm_num_groups=32,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    )
    vae = AutoencoderKL(
        block_out_channels=(width // 2, width),
        latent_channels=4,
        norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    tokenizer = _tiny_clip_tokenizer(folder / "_tokenizer")
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=2 * width,
            intermediate_size=8 * width,
            num_hidden_layers=6,
            num_attention_heads=8,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    torch.set_default_dtype(previous)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    if dtype is not None:
        pipe.to(dtype)
    pipe.save_pretrained(folder)
    import shutil

    shutil.rmtree(folder / "_tokenizer")
    return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))


def disk_read_bytes() -> int:
    with open("/proc/self/io") as handle:
        return int(next(line for line in handle if line.startswith("read_bytes")).split()[1])


def drop_files(*folders: str) -> None:
    """Drop every file under ``folders`` from the page cache (pages this process maps stay: ours drops its own)."""
    for folder in folders:
        for file in Path(folder).rglob("*"):
            if file.is_file():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def worker(config: str, path: str, budget: int, steps: int, size: int, out: str, cold: bool = False) -> None:
    """One configuration in this (fresh) process: load, one image to warm up, one timed image."""
    import torch

    # imported before the baseline (diffusers imports its classes lazily): RSS counts the pipeline, not the libraries
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401

    import offload_core
    from offload_core.jobs.metrics import MemoryMonitor

    torch.manual_seed(0)
    memory = MemoryMonitor().__enter__()
    started = time.perf_counter()
    moved = None
    if config.startswith("ours_"):
        policy, _, store = config.removeprefix("ours_").partition(":")
        pipe = offload_core.from_pretrained(
            path,
            offload={
                "storage": store or "safetensors",
                "policy": policy,
                "offload_folder": tempfile.mkdtemp(dir=out),
                "execution_device": "cpu",
                "page_cache": 0 if cold else None,
            },
            max_memory={"cpu": budget},
            plan_call={"height": size, "width": size},
        )
        moved = pipe.offload_state.stats
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32)
        if config == "diffusers_sequential":
            pipe.enable_sequential_cpu_offload(device="cpu")
        elif config == "diffusers_group_disk":
            pipe.enable_group_offload(
                onload_device=torch.device("cpu"),
                offload_type="block_level",
                num_blocks_per_group=1,
                offload_to_disk_path=tempfile.mkdtemp(dir=out),
            )
    load_s = time.perf_counter() - started
    pipe.set_progress_bar_config(disable=True)
    step_times: list[float] = []
    step_reads: list[int] = []
    mark = [time.perf_counter(), disk_read_bytes()]

    def on_step(pipeline, step, timestep, kwargs):
        now, reads = time.perf_counter(), disk_read_bytes()
        step_times.append(now - mark[0])
        step_reads.append(reads - mark[1])
        if cold:
            drop_files(path, out)
        mark[:] = [time.perf_counter(), disk_read_bytes()]
        return kwargs

    call = dict(prompt="a photo of a red cat", num_inference_steps=steps, height=size, width=size, output_type="pt")
    pipe(**call, generator=torch.Generator().manual_seed(0))
    if moved is not None:
        moved.reset()
    step_times.clear(), step_reads.clear()
    if cold:
        drop_files(path, out)
    began = time.perf_counter()
    mark[:] = [began, disk_read_bytes()]
    image = pipe(**call, generator=torch.Generator().manual_seed(0), callback_on_step_end=on_step).images
    elapsed = time.perf_counter() - began
    memory.__exit__(None, None, None)
    torch.save(image, Path(out) / f"{config}.pt")
    print(
        json.dumps(
            {
                "config": config,
                "load_s": load_s,
                "s_per_image": elapsed,
                "s_per_step": sum(step_times[1:]) / max(len(step_times) - 1, 1),
                "peak_anon_rss_bytes": memory.anon_delta,
                "bytes_moved_per_image": moved.bytes if moved else None,
                "disk_bytes_read_per_step": sum(step_reads[1:]) // max(len(step_reads) - 1, 1),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--width", type=int, default=None, help="UNet's first channel count (448: about 2 GB)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--size", type=int, default=None, help="image size in pixels")
    parser.add_argument("--folder", type=Path, default=None, help="where the pipeline is saved (kept for reruns)")
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--cache", choices=["warm", "cold"], default="warm")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu", "fake"],
        default=None,
        help="ours against diffusers' offloading on an accelerator at the same GPU memory (bench/diffusion_device.py;"
        " cpu or fake check that harness without a GPU)",
    )
    parser.add_argument("--systems", nargs="*", default=None, help="--device: the systems to run")
    parser.add_argument("--budget", default=None, help="--device: ours' max_memory.0 (default: diffusers' peak)")
    parser.add_argument("--reps", type=int, default=1, help="--device: rounds over the systems")
    parser.add_argument("--images", type=int, default=3, help="--device: timed images per run (after a warm-up)")
    parser.add_argument("--timeout", type=float, default=300, help="--device: seconds a run may take")
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default bench/results)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device:
        import diffusion_device

        defaults = (768, 16, 128) if args.device == "cuda" else (64, 2, 32)
        args.width, args.steps, args.size = (v or d for v, d in zip((args.width, args.steps, args.size), defaults))
        if args.worker:
            budget = int(args.budget or 0)
            return diffusion_device.worker(
                args.worker, str(args.folder), args.device, budget, args.steps, args.size, args.images, args.scratch
            )
        return diffusion_device.main(args, build)
    args.width, args.steps, args.size = args.width or 192, args.steps or 4, args.size or 64
    if args.worker:
        budget = int(args.budget or 0)
        return worker(args.worker, str(args.folder), budget, args.steps, args.size, args.scratch, args.cache == "cold")
    folder = args.folder or Path(tempfile.gettempdir()) / f"offload-bench-diffusion-{args.width}"
    total = build(folder, args.width)
    budget = total // 3
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for config in args.configs:
            command = [
                sys.executable,
                __file__,
                "--worker",
                config,
                "--folder",
                str(folder),
                "--budget",
                str(budget),
                "--steps",
                str(args.steps),
                "--size",
                str(args.size),
                "--scratch",
                out,
                "--cache",
                args.cache,
            ]
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=3600,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            )
            if done.returncode != 0:
                lines = (
                    [line for line in done.stderr.strip().splitlines() if "Error" in line]
                    or done.stderr.strip().splitlines()
                    or ["?"]
                )
                rows.append({"config": config, "error": lines[-1][:300]})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
        import torch

        reference = torch.load(Path(out) / "in_memory.pt") if (Path(out) / "in_memory.pt").exists() else None
        for row in rows:
            file = Path(out) / f"{row['config']}.pt"
            if reference is not None and file.exists():
                row["same_image_as_in_memory"] = bool(torch.equal(torch.load(file), reference))
    write(rows, args, total, budget)


def write(rows: list[dict], args: argparse.Namespace, total: int, budget: int) -> None:
    results = args.out or REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    name = f"diffusion-{args.width}" + ("-cold" if args.cache == "cold" else "")
    meta = {
        "pipeline_bytes": total,
        "cpu_budget_bytes": budget,
        "steps": args.steps,
        "size": args.size,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    (results / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Diffusion pipeline offload, {total / 1e9:.2f} GB float32, cpu budget {budget / 1e9:.2f} GB (CPU only)",
        "",
        f"{args.steps} steps of a {args.size}x{args.size} image, {args.cache} page cache, fresh process per row; "
        f"load average {meta['load_average'][0]:.1f} on {meta['cpus']} cores"
        + (" (a loaded shared machine: indicative only)." if meta["load_average"][0] >= meta["cpus"] else "."),
        "",
        "Peak anonymous RSS is the process's rise from before loading (the weights it keeps, activations, runtime); "
        "within budget: that peak is at most the cpu budget. Over in-memory's: beside the in-memory run's own "
        "(its weights are mapped from the files, not anonymous).",
        "",
        "| config | s/image | s/step | peak anon RSS | over in-memory's | within budget | moved/image | disk read/step "
        "| same image |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((r["peak_anon_rss_bytes"] for r in rows if r["config"] == "in_memory" and "error" not in r), None)
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['config']} | failed: {row['error']} | | | | | | | |")
            continue
        moved, anon = row["bytes_moved_per_image"], row["peak_anon_rss_bytes"]
        over = "" if base is None or row["config"] == "in_memory" else anon - base
        fits = "" if row["config"] == "in_memory" else anon <= budget
        lines.append(
            f"| {row['config']} | {row['s_per_image']:.2f} | {row['s_per_step']:.2f} | {anon / 1e6:.0f} MB | "
            f"{'' if over == '' else f'{over / 1e6:.0f} MB'} | {fits} | "
            f"{'' if moved is None else f'{moved / 1e6:.0f} MB'} | {row['disk_bytes_read_per_step'] / 1e6:.1f} MB | "
            f"{row.get('same_image_as_in_memory', '')} |"
        )
    lines += ["", "## Targets", "", *targets(rows, budget)]
    (results / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def targets(rows: list[dict], budget: int) -> list[str]:
    """The issue's targets: identical images, anonymous memory within the budget, and ours at least 1.5 times as fast
    as the fastest diffusers mode that fits the same memory (where one does)."""
    done = [r for r in rows if "error" not in r and r["config"] != "in_memory"]
    fits = {r["config"]: r["peak_anon_rss_bytes"] <= budget for r in done}
    ours = [r for r in done if r["config"].startswith("ours_")]
    theirs = [r for r in done if r["config"].startswith("diffusers_") and fits[r["config"]]]
    lines = [f"- same image as in memory: {all(r.get('same_image_as_in_memory') for r in done)} (every run that ran)"]
    lines += [f"- {r['config']}: anonymous memory within the budget: {fits[r['config']]}" for r in ours]
    if not theirs:
        over = ", ".join(r["config"] for r in done if r["config"].startswith("diffusers_")) or "none ran"
        lines.append(f"- >= 1.5x the fastest diffusers mode that fits: no diffusers mode fits the budget ({over})")
        return lines
    best = min(theirs, key=lambda r: r["s_per_image"])
    for r in ours:
        ratio = best["s_per_image"] / r["s_per_image"]
        met = "met" if ratio >= 1.5 else "not met"
        lines.append(f"- {r['config']}: {ratio:.2f}x {best['config']} (>= 1.5x: {met})")
    return lines


if __name__ == "__main__":
    main()
