"""The fill algorithm that turns a model and per-device budgets into a device map (accelerate's
``infer_auto_device_map``)."""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from typing import Any, Mapping

import torch
from torch import nn

from offload_core import devices
from offload_core.errors import DeviceMapError
from offload_core.planning.budgets import budget_device, get_max_memory
from offload_core.planning.device_map import DeviceMap, compress_device_map, device_of
from offload_core.planning.request import PlacementRequest
from offload_core.planning.sizing import compute_module_sizes, get_max_layer_size, is_unsplittable, tensor_aliases
from offload_core.values import is_offloaded, parse_dtype, parse_size

log = logging.getLogger(__name__)
Unit = tuple[str, "nn.Module | torch.Tensor"]


def _direct_units(module: nn.Module, prefix: str) -> list[Unit]:
    """A module's direct parameters, then its children, then its direct buffers, under full names."""

    def full(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    return [
        *((full(n), p) for n, p in module.named_parameters(recurse=False)),
        *((full(n), m) for n, m in module.named_children()),
        *((full(n), b) for n, b in module.named_buffers(recurse=False)),
    ]


def _inside(name: str, outer: str) -> bool:
    return not outer or name == outer or name.startswith(outer + ".")


class _Filler:
    """State of one fill: budgets, bytes used per device, units placed and units offloaded.

    A unit holding one member of a tie group is placed together with the units holding the other
    members, and all of them are charged to that device at once; a unit never splits its direct tensors.
    """

    def __init__(self, request: PlacementRequest, budgets: dict[int | str, int]) -> None:
        self.model = request.model
        self.no_split = set(request.no_split_module_classes or ())
        self.sizes = compute_module_sizes(
            request.model, dtype=parse_dtype(request.dtype), special_dtypes=request.special_dtypes
        )
        self.budgets = budgets
        self.fallback = request.fallback_allocation
        self.fallen_back: set[int | str] = set()
        self.left_with: dict[int | str, int] = {}  # GPUs filled: bytes used plus the room they held back
        self.empty: dict[int | str, int] = {}  # devices that got nothing: the bytes the unit that did not fit needed
        self.gpus = [d for d in budgets if isinstance(d, int)]
        self.has_cpu = "cpu" in budgets
        self.main = {self.gpus[0], "cpu"} if self.gpus else {"cpu"}
        # the planned run executes on the first GPU where there is one: that decides what counts as offloaded
        self.execution = devices.gpu(self.gpus[0]) if self.gpus else torch.device("cpu")
        self.reserve = None
        if request.reserve is not None:
            self.reserve = {
                budget_device(k, "reserve"): parse_size(v, what=f"reserve[{k!r}]") for k, v in request.reserve.items()
            }
        self.used: defaultdict[int | str, int] = defaultdict(int)
        self.placed: dict[str, int | str] = {}
        self.offloaded: list[tuple[Unit, int | str]] = []
        self._unit_max: dict[str, int] = {}
        self.aliases = tensor_aliases(request.model)
        # ties among names the fill can reach (a module registered twice is reached under its first name only)
        reachable = {name for name, _ in request.model.named_modules()}
        groups: defaultdict[str, list[str]] = defaultdict(list)
        for name, first in self.aliases.items():
            if name.rpartition(".")[0] in reachable:
                groups[first].append(name)
        self.groups = {first: names for first, names in groups.items() if len(names) > 1}
        self.group_of = {name: first for first, names in self.groups.items() for name in names}

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
        pending = [u for u, where in self.offloaded if where != device]
        todo = [u for u in todo if not self.is_placed(u[0])]
        return max((self.unit_max(u) for u in [*todo, *pending]), default=0)

    def fits(self, device: int | str, size: int, todo: list[Unit]) -> bool:
        if device == "disk":
            return True
        return self.used[device] + size + self.held_back(device, todo) <= self.budgets[device]

    def is_placed(self, name: str) -> bool:
        return any(_inside(name, p) for p in self.placed)

    def charge(self, name: str) -> int:
        """Bytes of ``name`` not yet charged (parts of it placed early as tie partners are)."""
        placed = sum(self.sizes.get(p, 0) for p in self.placed if p != name and _inside(p, name))
        return self.sizes.get(name, 0) - placed

    # -- ties --------------------------------------------------------------------------------------
    def unit_of(self, tensor_name: str) -> Unit:
        """The unsplittable unit that holds ``tensor_name``."""
        name, obj = "", self.model
        for part in tensor_name.split("."):
            if is_unsplittable(obj, self.no_split):
                break
            name = f"{name}.{part}" if name else part
            obj = obj._modules[part] if part in obj._modules else getattr(obj, part)
        return name, obj

    def partners(self, name: str) -> list[Unit]:
        """Units outside ``name``, not yet placed, that hold a tie partner of a tensor inside ``name``."""
        found: dict[str, Unit] = {}
        for first, members in self.groups.items():
            if not any(_inside(m, name) for m in members):
                continue
            for member in members:
                if _inside(member, name):
                    continue
                unit = self.unit_of(member)
                if unit[0] not in found and not any(_inside(unit[0], p) for p in self.placed):
                    found[unit[0]] = unit
        return list(found.values())

    # -- placing -------------------------------------------------------------------------------
    def put(self, units: list[Unit], device: int | str) -> None:
        for unit in units:
            self.used[device] += self.charge(unit[0])
            self.placed[unit[0]] = device
            if is_offloaded(device, self.execution):
                self.offloaded.append((unit, device))

    def first_fitting(self, device: int | str, todo: list[Unit]) -> list[Unit] | None:
        """``fallback_allocation``: the first unsplittable unit of ``todo`` (breadth first) that fits, with its
        partners."""
        queue = list(todo)
        while queue:
            name, obj = queue.pop(0)
            if is_unsplittable(obj, self.no_split):
                group = [(name, obj), *self.partners(name)]
                if self.fits(device, sum(self.charge(u[0]) for u in group), todo):
                    return group
            else:
                queue.extend(_direct_units(obj, name))
        return None

    def run(self) -> dict[str, int | str]:
        current = 0
        todo = _direct_units(self.model, "")
        while todo:
            unit = todo.pop(0)
            name, obj = unit
            if self.is_placed(name):
                continue
            group = [unit, *self.partners(name)]
            size = sum(self.charge(u[0]) for u in group)
            leaf = is_unsplittable(obj, self.no_split)
            if current < len(self.gpus):
                device = self.gpus[current]
                if self.fits(device, size, todo):
                    self.put(group, device)
                elif not leaf:
                    todo[:0] = _direct_units(obj, name)
                else:
                    todo.insert(0, unit)
                    if self.used[device] == 0 and self.fallback and device not in self.fallen_back:
                        self.fallen_back.add(device)
                        group = self.first_fitting(device, todo)
                        if group is not None:
                            self.put(group, device)
                            continue
                    if self.used[device] == 0:
                        self.empty[device] = size + self.held_back(device, todo)
                    self.left_with[device] = self.used[device] + self.held_back(device, todo)
                    current += 1
                continue
            # Past the GPUs cpu and disk feed the same execution device, so their order does not matter:
            # a unit that fits on cpu goes there even after an earlier one went to disk.
            if self.has_cpu and self.fits("cpu", size, todo):
                self.put(group, "cpu")
            elif self.has_cpu and not leaf:
                todo[:0] = _direct_units(obj, name)
            else:
                self.put(group, "disk")
        if self.empty:
            needs = ", ".join(f"{device}: {nbytes} bytes required" for device, nbytes in self.empty.items())
            log.info(
                "no modules could be assigned to these devices due to insufficient memory (%s); give them at "
                "least that much, or plan with fallback_allocation=True",
                needs,
            )
        return self.placed

    def tensor_devices(self) -> dict[str, int | str]:
        devices = {}
        for name, first in self.aliases.items():
            try:
                devices[name] = device_of(self.placed, name)
            except DeviceMapError:  # a name under a module registered twice: it lives with its first name
                devices[name] = device_of(self.placed, first)
        return devices

    def offloaded_buffer_bytes(self) -> int:
        return sum(
            self.sizes.get(f"{u[0]}.{b}" if u[0] else b, 0)
            for u, _ in self.offloaded
            if isinstance(u[1], nn.Module)
            for b, _ in u[1].named_buffers()
        )


def _fill(request: PlacementRequest, max_memory: Mapping[Any, int | str] | None) -> _Filler:
    budgets = get_max_memory(max_memory if max_memory is not None else request.max_memory, check_devices=False)
    filler = _Filler(request, budgets)
    filler.run()
    return filler


def plan_device_map(request: PlacementRequest, max_memory: Mapping[Any, int | str] | None = None) -> DeviceMap:
    """Fill devices in order (GPUs by id, then cpu, then disk) with the model's units; return a compressed device map.

    ``max_memory`` overrides ``request.max_memory`` (balanced placements pass capped budgets).
    """
    filler = _fill(request, max_memory)
    return compress_device_map(filler.tensor_devices(), default=next(iter(filler.budgets), "disk"))


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    *,
    reserve: Mapping[Any, int | str] | None = None,
) -> DeviceMap:
    """A device map for ``model`` filling GPUs in order, then cpu, then disk (accelerate's signature).

    ``clean_result=False`` returns one key per placed unit instead of the fewest keys. Without
    ``offload_buffers`` a warning says when the buffers of offloaded modules will not fit on a GPU.
    ``reserve`` (ours) replaces the room held back on the main devices (see :class:`PlacementRequest`).
    Other placements (balanced, plugins) are chosen by name where a model is dispatched.
    """
    request = PlacementRequest(
        model=model,
        max_memory=get_max_memory(max_memory),
        no_split_module_classes=list(no_split_module_classes or []),
        dtype=parse_dtype(dtype),
        special_dtypes=special_dtypes,
        reserve=reserve,
        fallback_allocation=fallback_allocation,
    )
    filler = _fill(request, None)
    if verbose:
        for name, device in filler.placed.items():
            log.info("Putting %s (size=%d) on %s", name, filler.sizes.get(name, 0), device)
    if not offload_buffers and filler.gpus:
        buffers = filler.offloaded_buffer_bytes()
        room = max(filler.budgets[g] - filler.left_with.get(g, filler.used[g]) for g in filler.gpus)
        if buffers > room:
            warnings.warn(
                f"Current model requires {buffers} bytes of buffer for offloaded layers, which seems does not fit any "
                "GPU's remaining memory. "
                "If you are experiencing a OOM later, please consider using offload_buffers=True.",
                stacklevel=2,
            )
    if not clean_result:
        return dict(filler.placed)
    return compress_device_map(filler.tensor_devices(), default=next(iter(filler.budgets), "disk"))
