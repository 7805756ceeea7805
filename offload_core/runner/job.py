"""One run, step by step: settings, strategies, the prepared plan, then the mode that dispatches, runs and reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offload_core.loading.pipeline import is_pipeline_folder
from offload_core.jobs.batched import run_batched
from offload_core.jobs.encoder import run_encoder
from offload_core.jobs.results import RunResult, write_outputs
from offload_core.jobs.single import run_single
from offload_core.plan import speculate
from offload_core.plan.busy import busy_notice
from offload_core.plan.dequant import dequant_lines
from offload_core.plan.run_plan import print_plan, write_plan
from offload_core.plan.predict import print_prediction
from offload_core.plan.prepare import Prepared, prediction_shape, prepare
from offload_core.runner.settings import build_strategies, read_settings
from offload_core.storage.residency import offloaded_in_plan


def run(cfg: Any, output_dir: str | Path | None = None, labels: dict | None = None, plot: bool = True) -> RunResult:
    """Run one job from a composed config (``run.py`` calls this; tests call it directly).

    ``plot=False`` leaves out ``placement.png`` in a ``plan_only`` run (a caller that only wants the plan).
    """
    from offload_core.loading.allocator import return_freed_memory_to_os

    return_freed_memory_to_os()
    busy_notice()  # first, where a busy machine's hint helps most (said once a process)
    labels = labels or {}
    settings = read_settings(cfg, output_dir)
    pipeline = is_pipeline_folder(settings.model.get("path"))
    if settings.auto and pipeline:
        print("auto=true predicts transformers models only; the pipeline runs as configured")
    elif settings.auto:
        settings, labels = choose_configuration(settings, labels)
    strategies = build_strategies(settings)
    if pipeline:
        from offload_core.jobs.pipeline_job import run_pipeline

        return run_pipeline(settings, strategies, labels)
    batches_of, serve = None, settings.mode == "serve"
    if serve:  # planned for the requests served at once, each holding serve.context tokens
        from offload_core.serve.options import read_options, serving_settings, slots_of

        settings = serving_settings(settings)
        batches_of = slots_of(settings, read_options(settings.sections["serve"]))
    # a server's step time depends on its traffic: it starts without measuring the machine for a prediction
    predict = not serve or settings.plan_only or settings.calibrate
    with prepare(settings, strategies, batches_of=batches_of, predict=predict) as job:
        report_plan(job)
        if job.settings.plan_only:
            return plan_only(job, labels, plot)
        if serve:
            from offload_core.serve.mode import run_serve

            return run_serve(job, labels)
        if not job.generates:
            return run_encoder(job, labels)
        if job.settings.prompts_file:
            return run_batched(job, labels)
        return run_single(job, labels)


def choose_configuration(settings: Any, labels: dict) -> tuple[Any, dict]:
    """``auto=true``: the settings of the configuration predicted fastest, and the labels saying what was picked."""
    from offload_core.plan.auto import choose

    settings, table = choose(settings, list(labels.get("overrides", [])))
    choices = {
        **labels.get("choices", {}),
        "storage": settings.sections["storage"]["name"],
        "hook": settings.sections["hook"]["name"],
    }
    return settings, {**labels, "choices": choices, "auto": table[0]["configuration"] if table else None}


def report_plan(job: Prepared) -> None:
    """Print the plan, its predicted times and what a speculation holds resident and expects."""
    print_plan(job.settings, job.strategies, job.plan, job.per)
    if job.generates:
        print_prediction(job.plan.predicted_time, prediction_shape(job)[0])
    for line in dequant_lines(job.plan.dequant, job.per):
        print(line)
    for line in speculate.plan_lines(job.settings.speculative, job.held, job.plan.predicted_time):
        print(line)


def plan_only(job: Prepared, labels: dict, plot: bool) -> RunResult:
    """Write the plan (``device_map.json``, with ``plot`` ``placement.png``) and its figures; nothing is loaded."""
    settings, plan = job.settings, job.plan
    write_plan(settings, job.run_model, plan, picture=plot)
    figures = {
        "plan_only": True,
        "offloaded_bytes": offloaded_in_plan(plan.summary, settings.execution_device),
        "headroom_bytes": plan.headroom,
        "predicted_bytes_per_token": plan.predicted_bytes_per_token,
        **plan.predicted_time,
    }
    if plan.dequant:
        figures["predicted_dequant_by_type"] = plan.dequant
    result = RunResult.of_plan(plan, settings.output_dir, figures)
    write_outputs(result, settings.prompts_file or settings.prompt, labels)
    return result
