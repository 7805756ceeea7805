"""A run that generates from one prompt: dispatched and measured, the tokens generated (with the speculation asked),
compared with the in-memory model when asked, printed and written to the run folder."""

from __future__ import annotations

from typing import Any

from offload_core.runner.console import print_line
from offload_core.runner.inputs import decode
from offload_core.jobs.context import loaded
from offload_core.jobs.disk_reads import DiskReads
from offload_core.jobs.generate import generate, in_memory_tokens
from offload_core.jobs.results import RunResult, generation_figures, print_result, write_outputs
from offload_core.plan import learn, speculate
from offload_core.plan.prepare import Prepared


def run_single(job: Prepared, labels: dict) -> RunResult:
    """Generate after the run's prompt through the dispatched model, measure, compare, write and print; interrupted
    while generating, keep what was generated (:func:`keep_partial`) and go on interrupting."""
    settings, run_model, plan = job.settings, job.run_model, job.plan
    try:
        tokens, figures = generate_offloaded(job)
    except KeyboardInterrupt as stop:
        keep_partial(job, labels, getattr(stop, "generated", None) or [[]])
        raise
    figures.update(learn.record(job, figures))
    result = RunResult.of_plan(plan, settings.output_dir, figures, decode(run_model.tokenizer, tokens), tokens)
    if settings.compare_in_memory:
        compare_in_memory(job, tokens, result)
    write_outputs(result, settings.prompt, labels)
    print_result(result, job.strategies.policy_name)
    learn.print_comparison(figures)
    return result


def generate_offloaded(job: Prepared) -> tuple[list[int], dict[str, Any]]:
    """Dispatch, generate from the prompt (with the speculation the settings ask) and measure: the new token ids and
    the run's figures, the planned memory and predicted times among them."""
    from offload_core.speculative import prepare

    settings, model = job.settings, job.run_model.model
    memory_plan = job.batches.memory
    with loaded(
        job, lambda model: prepare(settings.speculative, model, job.run_model.dtype, settings.execution_device)
    ) as run:
        speculation = run.ready
        with DiskReads(model) as reads:
            tokens, timer = generate(
                model, job.input_ids, settings.sampling, settings.execution_device, speculation, settings.progress
            )
        figures = generation_figures(run.state, tokens, timer, run.load_s, job.strategies.policy_name)
        figures = {**figures, **reads.figures(), **speculation.figures(len(tokens))}
        figures.update(speculate.per_generated_token(figures))
    figures.update(
        peak_anon_rss_bytes=run.memory.anon_delta,
        peak_file_rss_bytes=run.memory.file_delta,
        planned_kv_cache_bytes=memory_plan.kv_cache,
        planned_activation_bytes=memory_plan.activations,
        **job.plan.predicted_time,
    )
    rate = figures["decode_tokens_per_s"]
    figures["time_per_decode_step_s"] = 1 / rate if rate else float("nan")
    return tokens, figures


def compare_in_memory(job: Prepared, tokens: list[int], result: RunResult) -> None:
    """The in-memory model's tokens on the same prompt (and, with speculation, under the same speculation)."""
    settings, run_model = job.settings, job.run_model

    def reference(speculative: Any = None, replay: str | None = None) -> list[int]:
        return in_memory_tokens(run_model, job.input_ids, settings, speculative, replay)

    figures = result.figures
    figures["in_memory_tokens"] = reference()
    result.matches_in_memory = figures["in_memory_tokens"] == tokens
    speculate.compare(figures, settings.speculative, tokens, reference)


def keep_partial(job: Prepared, labels: dict, rows: list[list[int]]) -> None:
    """An answer cut short by Ctrl-C (or SIGTERM) while generating: printed, and written as the run's ``metrics.json``
    marked ``"interrupted": true`` (with ``device_map.json``); nothing when no token was made yet."""
    tokens = rows[0]
    if not tokens:
        return
    settings = job.settings
    text = decode(job.run_model.tokenizer, tokens)
    figures = {"interrupted": True, "generated_tokens": len(tokens), "max_new_tokens": settings.sampling.max_new_tokens}
    write_outputs(RunResult.of_plan(job.plan, settings.output_dir, figures, text, tokens), settings.prompt, labels)
    print(f"\n{text}\n", flush=True)
    print_line(
        f"interrupted after {len(tokens)} of {settings.sampling.max_new_tokens} new tokens: the partial answer is "
        f'above and in {settings.output_dir / "metrics.json"} ("interrupted": true)'
    )
