"""Units of offloaded tensors: which module brings which tensors in, how, and the counters of what moved."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol

import torch
from torch import nn

from offload_core.errors import ConfigError
from offload_core.planning.sizing import reads_its_children
from offload_core.storage.base import as_store, moved_bytes


@dataclass
class TransferStats:
    """Counts what module hooks moved: tensors and bytes brought in."""

    loads: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_unit(self, fetched: Mapping[str, torch.Tensor], store: Mapping[str, torch.Tensor] | None = None) -> None:
        """Count one unit brought in: its tensors and the bytes they moved (from ``store``: its quantized blocks
        where it holds them so, :func:`~offload_core.storage.base.moved_bytes`)."""
        nbytes = sum(moved_bytes(store, key, t.numel() * t.element_size()) for key, t in fetched.items())
        self.add_moved(len(fetched), nbytes)

    def add_moved(self, tensors: int, nbytes: int) -> None:
        """Count one unit activation that moved ``nbytes`` (tied tensors already there move nothing)."""
        with self._lock:
            self.loads += tensors
            self.bytes += nbytes

    def snapshot(self) -> dict[str, int]:
        return {"loads": self.loads, "bytes": self.bytes}

    def reset(self) -> None:
        self.loads = self.bytes = 0


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


def as_param(value: torch.Tensor, requires_grad: bool = False) -> nn.Parameter:
    # Keep the flag the model's own parameter had: kernels take different paths on it (torch's CPU
    # bf16 linear copies a whole weight that does not require grad), so the offloaded model runs
    # exactly the arithmetic of the in-memory one.
    if isinstance(value, nn.Parameter):
        return value
    return nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())


def tensor_spec(store: Mapping[str, torch.Tensor], key: str) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype ``store[key]`` hands out, without converting it where the store can tell."""
    return as_store(store).spec(key)


def tensor_nbytes(store: Mapping[str, torch.Tensor], key: str) -> int:
    """The bytes of ``store[key]`` (:func:`tensor_spec`)."""
    shape, dtype = tensor_spec(store, key)
    return math.prod(shape) * dtype.itemsize


def stored_nbytes(store: Mapping[str, torch.Tensor], key: str) -> int:
    """The bytes the store holds ``store[key]`` in (a GGUF file's quantized blocks; else :func:`tensor_nbytes`): what a
    read of it moves, and what its pages take in the page cache."""
    return moved_bytes(store, key, tensor_nbytes(store, key))


class UnitObserver(Protocol):
    """Told when a unit's tensors are about to be used and when it is done with them (the page-cache keeper)."""

    def fetching(self, unit: "Unit") -> None: ...

    def used(self, unit: "Unit") -> None: ...


@dataclass
class Unit:
    """A module whose offloaded tensors (its own, or its whole subtree's for a block) move together."""

    name: str
    module: nn.Module
    slots: list[Slot]
    loaded: bool = False
    observer: UnitObserver | None = None

    @property
    def keys(self) -> list[str]:
        return list(dict.fromkeys(s.key for s in self.slots))

    def nbytes(self, store: Mapping[str, torch.Tensor]) -> int:
        return sum(tensor_nbytes(store, key) for key in self.keys)

    def stored_nbytes(self, store: Mapping[str, torch.Tensor]) -> int:
        """The bytes the store holds the unit in (:func:`stored_nbytes` of each key): what its pages take in the page
        cache."""
        return sum(stored_nbytes(store, key) for key in self.keys)

    def fetch(
        self, store: Mapping[str, torch.Tensor], device: torch.device, non_blocking: bool = False
    ) -> dict[str, torch.Tensor]:
        """The unit's tensors on ``device``, one per store key (tied names share one tensor).

        Read with inference mode off, even inside a forward run under it: a tensor made under it (a store's lazy
        view, a copy to the device) is an inference tensor, which torch's CPU matmul treats like a weight that
        does not require grad (see :func:`as_param`)."""
        if self.observer is not None:
            self.observer.fetching(self)
        fetched = {}
        with torch.inference_mode(False):
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
                params[slot.key] = as_param(
                    fetched[slot.key], bool(slot.original is not None and slot.original.requires_grad)
                )
        return params

    def load(
        self,
        store: Mapping[str, torch.Tensor],
        device: torch.device,
        stats: TransferStats | None,
        non_blocking: bool = False,
        fetched: dict[str, torch.Tensor] | None = None,
        params: dict[str, nn.Parameter] | None = None,
    ) -> None:
        """Put the unit's tensors in place on ``device`` (no-op when already loaded); ``params``: the parameters
        :meth:`as_params` made of ``fetched`` before, reused."""
        if self.loaded:
            return
        if fetched is None:
            fetched = self.fetch(store, device, non_blocking)
        elif self.observer is not None:
            self.observer.fetching(self)
        if params is None:
            params = self.as_params(fetched)
        for slot in self.slots:
            slot.set(params[slot.key] if slot.is_param else fetched[slot.key])
        self.loaded = True
        if stats is not None:
            stats.add_unit(fetched, store)

    def release(self) -> None:
        """Put the placeholders back; the loaded tensors are dropped (no-op when not loaded)."""
        if not self.loaded:
            return
        for slot in self.slots:
            slot.set(slot.original)
        self.loaded = False
        self.used()

    def used(self) -> None:
        """The tensors fetched for a call are no longer needed (:meth:`release` says it; a policy that
        fetches without loading says it after the call)."""
        if self.observer is not None:
            self.observer.used(self)


