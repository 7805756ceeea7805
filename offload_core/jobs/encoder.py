"""Runs of the tasks that read texts instead of generating (masked LM, sequence classification, embeddings): one
forward over the texts, the result printed and written to the run folder, and the in-memory reference compared."""

from __future__ import annotations

import time
from typing import Any

import torch

from offload_core.runner.inputs import decode, encode_texts, run_texts
from offload_core.jobs.context import loaded
from offload_core.jobs.results import RunResult, write_outputs
from offload_core.plan.model import RunModel
from offload_core.plan.prepare import Prepared
from offload_core.values import format_size


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


def describe(
    run_model: RunModel, task: str, output: torch.Tensor, batch: dict[str, torch.Tensor]
) -> tuple[str, dict[str, Any]]:
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
    at = (
        batch["input_ids"] == mask_id if mask_id is not None else torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    )
    if not at.any():
        at = batch["attention_mask"].bool()
    tokens = [predicted[i][at[i]].tolist() for i in range(predicted.shape[0])]
    shown = [decode(tokenizer, row, skip_special_tokens=False) for row in tokens]
    lines = [f"text {i}: {text}" for i, text in enumerate(shown)]
    return "\n".join(lines), {"predicted_token_ids": tokens, "predicted": shown}


def in_memory_output(run_model: RunModel, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The task's result from the reference model (:func:`offload_core.jobs.generate.reference_model`) on
    ``device``."""
    from offload_core.jobs.generate import reference_model

    model = reference_model(run_model.checkpoint_dir, run_model.task, run_model.dtype, device)
    device = next(model.parameters()).device  # the cpu where the model does not fit on the GPU
    output = task_output(model, run_model.task, batch, device)
    del model
    return output


def run_encoder(job: Prepared, labels: dict) -> RunResult:
    """Dispatch, run the task over the run's texts, compare with in memory when asked, print and write the result."""
    from safetensors.torch import save_file

    settings, run_model, task = job.settings, job.run_model, job.run_model.task
    texts = run_texts(settings.texts, settings.prompt)
    batch = encode_texts(run_model, texts)
    with loaded(job) as run:
        forward_started = time.perf_counter()
        output = task_output(run_model.model, task, batch, settings.execution_device)
        forward_s = time.perf_counter() - forward_started
        moved = run.state.stats.snapshot()["bytes"]
    memory = run.memory
    text, figures = describe(run_model, task, output, batch)
    figures.update(
        task=task,
        load_s=run.load_s,
        forward_s=forward_s,
        bytes_moved=moved,
        peak_anon_rss_bytes=memory.anon_delta,
        peak_file_rss_bytes=memory.file_delta,
    )
    result = RunResult.of_plan(job.plan, settings.output_dir, figures, text)
    if settings.compare_in_memory:
        result.matches_in_memory = torch.equal(in_memory_output(run_model, batch, settings.execution_device), output)
    write_outputs(result, texts, labels)
    name = "embeddings" if task == "embeddings" else "logits"
    save_file({name: output.contiguous()}, str(settings.output_dir / f"{name}.safetensors"))
    print(f"\n{task} of {len(texts)} text(s)\n{text}\n")
    print(
        f"load {run.load_s:.2f} s | forward {forward_s:.3f} s | peak anon RSS +{format_size(memory.anon_delta)} | "
        f"file-backed RSS +{format_size(memory.file_delta)} | moved {format_size(moved)}"
    )
    if result.matches_in_memory is not None:
        print(f"same {name} as in memory (bit for bit): {result.matches_in_memory}")
    print(f"wrote {settings.output_dir / 'metrics.json'}, {name}.safetensors and device_map.json")
    return result
