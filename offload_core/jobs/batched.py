"""A run over a prompts file: every prompt generated in batches through one dispatched model, each batch journaled
as it ends (so an interrupted run can resume), with ``generations.jsonl`` and ``metrics.json`` in the run folder."""

from __future__ import annotations

from typing import Any

from offload_core.runner.console import print_line
from offload_core.runner.inputs import decode
from offload_core.jobs.batch import batch_figures, generate_batches, print_generations
from offload_core.jobs.context import loaded
from offload_core.jobs.disk_reads import DiskReads
from offload_core.jobs.journal import Journal, fingerprint
from offload_core.jobs.results import RunResult, per_token_counters, write_outputs
from offload_core.plan import learn
from offload_core.plan.batches import Batches
from offload_core.plan.prepare import Prepared
from offload_core.values import format_size


def run_batched(job: Prepared, labels: dict) -> RunResult:
    """Dispatch once, generate every prompt in batches, measure, compare with memory when asked, write and print."""
    settings, run_model, plan, batches = job.settings, job.run_model, job.plan, job.batches
    journal = Journal.open(
        settings.output_dir,
        batches.prompts,
        batches.batch_size,
        fingerprint(settings, batches.prompts),
        resume=bool(settings.resume),
    )
    done = len(journal.done)
    if settings.resume:
        print(f"resuming {settings.output_dir}: {done} of {len(batches.prompts)} prompts were generated")

    def finished(start: int, rows: list[list[int]]) -> None:
        journal.append(
            [
                {"prompt": batches.prompts[start + i], "text": decode(run_model.tokenizer, row), "token_ids": row}
                for i, row in enumerate(rows)
            ]
        )

    with loaded(job) as run:
        try:
            with DiskReads(run_model.model) as reads:
                generated = generate_batches(
                    run_model.model,
                    batches.encoded,
                    batches.batch_size,
                    settings.sampling,
                    settings.execution_device,
                    settings.progress,
                    done,
                    finished,
                )
        except KeyboardInterrupt:
            journal.close()
            kept = journal.path.read_bytes().count(b"\n")
            print_line(f"{kept} finished prompts are in {journal.path}; go on with resume={settings.output_dir}")
            raise
        finally:
            journal.close()
        figures = {**batch_figures(generated, run.state.stats.snapshot(), batches.batch_size), **reads.figures()}
        figures.update(offloaded_bytes=run.state.offloaded_bytes(), load_s=run.load_s)
        counters = run.state.handle.counters()
        if counters:
            figures[job.strategies.policy_name] = per_token_counters(counters, generated.generated)
    figures.update(
        peak_anon_rss_bytes=run.memory.anon_delta,
        peak_file_rss_bytes=run.memory.file_delta,
        planned_kv_cache_bytes=batches.memory.kv_cache,
        planned_activation_bytes=batches.memory.activations,
        **plan.predicted_time,
    )
    figures.update(learn.record(job, figures))
    tokens = [r["token_ids"] for r in journal.done] + generated.tokens
    texts = [r["text"] for r in journal.done] + [decode(run_model.tokenizer, row) for row in generated.tokens]
    result = RunResult.of_plan(plan, settings.output_dir, figures, texts[0], tokens[0])
    if settings.compare_in_memory:
        same = [a == b for a, b in zip(tokens, in_memory_batches(job, batches))]
        journal.rewrite(
            [
                {"prompt": p, "text": t, "token_ids": ids, "matches_in_memory": m}
                for p, t, ids, m in zip(batches.prompts, texts, tokens, same)
            ]
        )
        result.matches_in_memory = all(same)
    write_outputs(result, settings.prompts_file, labels)
    print_generations(batches.prompts, texts)
    print_batch_result(result)
    learn.print_comparison(figures)
    return result


def in_memory_batches(job: Prepared, batches: Batches) -> list[list[int]]:
    """Each prompt's tokens from the reference model (:func:`offload_core.jobs.generate.reference_model`) on the
    run's execution device, in the same batches."""
    from offload_core.jobs.generate import reference_model

    run_model = job.run_model
    model = reference_model(run_model.checkpoint_dir, run_model.task, run_model.dtype, job.settings.execution_device)
    device = next(model.parameters()).device  # the cpu where the model does not fit on the GPU
    run = generate_batches(model, batches.encoded, batches.batch_size, job.settings.sampling, device)
    del model
    return run.tokens


def print_batch_result(result: Any) -> None:
    """Print the batch's figures (throughput, latency, bytes moved, memory) and where the outputs went."""
    f = result.figures
    print(
        f"\n{f['prompts']} prompts in batches of {f['batch_size']}: {f['aggregate_tokens_per_s']:.1f} tok/s aggregate "
        f"| latency median {f['latency_median_s']:.2f} s, p90 {f['latency_p90_s']:.2f} s | load {f['load_s']:.2f} s | "
        f"moved {format_size(int(f['bytes_moved_per_token']))}/token | peak anon RSS "
        f"+{format_size(f['peak_anon_rss_bytes'])} (planned KV cache {format_size(f['planned_kv_cache_bytes'])})"
    )
    if result.matches_in_memory is not None:
        print(f"same tokens as in memory, every prompt: {result.matches_in_memory}")
    print(f"wrote {result.output_dir / 'generations.jsonl'}, metrics.json and device_map.json")
