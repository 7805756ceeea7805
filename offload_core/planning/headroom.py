"""What a run holds back from the budget of the device it computes on beside its weights (its headroom): the runtime's
own slack, a fixed allowance for a forward whose activations are not planned, and the check that a headroom leaves
something of the budget."""

from __future__ import annotations


from typing import Any

import torch

from offload_core import devices
from offload_core.errors import ConfigError
from offload_core.values import device_key, format_size, parse_size

#: held back from the cpu budget under ``headroom=auto`` by a run that does not generate (one forward over its texts)
FORWARD_HEADROOM = 48 * 2**20
#: held back from the cpu budget beside the planned KV cache and activations: what the allocator, torch and the
#: stores use on their own (an offload folder casts what it writes and hashes its files 1 MiB at a time), and keep
#: after a generation (the small synthetic model's peak anonymous RSS was 5.4 MiB
#: over its plan; mixtral-2.6g's grew by 25-35 MiB over its weights in its first generate, kept after it, and so
#: peaked 0.4 MB over a 0.65 GB budget with 8 MiB held back; in memory its prompt's forward leaves 28 MiB more heap,
#: and with hook=experts on memmap its prompt peaked 44-51 MB over the weights, 0.66 GB on a 0.65 GB budget with
#: 32 MiB held back), at most a quarter of a smaller budget (a tiny model)
RUNTIME_SLACK = 64 * 2**20
#: held back from a GPU budget beside the KV cache, activations, one block and the math libraries' workspace (which
#: the device layer gives: cuBLAS's 32 MiB on an H100 or H200): the caching allocator's rounding (the 1.1B preset on an
#: H100 peaked 4 MiB over a 1 GB budget without it; the small preset on an H200 peaked 1.1 MiB over 96 MiB when the
#: workspace was held within a quarter of the budget)
GPU_RUNTIME_SLACK = 8 * 2**20

#: held back beside a pipeline's traced activations (CPU or GPU): its first call's one-time buffers and the
#: allocator's retention of freed activations (a 2 GB Stable-Diffusion-shaped pipeline's first 64x64 image peaked at
#: 254 MB of anonymous memory in memory, its UNet's traced activations 95 MB; 1.60 GB against 1.53 GB at 256x256;
#: with glibc's mmap threshold fixed the same calls peak at the traced bytes)
PIPELINE_RUNTIME_SLACK = 128 * 2**20


def runtime_slack(budget: int | None, device: torch.device | str | None = None, pipeline: bool = False) -> int:
    """:data:`RUNTIME_SLACK` (:data:`GPU_RUNTIME_SLACK` for the budget of an accelerator ``device``,
    :data:`PIPELINE_RUNTIME_SLACK` for a ``pipeline``'s), or a quarter of a smaller ``budget``; on an accelerator
    the workspace its math libraries keep on top, whole (it does not shrink with the budget; the quarter is of the
    budget it leaves)."""
    gpu = device is not None and devices.is_accelerator(device)
    workspace = 0
    if gpu:
        accelerator = devices.for_device(device)
        workspace = accelerator.workspace_bytes(accelerator.normalize(device).index)
    slack = PIPELINE_RUNTIME_SLACK if pipeline else GPU_RUNTIME_SLACK if gpu else RUNTIME_SLACK
    return workspace + (slack if budget is None else min(slack, max(budget - workspace, 0) // 4))


def check_headroom(max_memory: dict, headroom: int, execution_device: torch.device) -> None:
    """The headroom comes out of the budget of the device the run computes on (the cpu, or its GPU): one that
    leaves nothing is refused."""
    key = device_key(execution_device)
    budget = max_memory.get(key)
    if budget is not None and headroom >= budget:
        raise ConfigError(
            f"headroom ({format_size(headroom)}) leaves nothing of max_memory.{key} ({format_size(budget)}): "
            f"lower headroom or raise max_memory.{key}"
        )


def read_headroom(value: int | str | None) -> int | None:
    """A headroom as the Python API takes it: bytes or a size such as ``"512MiB"``; None for ``"auto"`` (or None),
    which each kind of model resolves by its own plan."""
    if value is None or str(value) == "auto":
        return None
    return parse_size(value, what="headroom")


def less_headroom(budgets: dict[Any, int], headroom: int, execution_device: torch.device) -> dict[Any, int]:
    """``budgets`` with ``headroom`` taken from the budget of the device that computes (checked to leave some)."""
    check_headroom(budgets, headroom, execution_device)
    key = device_key(execution_device)
    return {**budgets, key: budgets[key] - headroom} if key in budgets else dict(budgets)
