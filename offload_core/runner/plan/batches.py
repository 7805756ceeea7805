"""A run over a prompts file: the batch's memory held back from the budget, then every prompt generated in batches
through one dispatched model, with ``generations.jsonl`` and ``metrics.json`` written to the run folder."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from offload_core.errors import ConfigError
from offload_core.planning.batch_memory import BatchMemory
from offload_core.runner.modes.batch import batch_figures, encode_all, generate_batches, print_generations, read_prompts
from offload_core.runner.modes.journal import Journal, fingerprint
from offload_core.runner.plan.run_memory import forward_headroom, plan_run_memory
from offload_core.runner.settings import Settings
from offload_core.values import format_size


@dataclasses.dataclass(frozen=True)
class Batches:
    """The prompts of a run, as text and as token ids, the batch size they are generated in and, once planned, the
    memory the batch needs."""

    prompts: list[str]
    encoded: list[list[int]]
    batch_size: int
    memory: BatchMemory | None = None

    @property
    def longest(self) -> int:
        return max(len(row) for row in self.encoded)

    @property
    def width(self) -> int:
        """The padded prompt length of a typical batch: the median over the batches of each one's longest prompt."""
        size = self.batch_size
        return int(statistics.median_low(max(len(row) for row in self.encoded[i:i + size])
                                         for i in range(0, len(self.encoded), size)))

    @property
    def rows(self) -> int:
        """Sequences generated at once: the batch size, or fewer when there are fewer prompts."""
        return min(self.batch_size, len(self.prompts))


def read_batches(settings: Settings, run_model: Any) -> tuple[Settings, Batches | None]:
    """The prompts a generating run generates after, tokenised, in batches: the ``prompts`` file in batches of
    ``batch_size``, or ``prompt`` as a batch of one; their memory planned (:func:`plan_run_memory`, which resolves
    ``headroom=auto``). A run that does not generate gets None and, under ``headroom=auto``, a fixed headroom."""
    from offload_core.loading.tasks import GENERATIVE

    cfg = settings.cfg
    if cfg.get("resume") and not cfg.get("prompts"):
        raise ConfigError("resume goes on with a prompts run: give the same prompts=<file> (and settings) as the run "
                          "you resume")
    if run_model.task not in GENERATIVE:
        return forward_headroom(settings), None
    chat = bool(cfg.model.get("chat_template", True))
    if not cfg.get("prompts"):
        batches = Batches([str(cfg.prompt)], encode_all(run_model, [str(cfg.prompt)], chat), 1)
    else:
        if cfg.get("resume"):  # the earlier run's folder: its generations go on there
            settings = dataclasses.replace(settings, output_dir=resume_folder(cfg.resume))
        batch_size = int(cfg.batch_size)
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be at least 1")
        prompts = read_prompts(cfg.prompts)
        batches = Batches(prompts, encode_all(run_model, prompts, chat), batch_size)
    settings, need = plan_run_memory(settings, run_model, batches.rows, batches.longest)
    return settings, dataclasses.replace(batches, memory=need)


def resume_folder(value: Any) -> "Path":
    """``resume``'s run folder, which must exist."""
    from pathlib import Path

    folder = Path(str(value)).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"resume={value} is not a folder: give the folder of the run to go on with "
                          "(e.g. resume=outputs/2026-01-31/12-00-00)")
    return folder


