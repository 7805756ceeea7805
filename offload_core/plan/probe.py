"""The dispatched probe: a two-block model of the run's own shape (its vocabulary cut short), generated from in memory
and then with both blocks offloaded through the run's store and policy. What the cost model reads from it:

- ``outside_*_s``: a forward's cost beyond its blocks and output embedding (the embedding, norms, masks, the generate
  loop), in memory: the in-memory generation less its own two blocks timed bare, hot in the CPU's cache as they ran
  (less the run's calibrated block, timed cycling through memory, large blocks left nothing outside);
- ``per_load_*_s``: what each offloaded tensor brought in costs on top (the policy's hooks, the store's read path,
  the reader thread's overlap), per tensor loaded;
- ``first_call_s``: what a process's first generation pays once on its first token (kernels built, caches made);
- ``probe_load_s`` with ``probe_tensors``, ``probe_bytes`` and ``probe_offloaded_bytes``: its load, timed as a
  run's (the dispatch through the store and policy), from which the cost model takes loading's fixed cost per
  tensor beyond the bytes read and written.

Each for ``prefill`` (the prompt's forward) and ``decode`` (one token per row), over the run's batch shape. A probe
that cannot run (an architecture it cannot shrink, a policy that needs what the probe lacks) leaves these terms out."""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import StoppingCriteria

from offload_core import devices
from offload_core.values import budget_key

#: the cache key's version: a probe measured by an older rule is measured again
PROBE_VERSION = 5
#: the probe's blocks and vocabulary (its output embedding is timed apart, at the real size)
PROBE_BLOCKS = 2
PROBE_VOCAB = 256
#: the most bytes of blocks the probe builds, writes and loads (larger blocks: the probe is left out, their bytes
#: dominate a step anyway)
PROBE_MAX_BYTES = 512 * 2**20
#: tokens each probe generation makes (the first is the prefill's)
PROBE_TOKENS = 6
#: generations timed per probe (the fastest counts)
REPEATS = 3


class _Stamps(StoppingCriteria):
    """Stamps the time each step ends (after the device finished it); never stops."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        devices.for_device(input_ids.device).synchronize(input_ids.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _timed(model: nn.Module, ids: torch.Tensor, repeats: int = REPEATS) -> tuple[float, float, float]:
    """(first token, decoding step, first call's extra) seconds of greedy generation from ``ids``: the medians over
    ``repeats`` generations after a first one, and how much longer that first one's first token took (it builds the
    kernels and caches a run's one generation pays for)."""
    from transformers import StoppingCriteriaList

    firsts, steps = [], []
    for repeat in range(repeats + 1):
        stamps = _Stamps()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=PROBE_TOKENS,
                min_new_tokens=PROBE_TOKENS,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([stamps]),
            )
        firsts.append(stamps.stamps[0] - started)
        if repeat:
            steps += [b - a for a, b in zip(stamps.stamps, stamps.stamps[1:])]
    first = statistics.median(firsts[1:])
    return first, statistics.median(steps), max(firsts[0] - first, 0.0)