GRANULARITIES = ("module", "block")


def check_granularity(granularity: str) -> str:
    """``granularity`` when it is one :func:`find_units` knows; otherwise a :class:`ConfigError` saying which are."""
    if granularity not in GRANULARITIES:
        raise ConfigError(f"hook.granularity={granularity!r} is unknown: use 'module' or 'block'")
    return granularity


def _direct_slots(prefix: str, module: nn.Module, offloaded: Mapping[str, str]) -> list[Slot]:
    slots = []
    for table, is_param in ((module._parameters, True), (module._buffers, False)):
        for local, tensor in table.items():
            full = f"{prefix}.{local}" if prefix else local
            if tensor is not None and full in offloaded:
                slots.append(Slot(module, local, full, offloaded[full], is_param, tensor))
    return slots


def subtree_slots(prefix: str, module: nn.Module, offloaded: Mapping[str, str]) -> list[Slot]:
    """The offloaded tensors of ``module`` (named ``prefix``) and of every module below it."""
    return [s for sub_name, sub in module.named_modules(prefix=prefix) for s in _direct_slots(sub_name, sub, offloaded)]


def _is_block(module: nn.Module, no_split: Iterable[str]) -> bool:
    return type(module).__name__ in set(no_split) or not any(True for _ in module.children())


def find_units(
    model: nn.Module,
    offloaded: Mapping[str, str],
    no_split_module_classes: Iterable[str] = (),
    granularity: str = "module",
) -> list[Unit]:
    """Group offloaded tensors into units, in module order.

    ``granularity="module"``: each module that owns offloaded tensors is a unit of its direct tensors
    (one transfer per module); one that reads its children's weights itself, a unit of its subtree's
    (:func:`~offload_core.planning.sizing.reads_its_children`). ``"block"``: each no-split block (or leaf
    module) is one unit of every offloaded tensor below it — fewer, larger transfers; tensors owned
    directly by containers above the blocks form units of their own.
    """
    check_granularity(granularity)
    units: list[Unit] = []
    if not offloaded:
        return units
    if granularity == "module":
        whole: list[str] = []  # modules that read their children's weights: one unit with their subtree
        for name, module in model.named_modules():
            if any(name.startswith(prefix + ".") for prefix in whole):
                continue
            if reads_its_children(module):
                whole.append(name)
            slots = subtree_slots(name, module, offloaded) if name in whole else _direct_slots(name, module, offloaded)
            if slots:
                units.append(Unit(name, module, slots))
        return units

    no_split = list(no_split_module_classes)

    def visit(prefix: str, module: nn.Module) -> None:
        if _is_block(module, no_split):
            slots = subtree_slots(prefix, module, offloaded)
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
