"""Memory budgets per device: read or parse ``max_memory``, and cap GPUs so a model spreads evenly over them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from offload_core.errors import ConfigError
from offload_core.planning.sizing import compute_module_sizes
from offload_core.values import parse_size

if TYPE_CHECKING:
    from offload_core.planning.fill import PlacementRequest

_FORMS = "a GPU index (0, '0' or 'cuda:0'), 'cpu' or 'disk'"


def device_key(key: Any) -> int | str:
    """Turn a ``max_memory`` key into an int GPU id, ``"cpu"`` or ``"disk"``; anything else raises ConfigError."""
    if isinstance(key, torch.device):
        if key.type == "cuda":
            return key.index or 0
        key = key.type
    if isinstance(key, int) and not isinstance(key, bool):
        if key >= 0:
            return key
    elif isinstance(key, str):
        text = key.strip().lower()
        if text in ("cpu", "disk"):
            return text
        digits = text.removeprefix("cuda:")
        if digits.isdigit():
            return int(digits)
    raise ConfigError(f"max_memory has an unknown device {key!r}: use {_FORMS}")


def _machine_memory() -> dict[int | str, int]:
    import psutil

    budgets: dict[int | str, int] = {}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            budgets[index] = torch.cuda.mem_get_info(index)[0]
    budgets["cpu"] = psutil.virtual_memory().available
    return budgets


def get_max_memory(max_memory: Mapping[Any, int | str] | None = None, check_devices: bool = True) -> dict[int | str, int]:
    """Budgets in bytes by device, GPUs first (ascending ids), then ``"cpu"``, then ``"disk"``.

    ``None`` reads the free memory of this machine (every GPU, and available RAM for ``"cpu"``).
    Sizes may be bytes or strings such as ``"2GiB"``. With ``check_devices`` a GPU id that this
    machine lacks is an error; planning for another machine passes ``check_devices=False``.
    """
    if max_memory is None:
        return _machine_memory()
    budgets: dict[int | str, int] = {}
    for key, value in max_memory.items():
        device = device_key(key)
        if device in budgets:
            raise ConfigError(f"max_memory names device {device!r} twice (as {key!r}): keep one entry per device")
        if check_devices and isinstance(device, int):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if device >= count:
                raise ConfigError(
                    f"max_memory names GPU {device} but this machine has {count} GPU(s): remove it, "
                    "or plan with check_devices=False for another machine"
                )
        budgets[device] = parse_size(value, what=f"max_memory[{key!r}]")
    gpus = sorted(d for d in budgets if isinstance(d, int))
    return {d: budgets[d] for d in [*gpus, "cpu", "disk"] if d in budgets}


def _no_split_block(model: torch.nn.Module, sizes: Mapping[str, int], no_split: set[str]) -> int:
    if not no_split:
        return 0
    return max((sizes.get(name, 0) for name, module in model.named_modules() if type(module).__name__ in no_split), default=0)


def _mean_leaf_module(model: torch.nn.Module, sizes: Mapping[str, int]) -> int:
    leaves = [sizes.get(name, 0) for name, module in model.named_modules() if next(module.children(), None) is None]
    leaves = [size for size in leaves if size > 0]
    return int(sum(leaves) / max(len(leaves), 1))


def get_balanced_memory(request: PlacementRequest, low_zero: bool = False) -> dict[int | str, int]:
    """``request.max_memory`` with every GPU but the last capped so the model spreads evenly over the GPUs.

    Each cap is total/n plus 1.25 × the larger of the largest no-split block and the mean leaf module;
    the last GPU keeps its full budget in case the buffer falls short. ``low_zero`` spreads over
    GPUs 1.. instead and gives the first GPU only what they leave (possibly 0). GPU ids need not be
    contiguous. With one GPU or none the budgets come back unchanged.
    """
    budgets = get_max_memory(request.max_memory, check_devices=False)
    gpus = [d for d in budgets if isinstance(d, int) and budgets[d] > 0]
    if len(gpus) <= 1:
        return budgets
    sizes = compute_module_sizes(request.model, dtype=request.dtype, special_dtypes=request.special_dtypes)
    total = sizes[""]
    spread = gpus[1:] if low_zero else gpus
    buffer = int(1.25 * max(_no_split_block(request.model, sizes, set(request.no_split_module_classes or ())),
                            _mean_leaf_module(request.model, sizes)))
    per_gpu = total // len(spread) + buffer
    for gpu in spread[:-1]:
        budgets[gpu] = min(per_gpu, budgets[gpu])
    if low_zero:
        first = gpus[0]
        budgets[first] = min(max(0, total - sum(budgets[g] for g in spread)), budgets[first])
    return budgets
