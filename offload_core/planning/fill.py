"""The fill algorithm that turns a model and per-device budgets into a device map, and the request placements receive."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.errors import DeviceMapError
from offload_core.planning.budgets import device_key, get_max_memory
from offload_core.planning.device_map import DeviceMap, compress_device_map, device_of
from offload_core.planning.sizing import compute_module_sizes, get_max_layer_size, is_unsplittable, tensor_aliases
from offload_core.values import parse_dtype, parse_size

Unit = tuple[str, "nn.Module | torch.Tensor"]


@dataclass
class PlacementRequest:
    """What a placement needs to make a device map.

    ``max_memory`` maps devices (int GPU ids, ``"cpu"``, ``"disk"``) to bytes. ``reserve`` is ``None``
    for the reference rule (the main devices hold back room for the largest unit still offloadable) or a
    dict of bytes held back per device instead (``{"cpu": 0}``: none; devices not named hold back nothing).
    """

    model: nn.Module
    max_memory: Mapping[Any, int | str] | None = None
    no_split_module_classes: list[str] = field(default_factory=list)
    dtype: torch.dtype | str | None = None
    special_dtypes: Mapping[str, torch.dtype | str] | None = None
    reserve: Mapping[Any, int | str] | None = None


def _direct_units(module: nn.Module, prefix: str) -> list[Unit]:
    """A module's direct parameters, then its children, then its direct buffers, under full names."""
    def full(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    return [
        *((full(n), p) for n, p in module.named_parameters(recurse=False)),
        *((full(n), m) for n, m in module.named_children()),
        *((full(n), b) for n, b in module.named_buffers(recurse=False)),
    ]


class _Filler:
    """State of one fill: budgets, bytes used per device, units placed and units offloaded."""

    def __init__(self, request: PlacementRequest, budgets: dict[int | str, int]) -> None:
        self.model = request.model
        self.no_split = set(request.no_split_module_classes or ())
        self.sizes = compute_module_sizes(request.model, dtype=parse_dtype(request.dtype), special_dtypes=request.special_dtypes)
        self.budgets = budgets
        self.gpus = [d for d in budgets if isinstance(d, int)]
        self.has_cpu = "cpu" in budgets
        self.main = {self.gpus[0], "cpu"} if self.gpus else {"cpu"}
        self.tiers = {"cpu", "disk"} if self.gpus else {"disk"}
        self.reserve = None
        if request.reserve is not None:
            self.reserve = {device_key(k): parse_size(v, what=f"reserve[{k!r}]") for k, v in request.reserve.items()}
        self.used: defaultdict[int | str, int] = defaultdict(int)
        self.placed: dict[str, int | str] = {}
        self.offloaded: list[tuple[Unit, int | str]] = []
        self._unit_max: dict[str, int] = {}
        self.aliases = tensor_aliases(request.model)
        groups: defaultdict[str, list[str]] = defaultdict(list)
        for name, first in self.aliases.items():
            groups[first].append(name)
        self.tied = {name: first for name, first in self.aliases.items() if len(groups[first]) > 1}
        self.group_device: dict[str, int | str] = {}

    # -- sizes and reservation -------------------------------------------------------------------
    def unit_max(self, unit: Unit) -> int:
        name = unit[0]
        if name not in self._unit_max:
            self._unit_max[name] = get_max_layer_size([unit], self.sizes, self.no_split)[0]
        return self._unit_max[name]

    def held_back(self, device: int | str, todo: list[Unit]) -> int:
        if device == "disk":
            return 0
        if self.reserve is not None:
            return self.reserve.get(device, 0)
        if device not in self.main:
            return 0
        pending = [u for u, where in self.offloaded if where in self.tiers and where != device]
        return max((self.unit_max(u) for u in [*todo, *pending]), default=0)

    def fits(self, device: int | str, size: int, todo: list[Unit]) -> bool:
        if device == "disk":
            return True
        return self.used[device] + size + self.held_back(device, todo) <= self.budgets[device]

    # -- placing -------------------------------------------------------------------------------
    def put(self, unit: Unit, device: int | str) -> None:
        name = unit[0]
        self.placed[name] = device
        self.used[device] += self.sizes.get(name, 0)
        if device in self.tiers:
            self.offloaded.append((unit, device))
        for tensor in self.tied_under(name):
            self.group_device.setdefault(self.tied[tensor], device)

    def tied_under(self, name: str) -> list[str]:
        if not self.tied:
            return []
        if not name:
            return list(self.tied)
        return [t for t in self.tied if t == name or t.startswith(name + ".")]

    def pinned_device(self, name: str) -> int | str | None:
        for tensor in self.tied_under(name):
            device = self.group_device.get(self.tied[tensor])
            if device is not None:
                return device
        return None

    def splits_into_tensors(self, obj: nn.Module | torch.Tensor) -> bool:
        """A leaf module (not a no-split class) with several direct tensors may give up its tied one alone."""
        return isinstance(obj, nn.Module) and type(obj).__name__ not in self.no_split and len(_direct_units(obj, "")) > 1

    def split(self, unit: Unit) -> list[Unit]:
        return _direct_units(unit[1], unit[0])

    def run(self) -> dict[str, int | str]:
        sequence = [*self.gpus, *(["cpu"] if self.has_cpu else []), "disk"]
        current = 0
        todo = _direct_units(self.model, "")
        while todo:
            unit = todo.pop(0)
            name, obj = unit
            size = self.sizes.get(name, 0)
            leaf = is_unsplittable(obj, self.no_split)
            pinned = self.pinned_device(name)
            if pinned is not None:
                # a tied tensor stays with its first occurrence: split down to it unless the unit fits there
                if not leaf:
                    todo[:0] = self.split(unit)
                elif self.fits(pinned, size, todo) or not self.splits_into_tensors(obj):
                    self.put(unit, pinned)
                else:
                    todo[:0] = self.split(unit)
                continue
            if current < len(self.gpus):
                device = sequence[current]
                if self.fits(device, size, todo):
                    self.put(unit, device)
                elif not leaf:
                    todo[:0] = self.split(unit)
                else:
                    current += 1
                    todo.insert(0, unit)
                continue
            # Past the GPUs cpu and disk feed the same execution device, so their order does not matter:
            # a unit that fits on cpu goes there even after an earlier one went to disk.
            if self.has_cpu and self.fits("cpu", size, todo):
                self.put(unit, "cpu")
            elif self.has_cpu and not leaf:
                todo[:0] = self.split(unit)
            else:
                self.put(unit, "disk")
        return self.placed

    def tensor_devices(self) -> dict[str, int | str]:
        devices = {}
        for name, first in self.aliases.items():
            try:
                devices[name] = device_of(self.placed, name)
            except DeviceMapError:  # a name under a module registered twice: it lives with its first name
                devices[name] = device_of(self.placed, first)
        return devices


def plan_device_map(request: PlacementRequest, max_memory: Mapping[Any, int | str] | None = None) -> DeviceMap:
    """Fill devices in order (GPUs by id, then cpu, then disk) with the model's units; return a compressed device map.

    ``max_memory`` overrides ``request.max_memory`` (balanced placements pass capped budgets).
    """
    budgets = get_max_memory(max_memory if max_memory is not None else request.max_memory, check_devices=False)
    filler = _Filler(request, budgets)
    filler.run()
    first = next(iter(budgets), "disk")
    return compress_device_map(filler.tensor_devices(), default=first)


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    strategy: str = "sequential",
    reserve: Mapping[Any, int | str] | None = None,
) -> DeviceMap:
    """A device map for ``model`` made by the placement ``strategy`` (``sequential``, ``balanced``, ``balanced_low_0`` or a plugin's)."""
    from offload_core.registry.manager import get_registry

    request = PlacementRequest(
        model=model,
        max_memory=get_max_memory(max_memory, check_devices=False),
        no_split_module_classes=list(no_split_module_classes or []),
        dtype=parse_dtype(dtype),
        special_dtypes=special_dtypes,
        reserve=reserve,
    )
    return get_registry().create("placement", strategy).make_device_map(request)
