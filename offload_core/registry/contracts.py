"""The three strategy contracts a plugin implements: Placement, Storage and Policy, each optional capability declared once with its default."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from offload_core.planning.reservation import InFlight, reserve_units

if TYPE_CHECKING:  # annotations only: the contracts sit below the packages that implement them
    import torch
    from torch import nn

    from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
    from offload_core.planning import PlacementRequest
    from offload_core.storage import Store, StoreContext


class StrategyBase(ABC):
    """What every strategy shares: it is built from its config dataclass, kept as ``self.config``."""

    def __init__(self, config: Any) -> None:
        self.config = config


class Placement(StrategyBase):
    """Decides the device map: which device (GPU index, ``"cpu"``, ``"disk"``) holds each module or tensor."""

    @abstractmethod
    def make_device_map(self, request: PlacementRequest) -> dict[str, int | str]:
        """The device map for ``request`` (the model, the budgets, the no-split classes, the reservation)."""


class Storage(StrategyBase):
    """Keeps the offloaded tensors: ``open`` gives the :class:`~offload_core.storage.Store` of one run."""

    #: a tensor stored in another dtype than the run's is converted on every read: the planner holds
    #: room for the copies in flight
    converts_on_read: bool = False
    #: the store's memory is page-locked: a GPU run copies from it with no staging
    pinned: bool = False

    @abstractmethod
    def open(self, context: StoreContext) -> Store:
        """The store for the tensors ``context`` names."""


class Policy(StrategyBase):
    """Brings offloaded tensors in around each unit's forward: ``attach`` wraps the model's modules."""

    #: the unit a policy moves: "block" (a no-split block) or "module" (each module owning tensors)
    granularity: str = "block"
    #: buffers are offloaded with the parameters (otherwise they stay on the execution device)
    offload_buffers: bool = False

    @abstractmethod
    def attach(self, model: nn.Module, context: PolicyContext) -> PolicyHandle:
        """Attach module hooks to ``model``; the handle reports counters and removes them."""

    def reserve(self, need: InFlight) -> dict[Any, int]:
        """Bytes the units in flight take on each device (held back from the budgets): one block."""
        return reserve_units(need, need.block_bytes)

    def predict_moved(self, unit_bytes: list[int]) -> int:
        """Bytes brought in per forward, given each offloaded unit's bytes: every unit once."""
        return sum(unit_bytes)

    def own_device_map(self, model: nn.Module, execution_device: torch.device) -> dict[str, int | str] | None:
        """A device map the policy decides itself (a user's ``device_map`` file still comes first), or
        None to leave it to the placement."""
        return None


CONTRACTS: dict[str, type[StrategyBase]] = {"placement": Placement, "storage": Storage, "policy": Policy}
