"""Runs of the tasks that read texts instead of generating (masked LM, sequence classification, embeddings): one
forward over the texts, the result printed and written to the run folder, and the in-memory reference compared."""

from __future__ import annotations

import time
from typing import Any

import torch

from offload_core.errors import ConfigError
from offload_core.runner.plan.model import RunModel
from offload_core.runner.modes.results import RunResult, write_outputs
from offload_core.values import format_size


def run_texts(cfg: Any) -> list[str]:
    """The texts an encoder run reads: ``texts``, else the one ``prompt``."""
    texts = cfg.get("texts")
    texts = [str(text) for text in texts] if texts else [str(cfg.prompt)]
    if not all(texts):
        raise ConfigError("texts holds an empty text: give non-empty texts, e.g. texts='[first text,second text]'")
    return texts


def encode_texts(run_model: RunModel, texts: list[str]) -> dict[str, torch.Tensor]:
    """``texts`` as a padded batch (``input_ids``, ``attention_mask``); a model without a tokenizer gets one id per byte."""
    tokenizer = run_model.tokenizer
    if tokenizer is not None:
        return dict(tokenizer(texts, padding=True, return_tensors="pt"))
    vocab = run_model.model.config.vocab_size
    rows = [[1 + b % (vocab - 1) for b in text.encode()] for text in texts]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def task_output(model: Any, task: str, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The task's result on ``batch``: mean-pooled, L2-normalised embeddings, else the logits."""
    batch = {name: value.to(device) for name, value in batch.items()}
    with torch.inference_mode():
        out = model(**batch)
    if task != "embeddings":
        return out.logits.float().cpu()
    hidden = out.last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).float().cpu()


def describe(run_model: RunModel, task: str, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[str, dict[str, Any]]:
    """What the run prints (a few lines) and the figures it records for ``output``."""
    if task == "embeddings":
        norms = output.norm(dim=-1).tolist()
        lines = [f"embeddings: shape {list(output.shape)}, norms {', '.join(f'{n:.4f}' for n in norms)}"]
        figures: dict[str, Any] = {"embedding_shape": list(output.shape), "embedding_norms": norms}
        if output.shape[0] > 1:
            cosine = (output @ output.T).tolist()
            lines += ["cosine similarities:"] + ["  " + " ".join(f"{v:+.4f}" for v in row) for row in cosine]
            figures["cosine_similarities"] = cosine
        return "\n".join(lines), figures
    if task == "sequence_classification":
        probs = output.softmax(-1)
        labels = getattr(run_model.model.config, "id2label", None) or {}
        picked = probs.argmax(-1).tolist()
        names = [labels.get(i, str(i)) for i in picked]
        lines = [f"text {i}: {name} (p={probs[i, j]:.4f})" for i, (j, name) in enumerate(zip(picked, names))]
        return "\n".join(lines), {"labels": names, "probabilities": probs.tolist()}
    # masked_lm: the most likely token at every position (at the mask tokens where the texts hold any)
    predicted = output.argmax(-1)
    tokenizer = run_model.tokenizer
    mask_id = getattr(tokenizer, "mask_token_id", None)
    at = batch["input_ids"] == mask_id if mask_id is not None else torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    if not at.any():
        at = batch["attention_mask"].bool()
    tokens = [predicted[i][at[i]].tolist() for i in range(predicted.shape[0])]
    shown = [tokenizer.decode(row) if tokenizer is not None else " ".join(map(str, row)) for row in tokens]
    lines = [f"text {i}: {text}" for i, text in enumerate(shown)]
    return "\n".join(lines), {"predicted_token_ids": tokens, "predicted": shown}


def in_memory_output(run_model: RunModel, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The task's result from the reference model (:func:`offload_core.runner.modes.generate.reference_model`) on ``device``."""
    from offload_core.runner.modes.generate import reference_model

    model = reference_model(run_model.checkpoint_dir, run_model.task, run_model.dtype, device)
    device = next(model.parameters()).device  # the cpu where the model does not fit on the GPU
    output = task_output(model, run_model.task, batch, device)
    del model
    return output


def run_encoder(settings: Any, strategies: Any, run_model: RunModel, checkpoint: Any, plan: Any, labels: dict) -> RunResult:
    """Dispatch, run the task over the run's texts, compare with in memory when asked, print and write the result."""
    from safetensors.torch import save_file

    from offload_core.runner.job import dispatched
    from offload_core.runner.modes.metrics import MemoryMonitor

    cfg, task = settings.cfg, run_model.task
    texts = run_texts(cfg)
    batch = encode_texts(run_model, texts)
    started = time.perf_counter()
    with MemoryMonitor() as memory, dispatched(settings, strategies, run_model, checkpoint, plan) as state:
        load_s = time.perf_counter() - started
        state.stats.reset()
        forward_started = time.perf_counter()
        output = task_output(run_model.model, task, batch, settings.execution_device)
        forward_s = time.perf_counter() - forward_started
        moved = state.stats.snapshot()["bytes"]
    text, figures = describe(run_model, task, output, batch)
    figures.update(task=task, load_s=load_s, forward_s=forward_s, bytes_moved=moved,
                   peak_anon_rss_bytes=memory.anon_delta, peak_file_rss_bytes=memory.file_delta)
    result = RunResult(text, [], plan.device_map, figures, plan.summary, None, settings.output_dir, plan.as_dict())
    if cfg.compare_in_memory:
        result.matches_in_memory = torch.equal(in_memory_output(run_model, batch, settings.execution_device), output)
    write_outputs(result, texts, labels, strategies.names["hook"])
    name = "embeddings" if task == "embeddings" else "logits"
    save_file({name: output.contiguous()}, str(settings.output_dir / f"{name}.safetensors"))
    print(f"\n{task} of {len(texts)} text(s)\n{text}\n")
    print(f"load {load_s:.2f} s | forward {forward_s:.3f} s | peak anon RSS +{format_size(memory.anon_delta)} | "
          f"file-backed RSS +{format_size(memory.file_delta)} | moved {format_size(moved)}")
    if result.matches_in_memory is not None:
        print(f"same {name} as in memory (bit for bit): {result.matches_in_memory}")
    print(f"wrote {settings.output_dir / 'metrics.json'}, {name}.safetensors and device_map.json")
    return result