def run_batched(settings: Settings, strategies: Any, run_model: Any, checkpoint: Any, plan: Any, batches: Batches,
                labels: dict) -> Any:
    """Dispatch once, generate every prompt in batches, measure, compare with memory when asked, write and print."""
    from offload_core.runner.job import dispatched
    from offload_core.runner.modes.disk_reads import DiskReads
    from offload_core.runner.modes.metrics import MemoryMonitor
    from offload_core.runner.modes.results import RunResult, per_token_counters, write_outputs

    cfg, device = settings.cfg, settings.execution_device
    journal = Journal.open(settings.output_dir, batches.prompts, batches.batch_size, fingerprint(cfg, batches.prompts),
                           resume=bool(cfg.get("resume")))
    done = len(journal.done)
    if cfg.get("resume"):
        print(f"resuming {settings.output_dir}: {done} of {len(batches.prompts)} prompts were generated")

    def finished(start: int, rows: list[list[int]]) -> None:
        journal.append([{"prompt": batches.prompts[start + i], "text": decode_row(run_model, row), "token_ids": row}
                        for i, row in enumerate(rows)])

    with MemoryMonitor() as memory:
        started = time.perf_counter()
        with dispatched(settings, strategies, run_model, checkpoint, plan) as state:
            load_s = time.perf_counter() - started
            state.stats.reset()
            try:
                with DiskReads(run_model.model) as reads:
                    run = generate_batches(run_model.model, batches.encoded, batches.batch_size, cfg, device,
                                           bool(cfg.progress), done, finished)
            except KeyboardInterrupt:
                journal.close()
                from offload_core.runner.cli import print_line

                kept = journal.path.read_bytes().count(b"\n")
                print_line(f"{kept} finished prompts are in {journal.path}; go on with resume={settings.output_dir}")
                raise
            finally:
                journal.close()
            figures = {**batch_figures(run, state.stats.snapshot(), batches.batch_size), **reads.figures()}
            figures.update(offloaded_bytes=state.offloaded_bytes(), load_s=load_s)
            counters = state.handle.counters()
            if counters:
                figures[strategies.names["hook"]] = per_token_counters(counters, run.generated)
    figures.update(peak_anon_rss_bytes=memory.anon_delta, peak_file_rss_bytes=memory.file_delta,
                   planned_kv_cache_bytes=batches.memory.kv_cache, planned_activation_bytes=batches.memory.activations,
                   **plan.predicted_time)
    tokens = [r["token_ids"] for r in journal.done] + run.tokens
    texts = [r["text"] for r in journal.done] + [decode_row(run_model, row) for row in run.tokens]
    same = None
    if cfg.compare_in_memory:
        reference = in_memory_batches(run_model, batches, cfg, settings.execution_device)
        same = [a == b for a, b in zip(tokens, reference)]
        journal.rewrite([{"prompt": p, "text": t, "token_ids": ids, "matches_in_memory": m}
                         for p, t, ids, m in zip(batches.prompts, texts, tokens, same)])
    result = RunResult(texts[0], tokens[0], plan.device_map, figures, plan.summary,
                       None if same is None else all(same), settings.output_dir, plan.as_dict())
    write_outputs(result, str(cfg.prompts), labels, strategies.names["hook"])
    print_generations(batches.prompts, texts)
    print_batch_result(result)
    return result


def in_memory_batches(run_model: Any, batches: Batches, cfg: Any, device: Any) -> list[list[int]]:
    """Each prompt's tokens from the reference model (:func:`offload_core.runner.modes.generate.reference_model`) on the
    run's ``device``, in the same batches."""
    from offload_core.runner.modes.generate import reference_model

    model = reference_model(run_model.checkpoint_dir, run_model.task, run_model.dtype, device)
    device = next(model.parameters()).device  # the cpu where the model does not fit on the GPU
    run = generate_batches(model, batches.encoded, batches.batch_size, cfg, device)
    del model
    return run.tokens


def decode_row(run_model: Any, tokens: list[int]) -> str:
    tokenizer = run_model.tokenizer
    return tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, tokens))


def print_batch_result(result: Any) -> None:
    """Print the batch's figures (throughput, latency, bytes moved, memory) and where the outputs went."""
    f = result.figures
    print(
        f"\n{f['prompts']} prompts in batches of {f['batch_size']}: {f['aggregate_tokens_per_s']:.1f} tok/s aggregate | "
        f"latency median {f['latency_median_s']:.2f} s, p90 {f['latency_p90_s']:.2f} s | load {f['load_s']:.2f} s | "
        f"moved {format_size(int(f['bytes_moved_per_token']))}/token | peak anon RSS +{format_size(f['peak_anon_rss_bytes'])} "
        f"(planned KV cache {format_size(f['planned_kv_cache_bytes'])})"
    )
    if result.matches_in_memory is not None:
        print(f"same tokens as in memory, every prompt: {result.matches_in_memory}")
    print(f"wrote {result.output_dir / 'generations.jsonl'}, metrics.json and device_map.json")
