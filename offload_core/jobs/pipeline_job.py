"""A run of a diffusers pipeline folder: plan its components as one model, dispatch, make the images, report."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from offload_core.runner.inputs import read_prompts
from offload_core.plan.model import RunModel, resolve_checkpoint
from offload_core.plan.run_plan import make_plan, print_plan, write_plan
from offload_core.jobs.results import RunResult
from offload_core.runner.settings import Settings, Strategies


def whole_components(settings: Settings, policy: Any) -> int | None:
    """``pipeline.whole_components`` in bytes (auto: the execution device's budget shared by the policy's units in
    flight and what runs beside them; None: no limit)."""
    from offload_core.plan.reserve import whole_limit
    from offload_core.values import parse_size

    value = str(settings.pipeline["whole_components"])
    if value == "auto":
        return whole_limit(settings.budgets, settings.execution_device, policy)
    return parse_size(value, what="pipeline.whole_components")


def pipeline_prompts(settings: Settings) -> list[str]:
    """The run's prompts: the ``prompts`` file's, else ``[prompt]``."""
    return read_prompts(settings.prompts_file) if settings.prompts_file else [settings.prompt]


def call_kwargs(section: dict) -> dict[str, Any]:
    """The pipeline call's arguments from the ``pipeline`` section (unset sizes left to the pipeline)."""
    kwargs = {"num_inference_steps": section["num_inference_steps"], "guidance_scale": section["guidance_scale"]}
    for key in ("negative_prompt", "height", "width"):
        if section.get(key) is not None:
            kwargs[key] = section[key]
    return kwargs


def image_call(settings: Settings, prompts: list[str], output_type: str) -> dict[str, Any]:
    """The pipeline call's arguments for ``prompts`` (one batch), a negative prompt given once per prompt."""
    call = {**call_kwargs(settings.pipeline), "prompt": prompts, "output_type": output_type}
    if call.get("negative_prompt") is not None:
        call["negative_prompt"] = [call["negative_prompt"]] * len(prompts)
    return call


def make_images(
    pipeline: Any, prompts: list[str], settings: Settings, output_type: str, steps: "StepTimer | None" = None
) -> torch.Tensor:
    """Every prompt's image, ``batch_size`` prompts per call, each call's generator seeded with ``seed`` plus its
    first prompt's index; one tensor (N, C, H, W) for ``output_type="pt"``, else a list of images."""
    images: list[Any] = []
    size = max(settings.batch_size, 1)
    for start in range(0, len(prompts), size):
        generator = torch.Generator("cpu").manual_seed(settings.sampling.seed + start)
        extra = {"callback_on_step_end": steps} if steps is not None else {}
        out = pipeline(**image_call(settings, prompts[start : start + size], output_type), generator=generator, **extra)
        images.extend(list(out.images))
    return torch.stack(images) if output_type == "pt" else images


def planned_headroom(settings: Settings, empty: Any, prompts: list[str]) -> Settings:
    """``settings`` with ``headroom=auto`` resolved to the activations of the run's largest call, traced on the
    empty pipeline (:func:`offload_core.loading.pipeline_memory.pipeline_headroom`), checked against the budget."""
    import dataclasses

    from offload_core.loading.pipeline_memory import pipeline_headroom
    from offload_core.planning.headroom import check_headroom

    if settings.headroom is not None:
        return settings
    call = image_call(settings, prompts[: max(settings.batch_size, 1)], "pt")
    budget = settings.max_memory.get(settings.budget_key)
    headroom = pipeline_headroom(empty, call, budget, settings.execution_device)
    check_headroom(settings.max_memory, headroom, settings.execution_device)
    return dataclasses.replace(settings, headroom=headroom)


