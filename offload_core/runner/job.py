"""One run, step by step: settings, strategies, model and checkpoint, plan, dispatch, generate, report."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from offload_core import devices
from offload_core.errors import ConfigError
from offload_core.loading.pipeline import is_pipeline_folder
from offload_core.loading.tasks import GENERATIVE, check_task_fits
from offload_core.runner.plan.batches import read_batches, run_batched
from offload_core.runner.modes.encoder import run_encoder
from offload_core.runner.modes.generate import generate, in_memory_tokens, prompt_ids
from offload_core.runner.plan.model import RunModel, open_model
from offload_core.runner.plan.plan import Plan, make_plan, print_plan, write_plan
from offload_core.runner.modes.results import RunResult, generation_figures, print_result, write_outputs
from offload_core.runner.settings import Settings, Strategies, build_strategies, read_settings
from offload_core.runner.plan import speculate


def run(cfg: Any, output_dir: str | Path | None = None, labels: dict | None = None, plot: bool = True) -> RunResult:
    """Run one job from a composed config (``run.py`` calls this; tests call it directly).

    ``plot=False`` leaves out ``placement.png`` in a ``plan_only`` run (a caller that only wants the plan).
    """
    from offload_core.loading.allocator import return_freed_memory_to_os
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.runner.modes.metrics import MemoryMonitor

    return_freed_memory_to_os()
    settings = read_settings(cfg, output_dir)
    spec = speculate.run_speculative(cfg)
    strategies = build_strategies(settings)
    if is_pipeline_folder(settings.model.get("path")):
        from offload_core.runner.modes.pipeline_job import run_pipeline

        return run_pipeline(settings, strategies, labels or {})
    run_model = open_model(settings.model, settings.dtype)
    with Checkpoint.open(run_model.checkpoint_dir) as checkpoint:
        check_run_task(cfg, run_model, checkpoint)
        settings, batches = read_batches(settings, run_model)
        speculate.check_batches(spec, batches if cfg.get("prompts") else None)
        input_ids = prompt_ids(run_model.tokenizer, cfg.prompt, settings.model.get("chat_template", True),
                               run_model.model.config.vocab_size)
        settings, held = speculate.reserve_speculation(settings, spec, run_model, input_ids.shape[1])
        plan = make_plan(settings, strategies, run_model, checkpoint)
        speculate.check_self_resident(spec, run_model, plan.device_map, settings.execution_device)
        print_plan(settings, strategies, plan, "generated token" if run_model.task in GENERATIVE else "forward")
        plan.predicted_time = predicted_time(settings, strategies, run_model, plan, batches, input_ids.shape[1])
        plan.predicted_time.update(speculate.predicted(spec, plan.predicted_time))
        for line in speculate.plan_lines(spec, held, plan.predicted_time):
            print(line)
        if cfg.plan_only:
            write_plan(settings, run_model, plan, picture=plot)
            result = RunResult("", [], plan.device_map, plan_figures(plan, settings), plan.summary, None,
                               settings.output_dir, plan.as_dict())
            write_outputs(result, str(cfg.prompts or cfg.prompt), labels or {}, strategies.names["hook"])
            return result
        if run_model.task not in GENERATIVE:
            return run_encoder(settings, strategies, run_model, checkpoint, plan, labels or {})
        if cfg.get("prompts"):
            return run_batched(settings, strategies, run_model, checkpoint, plan, batches, labels or {})
        with MemoryMonitor() as memory:
            tokens, figures = generate_offloaded(settings, strategies, run_model, checkpoint, plan, input_ids, spec)
        figures.update(peak_anon_rss_bytes=memory.anon_delta, peak_file_rss_bytes=memory.file_delta,
                       planned_kv_cache_bytes=batches.memory.kv_cache, planned_activation_bytes=batches.memory.activations,
                       **plan.predicted_time)
        figures["time_per_decode_step_s"] = 1 / figures["decode_tokens_per_s"] if figures["decode_tokens_per_s"] else float("nan")
    result = RunResult(decode(run_model, tokens), tokens, plan.device_map, figures, plan.summary, None, settings.output_dir,
                       plan.as_dict())
    if cfg.compare_in_memory:
        figures["in_memory_tokens"] = in_memory_tokens(run_model.checkpoint_dir, run_model.dtype, input_ids, cfg, run_model.task,
                                                       settings.execution_device)
        result.matches_in_memory = figures["in_memory_tokens"] == tokens
        speculate.compare(figures, spec, tokens, lambda same: in_memory_tokens(run_model.checkpoint_dir, run_model.dtype,
                                                                               input_ids, cfg, run_model.task,
                                                                               settings.execution_device, same))
    write_outputs(result, cfg.prompt, labels or {}, strategies.names["hook"])
    print_result(result, strategies.names["hook"])
    return result


def plan_figures(plan: Plan, settings: Settings) -> dict[str, Any]:
    """What a plan-only run records as its metrics (a sweep's summary compares them): the prediction and the bytes
    offloaded, held back and predicted to move per generated token."""
    from offload_core.values import is_offloaded

    offloaded = sum(info["bytes"] for dev, info in plan.summary["devices"].items()
                    if is_offloaded(dev, settings.execution_device))
    return {"plan_only": True, "offloaded_bytes": offloaded, "headroom_bytes": plan.headroom,
            "predicted_bytes_per_token": plan.predicted_bytes_per_token, **plan.predicted_time}


def check_run_task(cfg: Any, run_model: RunModel, checkpoint: Any) -> None:
    """Before planning: a ``model.task`` the checkpoint lacks weights for is one line naming the task, ``texts``
    belong to the tasks that read texts (a generating run reads ``prompt``) and ``prompts`` to the generating ones."""
    if run_model.task_given:
        check_task_fits(run_model.model, checkpoint, run_model.task)
    if run_model.task in GENERATIVE and cfg.get("texts"):
        raise ConfigError(f"texts is read by masked_lm, sequence_classification and embeddings runs; this {run_model.task} "
                          "run generates from prompt: set prompt=... instead")
    if run_model.task not in GENERATIVE and cfg.get("prompts"):
        raise ConfigError(f"prompts is read by causal_lm and seq2seq_lm runs, which generate; this {run_model.task} run reads "
                          "texts: set texts=[...] instead")


@contextmanager
def dispatched(settings: Settings, strategies: Strategies, run_model: RunModel, checkpoint: Any, plan: Plan) -> Iterator[Any]:
    """Load ``checkpoint`` into the model as ``plan`` places it, with the run's storage and policy; yields
    the model's ``offload_state`` and, however the block ends, drops every loaded unit and closes the store."""
    from offload_core.loading.dispatch import load_checkpoint_and_dispatch

    cfg = settings.cfg
    load_checkpoint_and_dispatch(run_model.model, checkpoint, plan.device_map, no_split_module_classes=run_model.no_split,
                                 storage=strategies.storage, policy=strategies.policy, offload_folder=cfg.offload_folder,
                                 dtype=run_model.dtype, execution_device=settings.execution_device, progress=cfg.progress,
                                 offload_buffers=strategies.policy.offload_buffers,
                                 residency=plan.residency())
    with run_model.model.offload_state as state:
        yield state


def generate_offloaded(settings: Settings, strategies: Strategies, run_model: RunModel, checkpoint: Any, plan: Plan,
                       input_ids: torch.Tensor, spec: Any = None) -> tuple[list[int], dict[str, Any]]:
    """Dispatch, generate from ``input_ids`` (with the speculation ``spec`` asks) and measure: the new token ids and
    the run's figures."""
    from offload_core.runner.modes.disk_reads import DiskReads
    from offload_core.speculative import prepare

    started = time.perf_counter()
    with dispatched(settings, strategies, run_model, checkpoint, plan) as state:
        speculation = prepare(spec, run_model.model, run_model.dtype, settings.execution_device)
        load_s = time.perf_counter() - started
        state.stats.reset()
        if devices.is_accelerator(settings.execution_device):
            accelerator = devices.active()
            for index in range(accelerator.count()):
                accelerator.reset_peak_memory_stats(index)
        with DiskReads(run_model.model) as reads:
            tokens, timer = generate(run_model.model, input_ids, settings.cfg, settings.execution_device, speculation)
        figures = generation_figures(state, tokens, timer, load_s, strategies.names["hook"])
        figures = {**figures, **reads.figures(), **speculation.figures(len(tokens))}
        return tokens, {**figures, **speculate.per_generated_token(figures)}


def predicted_time(settings: Settings, strategies: Strategies, run_model: RunModel, plan: Plan, batches: Any,
                   prompt_tokens: int) -> dict[str, float]:
    """The plan's predicted times (printed) for the run's batch, or the single prompt of ``prompt_tokens`` tokens."""
    from offload_core.runner.plan.predict import calibrate_and_predict, print_prediction

    if run_model.task not in GENERATIVE:  # one forward over the texts: no decoding step to predict
        return {}
    rows, tokens = (batches.rows, batches.width) if batches is not None else (1, prompt_tokens)
    predicted = calibrate_and_predict(settings, strategies, run_model, plan, rows, tokens)
    print_prediction(predicted, rows)
    return predicted


def decode(run_model: RunModel, tokens: list[int]) -> str:
    """The generated tokens as text (ids joined by spaces for a model without a tokenizer)."""
    tokenizer = run_model.tokenizer
    return tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, tokens))
