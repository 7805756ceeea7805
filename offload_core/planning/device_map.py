"""Device maps (module or tensor name -> device): normalise, check, look up, compress and summarise them."""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from offload_core.errors import DeviceMapError
from offload_core.planning.budgets import get_max_memory
from offload_core.planning.sizing import compute_module_sizes, named_module_tensors, shared_modules
from offload_core.values import DEVICE_FORMS, device_key

DeviceMap = dict[str, "int | str"]


def normalize_device_map(device_map: Mapping[str, Any]) -> DeviceMap:
    """A copy of ``device_map`` with int GPU ids (``"0"``, ``"cuda:0"`` -> ``0``); unknown devices raise
    DeviceMapError."""
    cleaned: DeviceMap = {}
    bad = []
    for key, value in device_map.items():
        device = device_key(value)
        if device is None:
            bad.append(f"{key!r}: {value!r}")
        else:
            cleaned[str(key)] = device
    if bad:
        raise DeviceMapError(f"device map has unknown device(s) {', '.join(bad)}: use {DEVICE_FORMS}")
    return cleaned


def _ancestors(name: str) -> Iterable[str]:
    """``"a.b.c"`` -> ``"a.b"``, ``"a"``, ``""``."""
    while name:
        name = name.rpartition(".")[0]
        yield name


def device_of(device_map: Mapping[str, int | str], tensor_name: str) -> int | str:
    """The device of the longest key of ``device_map`` that is ``tensor_name`` or one of its module prefixes."""
    if tensor_name in device_map:
        return device_map[tensor_name]
    for prefix in _ancestors(tensor_name):
        if prefix in device_map:
            return device_map[prefix]
    raise DeviceMapError(f"device map has no key covering {tensor_name!r}: add it, one of its modules, or '' for all")


def _module_device(device_map: Mapping[str, int | str], name: str) -> int | str | None:
    try:
        return device_of(device_map, name)
    except DeviceMapError:
        return None


def _short(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_device_map(model: nn.Module, device_map: Mapping[str, Any], *, strict: bool = False) -> None:
    """Raise DeviceMapError unless ``device_map`` puts every state-dict tensor of ``model`` on exactly one known device.

    Names that are not a module or tensor of the model are a warning, as in accelerate (an error with
    ``strict``). Rejected: unknown devices, a key inside
    another key with a different device (``{"fc": 0, "fc.bias": "cpu"}``), tensors no key covers, and a
    module registered under two names (``nn.Sequential(layer, layer)``) given two devices: it is one module.
    """
    device_map = normalize_device_map(device_map)
    known = {""}
    for module_name, module in model.named_modules(remove_duplicate=False):
        known.add(module_name)
        prefix = f"{module_name}." if module_name else ""
        known.update(prefix + local for local in (*module._parameters, *module._buffers))
    unknown = [key for key in device_map if key not in known]
    if unknown:
        message = (
            f"device map names {_short(unknown)}, which the model does not have: use module or tensor names "
            "from model.named_modules() / model.state_dict()"
        )
        if strict:
            raise DeviceMapError(message)
        warnings.warn(
            f"The following device_map keys do not match any submodules in the model: {unknown}; {message}",
            stacklevel=2,
        )
        device_map = {key: device for key, device in device_map.items() if key not in unknown}
    clashes = []
    for key, device in device_map.items():
        for outer in _ancestors(key) if key else ():
            if outer in device_map and device_map[outer] != device:
                clashes.append(f"{key!r} ({device}) inside {outer!r} ({device_map[outer]})")
                break
    if clashes:
        raise DeviceMapError(
            f"device map keys overlap with different devices: {', '.join(clashes[:5])}; "
            "remove the outer key and give each part its own key, or give them the same device"
        )
    missing = []
    for name in model.state_dict(keep_vars=True):
        try:
            device_of(device_map, name)
        except DeviceMapError:
            missing.append(name)
    if missing:
        raise DeviceMapError(
            f"device map covers no device for {len(missing)} tensor(s) ({_short(missing)}): "
            "add keys for them or their modules, or use '' for the whole model"
        )
    for names in shared_modules(model):
        module = model.get_submodule(names[0])
        locals_ = [n for n, _ in named_module_tensors(module, recurse=True, remove_duplicate=False)] or [None]
        for local in locals_:
            full = [f"{n}.{local}".strip(".") if local else n for n in names]
            devices = {device_of(device_map, f) if local else _module_device(device_map, f) for f in full}
            if len(devices) > 1:
                raise DeviceMapError(
                    f"device map puts one module registered as {_short(names)} on several devices "
                    f"({sorted(map(str, devices))}): it is one module, give all its names the same device"
                )


def compress_device_map(tensor_devices: Mapping[str, int | str], default: int | str = "cpu") -> DeviceMap:
    """Fewest keys for a per-tensor assignment: a module whose tensors share one device becomes one key.

    ``tensor_devices`` must name every tensor (tied duplicates included); all on one device gives ``{"": device}``.
    """
    tree: dict = {}
    for name, device in tensor_devices.items():
        node = tree
        for part in name.split("."):
            node = node.setdefault(part, {})
        node[None] = device  # a tensor leaf

    def devices(node: dict) -> set:
        found = set()
        for part, child in node.items():
            found |= {child} if part is None else devices(child)
        return found

    result: DeviceMap = {}

    def emit(prefix: str, node: dict) -> None:
        under = devices(node)
        if len(under) == 1:
            result[prefix] = under.pop()
            return
        for part, child in node.items():
            if part is not None:
                emit(f"{prefix}.{part}" if prefix else part, child)

    if not tensor_devices:
        return {"": default}
    emit("", tree)
    return result


def device_order(device: int | str) -> tuple:
    """A sort key for devices: GPUs by index, then mps, cpu, disk, then any other."""
    if isinstance(device, int):
        return (0, device, "")
    order = ("mps", "cpu", "disk")
    return (1, order.index(device) if device in order else len(order), str(device))


def summarize_device_map(
    model: nn.Module,
    device_map: Mapping[str, Any],
    max_memory: Mapping[Any, int | str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> dict[str, Any]:
    """Per device: ``bytes``, ``modules`` (map keys), ``tensors``, ``budget`` (or None) and ``fraction`` of it used.

    Returns ``{"devices": {device: {...}}, "total_bytes": int}``; a tied tensor counts once, where its first name lives.
    """
    device_map = normalize_device_map(device_map)
    budgets = get_max_memory(max_memory, check_devices=False) if max_memory is not None else {}
    sizes = compute_module_sizes(model, dtype=dtype)
    per: dict[Any, dict[str, Any]] = {}

    def slot(device: Any) -> dict[str, Any]:
        return per.setdefault(device, {"bytes": 0, "modules": 0, "tensors": 0})

    for device in device_map.values():
        slot(device)["modules"] += 1
    for name, _ in named_module_tensors(model, recurse=True):
        try:
            device = device_of(device_map, name)
        except DeviceMapError:  # a non-persistent buffer the map need not name
            continue
        info = slot(device)
        info["bytes"] += sizes[name]
        info["tensors"] += 1
    devices = {}
    for device in sorted(per, key=device_order):
        info = per[device]
        budget = budgets.get(device) if device != "disk" else None
        info["budget"] = budget
        info["fraction"] = info["bytes"] / budget if budget else None
        devices[device] = info
    return {"devices": devices, "total_bytes": sizes[""]}