class StepTimer:
    """A pipeline's ``callback_on_step_end``: the time and the bytes moved of each denoising step."""

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.times: list[float] = []
        self.moved: list[int] = []
        self._last = time.perf_counter()
        self._bytes = stats.bytes

    def start(self) -> None:
        self._last, self._bytes = time.perf_counter(), self.stats.bytes

    def __call__(self, pipeline: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self.moved.append(self.stats.bytes - self._bytes)
        self._last, self._bytes = now, self.stats.bytes
        return kwargs


def run_pipeline(settings: Settings, strategies: Strategies, labels: dict) -> RunResult:
    """The run of ``settings`` (whose ``model.path`` is a pipeline folder): plan, dispatch, images, metrics."""
    from offload_core.plan.request import dispatch
    from offload_core.loading.pipeline import build_empty_pipeline
    from offload_core.loading.pipeline_load import finish_dispatch, open_components
    from offload_core.jobs.context import frozen_heap
    from offload_core.jobs.metrics import MemoryMonitor

    path = resolve_checkpoint(settings.model)
    prompts = pipeline_prompts(settings)
    empty = build_empty_pipeline(path, settings.dtype)
    settings = planned_headroom(settings, empty, prompts)  # headroom=auto: the call's activations, traced
    checkpoint, no_split = open_components(
        empty, path, whole_components(settings, strategies.policy), settings.model.get("no_split_module_classes")
    )
    run_model = RunModel(empty.modules, empty.dtype, no_split, Path(path), task="text_to_image")
    with checkpoint, frozen_heap():
        plan = make_plan(settings, strategies, run_model, checkpoint)
        strategies = strategies.planned(plan.policy)
        per_step, per_image = print_pipeline_plan(settings, strategies, plan, run_model, len(prompts))
        if settings.plan_only:
            write_plan(settings, run_model, plan)
            return RunResult.of_plan(plan, settings.output_dir, {})
        started = time.perf_counter()
        dispatch(plan, empty.modules, checkpoint, settings.offload_folder, settings.progress)
        pipeline = finish_dispatch(empty, settings.execution_device)
        pipeline.set_progress_bar_config(disable=not settings.progress)
        with pipeline.offload_state as state, MemoryMonitor() as memory:
            load_s = time.perf_counter() - started
            state.stats.reset()
            steps = StepTimer(state.stats)
            began = time.perf_counter()
            steps.start()
            images = make_images(pipeline, prompts, settings, "pt", steps)
            elapsed = time.perf_counter() - began
            moved = state.stats.snapshot()
        figures = image_figures(prompts, steps, elapsed, load_s, moved, memory, settings.execution_device)
        figures.update(predicted_bytes_moved_per_step=per_step, predicted_bytes_moved_per_image=per_image)
    result = RunResult.of_plan(plan, settings.output_dir, figures)
    if settings.compare_in_memory:
        reference = in_memory_images(path, empty.dtype, prompts, settings)
        result.matches_in_memory = bool(torch.equal(reference, images))
    write_images(settings.output_dir, prompts, images)
    write_pipeline_metrics(result, prompts, labels, strategies.policy_name)
    print(
        f"{len(prompts)} image(s), {figures['time_per_image_s']:.3f} s per image, {figures['time_per_step_s']:.3f} s "
        f"per step, {figures['bytes_moved_per_step']} bytes moved per step, {figures['bytes_moved_per_image']} per "
        f"image; wrote {settings.output_dir}"
    )
    if result.matches_in_memory is not None:
        print(f"same images as in memory (bit for bit): {result.matches_in_memory}")
    return result


def print_pipeline_plan(
    settings: Settings, strategies: Strategies, plan: Any, run_model: RunModel, images: int
) -> tuple[int, int]:
    """Print the plan with what it moves per denoising step and per image (not per generated token: a pipeline
    generates images, its denoiser called once per step); return those two predictions in bytes."""
    import dataclasses

    from offload_core.loading.pipeline_moves import predicted_pipeline_moves
    from offload_core.values import format_size

    steps = int(settings.pipeline["num_inference_steps"])
    per_step, per_call = predicted_pipeline_moves(
        run_model.model,
        plan.device_map,
        strategies.policy,
        settings.execution_device,
        run_model.dtype,
        run_model.no_split,
        steps,
    )
    per_image = per_call // max(min(settings.batch_size, images), 1)  # a call makes batch_size images
    shown = dataclasses.replace(plan, predicted_bytes_per_token=per_step)
    print_plan(settings, strategies, shown, "denoising step", held_for="the activations of the pipeline's call")
    print(f"predicted bytes moved per image ({steps} denoising steps): {format_size(per_image)}")
    return per_step, per_image


def image_figures(
    prompts: list[str], steps: StepTimer, elapsed: float, load_s: float, moved: dict, memory: Any, device: torch.device
) -> dict[str, Any]:
    """metrics.json's figures of a pipeline run."""
    count = max(len(steps.times), 1)
    figures = {
        "images": len(prompts),
        "load_s": load_s,
        "time_s": elapsed,
        "time_per_image_s": elapsed / len(prompts),
        "steps": len(steps.times),
        "time_per_step_s": sum(steps.times) / count,
        "step_times_s": steps.times,
        "bytes_moved": moved["bytes"],
        "bytes_moved_per_step": sum(steps.moved) // count,
        "bytes_moved_per_image": moved["bytes"] // max(len(prompts), 1),
        "bytes_moved_by_step": steps.moved,
        "peak_anon_rss_bytes": memory.anon_delta,
        "peak_file_rss_bytes": memory.file_delta,
    }
    if device.type == "cuda":
        figures["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return figures


def in_memory_images(path: Path, dtype: torch.dtype, prompts: list[str], settings: Settings) -> torch.Tensor:
    """The same images from diffusers' own in-memory pipeline, for ``compare_in_memory``."""
    from diffusers import DiffusionPipeline

    from offload_core.loading.quiet import diffusers_dtype, library_bars

    with library_bars(False, "diffusers", "transformers"):  # the run's own bars say how it loads
        pipeline = DiffusionPipeline.from_pretrained(
            path, local_files_only=True, low_cpu_mem_usage=False, **diffusers_dtype(dtype)
        )
    pipeline.set_progress_bar_config(disable=True)
    return make_images(pipeline, prompts, settings, "pt")


def write_images(out_dir: Path, prompts: list[str], images: torch.Tensor) -> None:
    """``image.png`` for one prompt; ``image-000.png``... and ``grid.png`` for several."""
    from diffusers.utils import make_image_grid
    from diffusers.image_processor import VaeImageProcessor

    out_dir.mkdir(parents=True, exist_ok=True)
    pictures = VaeImageProcessor.pt_to_numpy(images.float().cpu())
    pictures = VaeImageProcessor.numpy_to_pil(pictures)
    if len(pictures) == 1:
        pictures[0].save(out_dir / "image.png")
        return
    for index, picture in enumerate(pictures):
        picture.save(out_dir / f"image-{index:03d}.png")
    columns = min(len(pictures), 4)
    rows = -(-len(pictures) // columns)
    blank = [pictures[0].copy().point(lambda _: 0) for _ in range(rows * columns - len(pictures))]
    make_image_grid(pictures + blank, rows, columns).save(out_dir / "grid.png")


def write_pipeline_metrics(result: RunResult, prompts: list[str], labels: dict, policy_name: str) -> None:
    """``device_map.json`` and ``metrics.json`` (labels, prompts, figures, whether the images equal in memory)."""
    out = result.output_dir
    (out / "device_map.json").write_text(json.dumps(result.device_map, indent=1))
    payload = {
        **labels,
        "hook": policy_name,
        "prompts": prompts,
        "matches_in_memory": result.matches_in_memory,
        **result.figures,
        "devices": result.summary["devices"],
    }
    (out / "metrics.json").write_text(json.dumps(payload, indent=1, default=str))
