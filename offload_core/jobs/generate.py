"""Generation: greedy or sampled generation timed per token, and the in-memory reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from offload_core.plan.model import RunModel
from offload_core.runner.settings import Sampling, Settings


def generate(
    model,
    input_ids: torch.Tensor,
    sampling: Sampling,
    device: torch.device,
    speculation: Any = None,
    progress: bool = False,
):
    """The new token ids ``model`` generates after ``input_ids`` as ``sampling`` says, and the timer (with
    ``speculation``, a :class:`offload_core.speculative.Speculation` of ``model``: its drafts, counted)."""
    rows, timer = generate_rows(model, input_ids, torch.ones_like(input_ids), sampling, device, progress, speculation)
    return rows[0], timer


def generate_rows(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: Sampling,
    device: torch.device,
    progress: bool = False,
    speculation: Any = None,
):
    """The new token ids of every row of ``input_ids`` (left-padded where ``attention_mask`` is 0), and the timer."""
    from contextlib import nullcontext

    from transformers import StoppingCriteriaList

    from offload_core.jobs.metrics import TokenTimer

    torch.manual_seed(sampling.seed)
    timer = TokenTimer(total=sampling.max_new_tokens, progress=progress)
    kwargs = sampling.generate_kwargs()
    kwargs.update(decoder_start(model))
    if speculation is not None:
        kwargs.update(speculation.kwargs)
    # A decoder-only model returns the prompt then the new tokens; an encoder-decoder its decoder start token then them.
    start = 1 if getattr(model.config, "is_encoder_decoder", False) else input_ids.shape[1]
    with torch.inference_mode(), speculation.counting() if speculation is not None else nullcontext():
        try:
            out = model.generate(
                input_ids.to(device),
                attention_mask=attention_mask.to(device),
                stopping_criteria=StoppingCriteriaList([timer]),
                pad_token_id=pad_token_id(model),
                **kwargs,
            )
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: the tokens made so far go with it, for the run to keep
            stop.generated = timer.rows_after(start)
            raise
        finally:
            timer.close()
    return out[:, start:].tolist(), timer


def pad_token_id(model) -> int | None:
    """The id generation pads finished rows with: the generation config's pad token, else the model's end of
    sequence."""
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "eos_token_id", None)
    return pad[0] if isinstance(pad, (list, tuple)) else pad


def decoder_start(model) -> dict[str, int]:
    """An encoder-decoder whose configs name no decoder start (nor bos) token starts from its pad token, as T5 does."""
    gen, config = model.generation_config, model.config
    if (
        not getattr(config, "is_encoder_decoder", False)
        or gen.decoder_start_token_id is not None
        or gen.bos_token_id is not None
    ):
        return {}
    pad = gen.pad_token_id if gen.pad_token_id is not None else getattr(config, "pad_token_id", None)
    return {"decoder_start_token_id": pad if pad is not None else 0}


def reference_model(checkpoint: Path, task: str, dtype: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    """The same checkpoint loaded fully in memory by transformers with ``task``'s Auto class, on ``device``: the
    reference a run compares with computes where the run computes (a GPU's results differ from a CPU's). A model
    larger than 90% of that GPU's free memory computes on the cpu instead, and a line says so."""
    from offload_core import devices
    from offload_core.loading.quiet import library_bars
    from offload_core.loading.tasks import auto_class
    from offload_core.planning.budgets import GPU_FREE_FRACTION
    from offload_core.values import format_size

    from offload_core.loading.gguf_checkpoint import find_gguf
    from offload_core.loading.gguf_sources import transformers_gguf_model

    gguf = find_gguf(checkpoint)
    if gguf is not None:  # transformers' own load of the file (it dequantizes every tensor)
        model = transformers_gguf_model(gguf, auto_class(task), dtype)
    else:
        with library_bars(False, "transformers"):  # the run's own bars say how it loads; the reference's would be noise
            model = auto_class(task).from_pretrained(checkpoint, dtype=dtype)
    if device.type != "cpu":
        size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        free, _ = devices.for_device(device).mem_get_info(device.index or 0)
        if size > GPU_FREE_FRACTION * free:
            print(
                f"compare_in_memory: the model ({format_size(size)}) does not fit in {device}'s free memory "
                f"({format_size(free)}); the reference computes on the cpu, whose results may differ in the last bits"
            )
        else:
            model.to(device)
    return model.eval()


def in_memory_tokens(
    run_model: RunModel,
    input_ids: torch.Tensor,
    settings: Settings,
    speculative: Any = None,
    replay: str | None = None,
) -> list[int]:
    """Tokens of the reference model of ``run_model``'s checkpoint (:func:`reference_model`) on the run's execution
    device, sampled as ``settings`` says, generated plainly or with ``speculative`` (a
    :class:`offload_core.speculative.SpeculativeConfig`; ``replay``: the run's draft decisions); with a static KV cache
    where the run captures graphs, as a ``graphs=true`` run decodes."""
    from offload_core.speculative import prepare

    dtype, sampling = run_model.dtype, settings.sampling
    model = reference_model(run_model.checkpoint_dir, run_model.task, dtype, settings.execution_device)
    if settings.graphs:
        model.generation_config.cache_implementation = "static"
        model.generation_config.disable_compile = True  # eager, as a graphs run's steps are captured (transformers
        # compiles a static cache's forward on a GPU, whose kernels round otherwise)
    device = next(model.parameters()).device  # the cpu where the model does not fit on the GPU
    speculation = prepare(speculative, model, dtype, device, replay) if speculative is not None else None
    tokens, _ = generate(model, input_ids, sampling, device, speculation)
    del model
    return tokens
