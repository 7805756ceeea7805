"""Units of offloaded tensors: which module brings which tensors in, how, and the counters of what moved."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn


@dataclass
class TransferStats:
    """Counts what module hooks moved: tensors and bytes brought in, and unit activations."""

    loads: int = 0
    bytes: int = 0
    unit_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_unit(self, fetched: Mapping[str, torch.Tensor]) -> None:
        """Count one unit brought in: its tensors and their bytes."""
        self.add_moved(len(fetched), sum(t.numel() * t.element_size() for t in fetched.values()))

    def add_moved(self, tensors: int, nbytes: int) -> None:
        """Count one unit activation that moved ``nbytes`` (tied tensors already there move nothing)."""
        with self._lock:
            self.loads += tensors
            self.bytes += nbytes
            self.unit_calls += 1

    def snapshot(self) -> dict[str, int]:
        return {"loads": self.loads, "bytes": self.bytes, "unit_calls": self.unit_calls}

    def reset(self) -> None:
        self.loads = self.bytes = self.unit_calls = 0


@dataclass
class Slot:
    """One offloaded tensor slot: ``owner._parameters[local]`` (or ``_buffers``) and its store key."""

    owner: nn.Module
    local: str
    full: str
    key: str
    is_param: bool
    original: torch.Tensor | None  # what sits there while not loaded (a meta tensor)

    def set(self, value: torch.Tensor | None) -> None:
        (self.owner._parameters if self.is_param else self.owner._buffers)[self.local] = value


def _as_param(value: torch.Tensor, requires_grad: bool = False) -> nn.Parameter:
    # Keep the flag the model's own parameter had: kernels take different paths on it (torch's CPU
    # bf16 linear copies a whole weight that does not require grad), so the offloaded model runs
    # exactly the arithmetic of the in-memory one.
    if isinstance(value, nn.Parameter):
        return value
    return nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())


@dataclass
class Unit:
    """A module whose offloaded tensors (its own, or its whole subtree's for a block) move together."""

    name: str
    module: nn.Module
    slots: list[Slot]
    loaded: bool = False

    @property
    def keys(self) -> list[str]:
        return list(dict.fromkeys(s.key for s in self.slots))

    def nbytes(self, store: Mapping[str, torch.Tensor]) -> int:
        return sum(store[k].numel() * store[k].element_size() for k in self.keys)

    def fetch(self, store: Mapping[str, torch.Tensor], device: torch.device, non_blocking: bool = False) -> dict[str, torch.Tensor]:
        """The unit's tensors on ``device``, one per store key (tied names share one tensor)."""
        fetched = {}
        for key in self.keys:
            value = store[key]
            if value.device != device:
                value = value.to(device, non_blocking=non_blocking)
            fetched[key] = value
        return fetched

    def as_params(self, fetched: dict[str, torch.Tensor]) -> dict[str, nn.Parameter]:
        """One parameter per store key (tied names share it), flagged like the model's own parameter."""
        params: dict[str, nn.Parameter] = {}
        for slot in self.slots:
            if slot.is_param and slot.key not in params:
                params[slot.key] = _as_param(fetched[slot.key], bool(slot.original is not None and slot.original.requires_grad))
        return params

    def load(self, store: Mapping[str, torch.Tensor], device: torch.device, stats: TransferStats | None,
             non_blocking: bool = False, fetched: dict[str, torch.Tensor] | None = None) -> None:
        """Put the unit's tensors in place on ``device`` (no-op when already loaded)."""
        if self.loaded:
            return
        fetched = fetched if fetched is not None else self.fetch(store, device, non_blocking)
        params = self.as_params(fetched)
        for slot in self.slots:
            slot.set(params[slot.key] if slot.is_param else fetched[slot.key])
        self.loaded = True
        if stats is not None:
            stats.add_unit(fetched)

    def release(self) -> None:
        """Put the placeholders back; the loaded tensors are dropped (no-op when not loaded)."""
        if not self.loaded:
            return
        for slot in self.slots:
            slot.set(slot.original)
        self.loaded = False


@dataclass
class DispatchPlan:
    """What a module-hook policy needs to attach to a model.

    ``offloaded`` maps every offloaded tensor name (tied aliases included) to its key in ``store``.
    ``device_map`` is the checked map; ``execution_device`` runs everything not resident on a GPU.
    """

    device_map: dict[str, int | str]
    execution_device: torch.device
    store: Mapping[str, torch.Tensor] | None = None
    offloaded: dict[str, str] = field(default_factory=dict)
    no_split_module_classes: list[str] = field(default_factory=list)
    stats: TransferStats = field(default_factory=TransferStats)

    @property
    def non_blocking(self) -> bool:
        return bool(getattr(self.store, "pinned", False)) and self.execution_device.type == "cuda"


@dataclass(frozen=True)
class InFlight:
    """What the planner tells a policy's ``reserve`` so it can size the memory its units in flight take.

    The placement holds the bytes ``reserve`` returns back from each device's budget before filling it.
    """

    execution_device: torch.device
    block_bytes: int  # the largest no-split block (the largest module where there are no blocks)
    module_bytes: int  # the largest single module owning tensors
    store_converts: bool = False  # the store hands out converted copies, not views, of some tensors
    store_pinned: bool = False  # the store's memory is page-locked: copies to a GPU need no staging


def reserve_units(need: InFlight, unit_bytes: int, count: int = 1, copies_on_cpu: bool = False) -> dict[Any, int]:
    """The usual answer: room for ``count`` units of ``unit_bytes`` on the execution device.

    On a CPU run a mapped store hands out views of file-backed pages, so no room is needed unless the
    units in flight are copies (``copies_on_cpu``, or a store that converts on read).
    """
    if need.execution_device.type == "cpu":
        return {"cpu": unit_bytes * count if copies_on_cpu or need.store_converts else 0}
    return {need.execution_device.index or 0: unit_bytes * count}


def policy_reservation(policy: Any, need: InFlight) -> dict[Any, int]:
    """``policy.reserve(need)`` where the policy defines it; otherwise one block in flight."""
    reserve = getattr(policy, "reserve", None)
    return dict(reserve(need)) if reserve is not None else reserve_units(need, need.block_bytes)


def _direct_slots(prefix: str, module: nn.Module, offloaded: Mapping[str, str]) -> list[Slot]:
    slots = []
    for table, is_param in ((module._parameters, True), (module._buffers, False)):
        for local, tensor in table.items():
            full = f"{prefix}.{local}" if prefix else local
            if tensor is not None and full in offloaded:
                slots.append(Slot(module, local, full, offloaded[full], is_param, tensor))
    return slots


def _is_block(module: nn.Module, no_split: Iterable[str]) -> bool:
    return type(module).__name__ in set(no_split) or not any(True for _ in module.children())


def find_units(model: nn.Module, offloaded: Mapping[str, str], no_split_module_classes: Iterable[str] = (),
               granularity: str = "module") -> list[Unit]:
    """Group offloaded tensors into units, in module order.

    ``granularity="module"``: each module that owns offloaded tensors is a unit of its direct tensors
    (the seed's per-module behaviour). ``"block"``: each no-split block (or leaf module) is one unit of
    every offloaded tensor below it — fewer, larger transfers; tensors owned directly by containers
    above the blocks form units of their own.
    """
    if granularity not in ("module", "block"):
        raise ValueError(f"granularity must be 'module' or 'block', got {granularity!r}")
    units: list[Unit] = []
    if not offloaded:
        return units
    if granularity == "module":
        for name, module in model.named_modules():
            slots = _direct_slots(name, module, offloaded)
            if slots:
                units.append(Unit(name, module, slots))
        return units

    no_split = list(no_split_module_classes)

    def visit(prefix: str, module: nn.Module) -> None:
        if _is_block(module, no_split):
            slots = [s for sub_name, sub in module.named_modules(prefix=prefix) for s in _direct_slots(sub_name, sub, offloaded)]
            if slots:
                units.append(Unit(prefix, module, slots))
            return
        slots = _direct_slots(prefix, module, offloaded)
        if slots:
            units.append(Unit(prefix, module, slots))
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    return units


class PolicyHandle:
    """What attaching a policy returns: its counters, and ``remove()`` that restores the model."""

    def __init__(self, model: nn.Module, plan: DispatchPlan, units: list[Unit], handles: list[Any]) -> None:
        self.model = model
        self.plan = plan
        self.units = units
        self.handles = handles
        self.removed = False

    @property
    def stats(self) -> TransferStats:
        return self.plan.stats

    def offload_all(self) -> None:
        """Release every loaded unit (the chained policy keeps the last one loaded until this)."""
        for unit in self.units:
            unit.release()

    def remove(self, restore_device: torch.device | str = "cpu") -> nn.Module:
        """Detach every module hook and put real copies of the offloaded tensors back (ties kept)."""
        if self.removed:
            return self.model
        for handle in reversed(self.handles):
            handle.remove()
        self.offload_all()
        store = self.plan.store
        device = torch.device(restore_device)
        restored: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for slot in unit.slots:
                if slot.key not in restored:
                    value = store[slot.key].to(device, copy=True)
                    requires_grad = bool(slot.original is not None and slot.original.requires_grad)
                    restored[slot.key] = _as_param(value, requires_grad) if slot.is_param else value
                slot.set(restored[slot.key])
        self.removed = True
        return self.model
