"""Batched generation: prompts read from a file, tokenised and padded on the left, generated in batches through
one dispatched model, each prompt's output written to ``generations.jsonl`` with throughput and latency figures."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from offload_core.errors import ConfigError
from offload_core.runner.generate import generate_rows, pad_token_id, prompt_ids


def read_prompts(path: str | Path) -> list[str]:
    """The prompts in ``path``: one per line, or JSON lines each holding a ``prompt`` string; blank lines are skipped."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"prompts={str(path)!r} cannot be read ({exc.strerror}); give a text file with one prompt per line") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ConfigError(f"prompts file {str(path)!r} line {number} is not a JSON object with a \"prompt\" string; fix that line")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"prompts file {str(path)!r} holds no prompt; write one prompt per line")
    return prompts


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of token ids as one (batch, longest) tensor padded on the left with ``pad_id``, and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def trim(tokens: list[int], eos: set[int]) -> list[int]:
    """A row's new tokens up to and including its first end-of-sequence token (generation pads after it)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


@dataclass
class BatchRun:
    """What a batched generation produced: each prompt's new tokens, its latency (its batch's wall time), and per
    batch the time to first token, the time per decoding step and the batch size."""

    tokens: list[list[int]]
    latencies: list[float]
    first_token_s: list[float]
    step_s: list[float]
    seconds: float

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


def generate_batches(model, encoded: list[list[int]], batch_size: int, cfg: Any, device: torch.device,
                     progress: bool = False) -> BatchRun:
    """Generate after every row of ``encoded`` in consecutive batches of ``batch_size`` (a progress bar over prompts)."""
    pad = pad_token_id(model)
    pad = 0 if pad is None else int(pad)
    eos = eos_ids(model)
    run = BatchRun([], [], [], [], 0.0)
    bar = tqdm(total=len(encoded), desc="prompts", unit="prompt", disable=not progress)
    try:
        for start in range(0, len(encoded), batch_size):
            ids, mask = left_padded(encoded[start:start + batch_size], pad)
            began = time.perf_counter()
            rows, timer = generate_rows(model, ids, mask, cfg, device)
            took = time.perf_counter() - began
            run.seconds += took
            run.tokens += [trim(row, eos) for row in rows]
            run.latencies += [took] * len(rows)
            run.first_token_s.append(timer.time_to_first_token)
            if len(timer.stamps) > 1:
                run.step_s.append((timer.stamps[-1] - timer.stamps[0]) / (len(timer.stamps) - 1))
            bar.update(len(rows))
    finally:
        bar.close()
    return run


def encode_all(run_model: Any, prompts: list[str], chat: bool) -> list[list[int]]:
    """Each prompt as token ids (the chat template where asked; a deterministic id per byte for a synthetic model)."""
    vocab = run_model.model.config.vocab_size
    return [prompt_ids(run_model.tokenizer, p, chat, vocab)[0].tolist() for p in prompts]


def p90(values: list[float]) -> float:
    """The 90th percentile of ``values`` (linear interpolation); NaN for none."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def batch_figures(run: BatchRun, moved: dict[str, int], batch_size: int) -> dict[str, Any]:
    """The figures of a batched generation: aggregate tokens/s, latency median and p90, bytes moved per generated token."""
    count = max(run.generated, 1)
    step = statistics.median(run.step_s) if run.step_s else float("nan")
    return {
        "prompts": len(run.tokens),
        "batch_size": batch_size,
        "generated_tokens": run.generated,
        "aggregate_tokens_per_s": run.generated / run.seconds if run.seconds else float("nan"),
        "latency_median_s": statistics.median(run.latencies) if run.latencies else float("nan"),
        "latency_p90_s": p90(run.latencies),
        "time_to_first_token_s": statistics.median(run.first_token_s) if run.first_token_s else float("nan"),
        "time_per_decode_step_s": step,
        "decode_tokens_per_s": batch_size / step if step == step and step > 0 else float("nan"),
        "bytes_moved_per_token": moved["bytes"] / count,
        "transfers_per_token": moved["loads"] / count,
    }


def write_generations(out_dir: Path, prompts: list[str], texts: list[str], tokens: list[list[int]],
                      same: list[bool] | None) -> Path:
    """Write one JSON line per prompt (prompt, text, token ids, and whether it matches the in-memory model)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "generations.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, (prompt, text, ids) in enumerate(zip(prompts, texts, tokens)):
            record = {"prompt": prompt, "text": text, "token_ids": ids}
            if same is not None:
                record["matches_in_memory"] = same[i]
            f.write(json.dumps(record) + "\n")
    return path


def print_generations(prompts: list[str], texts: list[str], shown: int = 3) -> None:
    """Print the first ``shown`` prompts with their outputs, and how many more there are."""
    for prompt, text in list(zip(prompts, texts))[:shown]:
        print(f"\n> {' '.join(prompt.split())}\n{text.strip()}")
    if len(prompts) > shown:
        print(f"\n… and {len(prompts) - shown} more in generations.jsonl")
