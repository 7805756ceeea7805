"""Memory budgets per device: read or parse ``max_memory``, and cap GPUs so a model spreads evenly over them."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import devices
from offload_core.errors import ConfigError
from offload_core.planning.request import PlacementRequest
from offload_core.planning.sizing import compute_module_sizes
from offload_core.values import DEVICE_FORMS, budget_key, device_key, parse_size

log = logging.getLogger(__name__)

#: ``max_memory=None`` budgets this fraction of each GPU's free memory
GPU_FREE_FRACTION = 0.9


def budget_device(key: Any, what: str = "max_memory") -> int | str:
    """A ``max_memory`` (or ``reserve``) key as an int GPU id, ``"cpu"``, ``"disk"`` or ``"mps"``; else ConfigError."""
    device = device_key(key)
    if device is None:
        raise ConfigError(f"{what} has an unknown device {key!r}: use {DEVICE_FORMS}")
    return device


def _machine_memory() -> dict[int | str, int]:
    import psutil

    accelerator = devices.active()
    budgets: dict[int | str, int] = {}
    for index in range(accelerator.count()):
        # what a run allocates besides the weights and its reservation (the CUDA context's later growth, the
        # allocator's fragmentation, library workspaces) comes out of the rest
        budgets[index] = int(accelerator.mem_get_info(index)[0] * GPU_FREE_FRACTION)
    budgets["cpu"] = psutil.virtual_memory().available
    return budgets


def get_max_memory(
    max_memory: Mapping[Any, int | str] | None = None, *, check_devices: bool = True
) -> dict[int | str, int]:
    """Budgets in bytes by device, GPUs first (ascending ids), then ``"mps"``, ``"cpu"``, ``"disk"``.

    ``None`` reads the free memory of this machine (90% of every GPU's, and available RAM for ``"cpu"``).
    Sizes may be bytes or strings such as ``"2GiB"``. With ``check_devices`` a GPU id that this
    machine lacks is logged as a warning (as accelerate does); ``check_devices=False`` (planning for
    another machine) says nothing.
    """
    if max_memory is None:
        return _machine_memory()
    budgets: dict[int | str, int] = {}
    for key, value in max_memory.items():
        device = budget_device(key)
        if device in budgets:
            raise ConfigError(f"max_memory names device {device!r} twice (as {key!r}): keep one entry per device")
        if check_devices and isinstance(device, int):
            count = devices.gpu_count()
            if device >= count:
                log.warning("Device %s is not available, available devices are %s", device, list(range(count)))
        budgets[device] = parse_size(value, what=f"max_memory[{key!r}]")
    gpus = sorted(d for d in budgets if isinstance(d, int))
    return {d: budgets[d] for d in [*gpus, "mps", "cpu", "disk"] if d in budgets}


def read_max_memory(value: Any, execution_device: torch.device) -> Mapping[Any, int | str] | None:
    """``from_pretrained``'s ``max_memory``: None and dicts as given; a single size (bytes, ``2e8`` or a string such as
    ``"200MB"``) is the budget of ``execution_device``, and on a GPU the cpu's budget beside it is its available
    memory (as ``max_memory=None`` reads it); anything else is a ConfigError."""
    if value is None or isinstance(value, Mapping):
        return value
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(
            f"max_memory={value!r} is not a size nor a dict of sizes by device: give one size for the execution "
            "device (e.g. '2GiB') or a dict such as {0: '10GiB', 'cpu': '20GiB'}"
        )
    size = parse_size(value, what="max_memory")
    if execution_device.type == "cpu":
        return {"cpu": size}
    import psutil

    return {budget_key(execution_device): size, "cpu": psutil.virtual_memory().available}


def check_execution_device(value: str | torch.device) -> torch.device:
    """The device a run computes on, as given (``cpu``, ``cuda``, ``cuda:N`` or the active accelerator's own type),
    checked to exist on this machine (the one rule for ``run.py``'s ``execution_device`` and ``from_pretrained``'s);
    else ConfigError."""
    try:
        device = devices.active().normalize(value)
    except (RuntimeError, TypeError):
        raise ConfigError(f"execution_device={str(value)!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda" or devices.active().owns(device):
        count = devices.gpu_count()
        if device.index >= count:
            raise ConfigError(
                f"execution_device={str(value)!r} does not exist: this machine has {count} CUDA device(s); use cpu"
            )
        return devices.gpu(device.index)
    raise ConfigError(f"execution_device={str(value)!r} is not supported: use cpu or cuda:N")


def check_budgets(budgets: Mapping[Any, int], execution_device: torch.device) -> None:
    """The budgets a run can use on this machine (the one rule for ``run.py`` and ``from_pretrained``): no ``mps``, a
    GPU budget only on a GPU run and for a GPU this machine has, and no budget of 0 but ``disk``'s; else ConfigError."""
    for key, size in budgets.items():
        dev = budget_device(key)
        if dev == "mps":
            raise ConfigError(f"max_memory has an unknown device {str(key)!r}: use cpu, disk or a GPU index like 0")
        if isinstance(dev, int):
            if execution_device.type == "cpu":
                raise ConfigError(
                    f"max_memory.{key}: a GPU budget on a CPU run; remove it or set execution_device=cuda"
                )
            count = devices.gpu_count()
            if dev >= count:
                raise ConfigError(f"max_memory.{key}: GPU {dev} does not exist (this machine has {count}); remove it")
        if size == 0 and dev != "disk":
            raise ConfigError(f"max_memory.{key}=0 leaves nothing to run with: give a size above 0 or remove the key")


def _no_split_block(model: torch.nn.Module, sizes: Mapping[str, int], no_split: set[str]) -> int:
    """The largest of the sizes of the first module of each ``no_split`` class, first in ``sizes``' order (accelerate's
    rule: a model's blocks of one class are alike)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    first: dict[str, int] = {}
    for name, size in sizes.items():
        module = modules.get(name) if name else None
        if module is not None and type(module).__name__ in no_split:
            first.setdefault(type(module).__name__, size)
    return max(first.values(), default=0)


def _leaves(names: list[str]) -> list[str]:
    """The names in ``names`` (dotted, ``""`` the root) that no other one extends by one part, the root aside."""
    parents = {name.rsplit(".", 1)[0] for name in names if "." in name}
    return [name for name in names if name and name not in parents]


def _mean_leaf_module(sizes: Mapping[str, int]) -> int:
    """The mean size of the modules that hold tensors directly and no module that holds tensors: the leaves of the
    sizes once their own leaves, the tensors, are taken away (accelerate's rule)."""
    tensors = set(_leaves(list(sizes)))
    leaves = _leaves([name for name in sizes if name not in tensors])
    return int(sum(sizes[name] for name in leaves) / max(len(leaves), 1))


def get_balanced_memory(
    model: nn.Module | PlacementRequest,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    low_zero: bool = False,
) -> dict[int | str, int]:
    """``max_memory`` with every GPU but the last capped so ``model`` spreads evenly over the GPUs: accelerate's
    function, with its results (checked against accelerate's own where it is installed).

    ``model`` may also be a :class:`PlacementRequest`, whose fields then stand for the other arguments.
    Each cap is total/n plus 1.25 × the larger of the first no-split block of each class and the mean leaf
    module, n counting the GPUs with a budget above 0; the last GPU keeps its full budget in case the buffer
    falls short. ``low_zero`` spreads over the other n - 1 GPUs and gives the first GPU (the lowest id) only what
    they leave (possibly 0). GPU ids need not be contiguous. With one GPU or none the budgets come back
    unchanged. ``max_memory=None`` reads this machine's memory (:func:`get_max_memory`: 90% of each GPU's free
    memory, where accelerate takes all of it when there are several).
    """
    if isinstance(no_split_module_classes, str):  # as accelerate takes it
        no_split_module_classes = [no_split_module_classes]
    request = (
        model
        if isinstance(model, PlacementRequest)
        else PlacementRequest(model, max_memory, list(no_split_module_classes or []), dtype, special_dtypes)
    )
    budgets = get_max_memory(request.max_memory, check_devices=False)
    gpus = sorted(d for d in budgets if isinstance(d, int) and budgets[d] > 0)
    if len(gpus) <= 1:
        return budgets
    sizes = compute_module_sizes(request.model, dtype=request.dtype, special_dtypes=request.special_dtypes)
    total = sizes[""]
    no_split = set(request.no_split_module_classes or ())
    buffer = int(1.25 * max(_no_split_block(request.model, sizes, no_split), _mean_leaf_module(sizes)))
    per_gpu = total // (len(gpus) - 1 if low_zero else len(gpus)) + buffer
    first = min(d for d in budgets if isinstance(d, int))  # GPU 0 where there is one, even with a budget of 0
    for gpu in gpus[:-1]:
        if not (low_zero and gpu == first):
            budgets[gpu] = min(per_gpu, budgets[gpu])
    if low_zero:
        rest = sum(budgets[g] for g in gpus if g != first)
        budgets[first] = min(max(0, total - rest), budgets[first])
    return budgets
    sizes = compute_module_sizes(request.model, dtype=request.dtype, special_dtypes=request.special_dtypes)
    total = sizes[""]
    spread = gpus[1:] if low_zero else gpus
    buffer = int(
        1.25
        * max(
            _no_split_block(request.model, sizes, set(request.no_split_module_classes or ())),
            _mean_leaf_module(request.model, sizes),
        )
    )
    per_gpu = total // len(spread) + buffer
    for gpu in spread[:-1]:
        budgets[gpu] = min(per_gpu, budgets[gpu])
    if low_zero:
        first = gpus[0]
        budgets[first] = min(max(0, total - sum(budgets[g] for g in spread)), budgets[first])
    return budgets


#: what a plan does with a budget it cannot hold: run over it with a warning, or refuse
OVER_BUDGET = ("warn", "refuse")


def check_over_budget(value: str) -> str:
    """``over_budget`` as given, if it is one of :data:`OVER_BUDGET`; else a
    :class:`~offload_core.errors.ConfigError`."""
    if value not in OVER_BUDGET:
        raise ConfigError(f"over_budget={value!r} is not one of {', '.join(OVER_BUDGET)}")
    return value
