"""What the planner holds back for a policy's units in flight: the facts it gives a policy (InFlight) and the usual
answer (reserve_units)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from offload_core.values import budget_key


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
    store_scratch: int = 0  # device bytes a policy that decodes the store's packed tensors there takes for it
    #: device bytes of one scratch that decodes routed experts of fused expert tensors the store packs, for a policy
    #: that reads them an expert at a time (0: their rows cross as the store hands them out)
    experts_scratch: int = 0
    model: Any = None  # the model being planned (on the meta device), for policies that size by its modules
    dtype: Any = None  # the run's dtype (None: each tensor's own)
    cpu_budget: int | None = None  # the cpu budget the placement fills (None: not known)
    device_budget: int | None = None  # the execution device's budget, on an accelerator (None: not known)
    no_split_module_classes: tuple[str, ...] = ()  # the model's blocks, for policies that size by its units
    store_maps: bool = (
        False  # the store hands out views (mapped files, its own memory): a CPU run computes on them in place
    )
    #: the tensors the device map offloads (name -> store key), of which the units in flight are made (``block_bytes``
    #: and ``module_bytes`` are then their largest); None: every tensor, a bound for any map (no map yet)
    offloaded: Mapping[str, str] | None = None
    #: of the ``offloaded`` tensors, the names the store hands out as copies (None: not said; ``store_converts`` says
    #: whether any), for a policy that moves some of them otherwise than the rest
    copied: frozenset[str] | None = None


def reserve_units(need: InFlight, unit_bytes: int, count: int = 1, copies_on_cpu: bool = False) -> dict[Any, int]:
    """The usual answer: room for ``count`` units of ``unit_bytes`` on the execution device.

    On a CPU run a mapped store hands out views of file-backed pages, so no room is needed unless the
    units in flight are copies (``copies_on_cpu``, or a store that converts on read).
    """
    if need.execution_device.type == "cpu":
        return {"cpu": unit_bytes * count if copies_on_cpu or need.store_converts else 0}
    return {budget_key(need.execution_device): unit_bytes * count}