def probe_config(config: Any) -> Any:
    """``config`` with :data:`PROBE_BLOCKS` layers and a :data:`PROBE_VOCAB`-token vocabulary (special token ids kept
    inside it)."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers = PROBE_BLOCKS
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:PROBE_BLOCKS]
    text.vocab_size = min(text.vocab_size, PROBE_VOCAB)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        for holder in {id(config): config, id(text): text}.values():
            if isinstance(getattr(holder, name, None), int) and getattr(holder, name) >= text.vocab_size:
                setattr(holder, name, 0)
    return config


def split_map(model: nn.Module, no_split: list[str], on: Any, off: Any) -> dict[str, Any]:
    """A device map of ``model``: every no-split block on ``off``, everything else on ``on``."""
    out: dict[str, Any] = {}

    def place(prefix: str, module: nn.Module) -> None:
        holds_block = any(type(m).__name__ in no_split for m in module.modules())
        if type(module).__name__ in no_split or not holds_block:
            if prefix and (
                type(module).__name__ in no_split
                or any(True for _ in module.parameters(recurse=True))
                or any(True for _ in module.buffers(recurse=True))
            ):
                out[prefix] = off if type(module).__name__ in no_split else on
            return
        for name, child in module.named_children():
            place(f"{prefix}.{name}" if prefix else name, child)
        if prefix and any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"{prefix} holds its own weights beside its blocks")

    place("", model)
    return out


def probe_times(
    run_model: Any,
    storage: Any,
    policy: Any,
    execution_device: torch.device,
    rows: int,
    tokens: int,
    folder: Path,
) -> dict[str, float]:
    """The probe's terms (see the module's doc) for the run's model, a fresh ``storage`` and ``policy`` built as
    the run's, on ``execution_device`` for ``rows`` sequences of ``tokens`` prompt tokens. Its files are written in a
    temporary folder under ``folder`` (where the checkpoint lies) and removed."""
    from offload_core.loading.checkpoint import Checkpoint
    from offload_core.loading.tasks import build_empty, read_config
    from offload_core.plan.request import PlanRequest, dispatch, plan_request

    from offload_core.planning import largest_block_size
    from offload_core.plan.calibrate import block_seconds
    from offload_core.values import format_size

    block = largest_block_size(run_model.model, run_model.no_split, dtype=run_model.dtype)
    if PROBE_BLOCKS * block > PROBE_MAX_BYTES:
        raise ValueError(f"blocks of {format_size(block)} are too large to probe in seconds")
    config = probe_config(read_config(run_model.checkpoint_dir))
    torch.manual_seed(0)
    model = type(run_model.model)(config).to(run_model.dtype).eval()
    gpu = devices.is_accelerator(execution_device)
    on, off = (budget_key(execution_device), "cpu") if gpu else ("cpu", "disk")
    device_map = split_map(model, run_model.no_split, on, off)
    ids = torch.randint(1, config.get_text_config().vocab_size, (rows, tokens), device=execution_device)
    with tempfile.TemporaryDirectory(prefix=".offload-probe-", dir=folder) as tmp:
        _save_quietly(model, Path(tmp) / "model")
        memory_first, memory_step, warmup = _timed(model.to(execution_device), ids)
        # its own blocks, timed bare as they ran (hot in the CPU's cache): the rest of a step is outside them
        own = [m for m in model.modules() if type(m).__name__ in run_model.no_split]
        own_s = {
            shape: PROBE_BLOCKS * block_seconds(model, own, run_model.dtype, execution_device, rows, length)
            for shape, length in (("prefill", tokens), ("decode", 1))
        }
        sizes = {
            "probe_tensors": len(model.state_dict()),
            "probe_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        }
        del model
        offloaded = build_empty(config, run_model.task, run_model.dtype)
        with Checkpoint.open(Path(tmp) / "model") as checkpoint:
            # the probe's own map through the one door: no budgets, so nothing held back and no kept set
            request = PlanRequest(
                execution_device,
                run_model.no_split,
                run_model.dtype,
                storage=storage,
                policy=policy,
                page_cache=None,
                generation=None,
                device_map=device_map,
            )
            plan = plan_request(offloaded, checkpoint, request)
            started = time.perf_counter()  # timed as a run times its load: the dispatch, the plan made before
            dispatch(plan, offloaded, checkpoint, Path(tmp) / "offload")
            sizes["probe_load_s"] = time.perf_counter() - started
            sizes["probe_offloaded_bytes"] = offloaded.offload_state.offloaded_bytes()
            with offloaded.offload_state as state:
                state.stats.reset()
                first, step, _ = _timed(offloaded, ids)
                loads = state.stats.snapshot()["loads"] / ((REPEATS + 1) * PROBE_TOKENS)
    if not loads:
        raise ValueError("the probe's offloaded blocks were never loaded")
    return {
        "outside_prefill_s": max(memory_first - own_s["prefill"], 0.0),
        "outside_decode_s": max(memory_step - own_s["decode"], 0.0),
        "per_load_prefill_s": max(first - memory_first, 0.0) / loads,
        "per_load_decode_s": max(step - memory_step, 0.0) / loads,
        "loads_per_forward": loads,
        "first_call_s": warmup,
        **sizes,
    }


def _save_quietly(model: nn.Module, path: Path) -> None:
    """``model.save_pretrained(path)`` without transformers' progress bar: the probe is the run's own business, and a
    run that then stops on bad input must print its one error line alone."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
