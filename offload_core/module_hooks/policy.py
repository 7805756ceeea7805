"""What a module-hook policy is given when it attaches (PolicyContext) and what it hands back (PolicyHandle)."""

from __future__ import annotations

from abc import abstractmethod

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.alignment import empty_at
from offload_core.module_hooks.units import TransferStats, Unit, as_param
from offload_core.planning.reservation import InFlight, reserve_units
from offload_core.storage.base import as_store
from offload_core.storage.residency import Residency
from offload_core.strategy import StrategyBase


@dataclass
class PolicyContext:
    """What a module-hook policy needs to attach to a model.

    ``offloaded`` maps every offloaded tensor name (tied aliases included) to its key in ``store``.
    ``device_map`` is the checked map; ``execution_device`` runs everything not resident on a GPU.
    ``non_blocking``: copies from the store to the execution device may be asynchronous (the store's
    memory is page-locked and the run executes on a GPU). ``residency``: which offloaded blocks stay in
    the page cache across tokens and which are streamed (policies that stream blocks honour it).
    """

    device_map: dict[str, int | str]
    execution_device: torch.device
    store: Mapping[str, torch.Tensor] | None = None
    offloaded: dict[str, str] = field(default_factory=dict)
    no_split_module_classes: list[str] = field(default_factory=list)
    stats: TransferStats = field(default_factory=TransferStats)
    non_blocking: bool = False
    residency: Residency | None = None


class PolicyHandle:
    """What attaching a policy returns: its counters, ``offload_all()`` and ``remove()`` that restores the model."""

    def __init__(self, model: nn.Module, context: PolicyContext, units: list[Unit], handles: list[Any]) -> None:
        self.model = model
        self.context = context
        self.units = units
        self.handles = handles
        self.removed = False

    @property
    def stats(self) -> TransferStats:
        return self.context.stats

    def counters(self) -> dict[str, int | float]:
        """The policy's own counters since attach, by name (the runner prints them and writes them to
        ``metrics.json``); a name ending in ``_s`` is seconds. By default, the kept set's figures
        (:meth:`Residency.counters`) where the run keeps one, else none."""
        residency = self.context.residency
        return dict(residency.counters()) if residency is not None else {}

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
        if self.context.residency is not None:
            self.context.residency.settle()  # no drop runs after the hooks are gone
        store = self.context.store
        device = torch.device(restore_device)
        restored: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for slot in unit.slots:
                if slot.key not in restored:
                    value = _restored(store, slot.key, device)
                    requires_grad = bool(slot.original is not None and slot.original.requires_grad)
                    restored[slot.key] = as_param(value, requires_grad) if slot.is_param else value
                slot.set(restored[slot.key])
        self.removed = True
        return self.model


def _restored(store: Mapping[str, torch.Tensor], key: str, device: torch.device) -> torch.Tensor:
    """A real copy of ``store[key]`` on ``device``; on the cpu at the tensor's reference address offset (where the
    model's in-memory load puts it, :mod:`offload_core.alignment`), so the restored model computes as that one does."""
    value = store[key]
    if device.type != "cpu":
        return value.to(device, copy=True)
    return empty_at(value.shape, value.dtype, as_store(store).offset(key)).copy_(value)


class Policy(StrategyBase):
    """Brings offloaded tensors in around each unit's forward: ``attach`` wraps the model's modules."""

    #: the unit a policy moves: "block" (a no-split block) or "module" (each module owning tensors)
    granularity: str = "block"
    #: buffers are offloaded with the parameters (otherwise they stay on the execution device)
    offload_buffers: bool = False
    #: the policy honours ``PolicyContext.residency``: it keeps the kept set cached across tokens and
    #: drops each streamed block's pages once the block has run
    keeps_page_cache: bool = False
    #: reads of offloaded units overlap compute (a reader ahead of the forward); the time prediction reads it
    overlaps_io: bool = False
    #: on a GPU, a store's packed tensors (``Store.packed``) are copied as held and decoded on the device, not on the
    #: host; the time prediction reads it
    decodes_on_device: bool = False

    @abstractmethod
    def attach(self, model: nn.Module, context: PolicyContext) -> PolicyHandle:
        """Attach module hooks to ``model``; the handle reports counters and removes them."""

    def reserve(self, need: InFlight) -> dict[Any, int]:
        """Bytes the units in flight take on each device (held back from the budgets): one block."""
        return reserve_units(need, need.block_bytes)

    def lighter(self) -> tuple[Policy, str] | None:
        """This policy holding fewer units in flight, and the option that says so (``hook.depth=1``), for a plan whose
        budget cannot hold what its :meth:`reserve` asks; None (the default): it cannot hold fewer."""
        return None

    def predict_moved(self, unit_bytes: list[int]) -> int:
        """Bytes brought in per forward, given each offloaded unit's bytes: every unit once."""
        return sum(unit_bytes)

    def takes_part_in(self, model: nn.Module) -> bool:
        """Whether ``auto=true`` considers this policy for ``model`` (one that would run it as another policy does
        says no). Yes by default."""
        return True

    def read_shares(self, model: nn.Module) -> dict[str, tuple[float, int]]:
        """Per tensor (by its name in ``model``) the policy reads only part of each forward: the share of its bytes
        read and how many reads that takes. None by default: every offloaded tensor is read whole, once. The plan keeps
        the tensors read whole where the run computes before these (:mod:`offload_core.planning.shares`)."""
        return {}

    def plan_lines(self) -> list[str]:
        """Lines the policy adds to the printed plan (what it holds back and why), after :meth:`reserve`. None by
        default."""
        return []

    def own_device_map(self, model: nn.Module, execution_device: torch.device) -> dict[str, int | str] | None:
        """A device map the policy decides itself (a user's ``device_map`` file still comes first), or
        None to leave it to the placement."""
        return None

    def own_map_remedy(self, model: nn.Module, execution_device: torch.device, device: Any, short: int) -> str:
        """What the user can change in the policy's options so that its own map puts ``short`` fewer bytes on
        ``device`` (the runner refuses a map over a budget in one line, naming this); empty when none."""
        return ""
