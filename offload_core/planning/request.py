"""The request a placement receives: the model, its budgets and the rules for units and reservation."""

from __future__ import annotations

from abc import abstractmethod

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.strategy import StrategyBase


@dataclass
class PlacementRequest:
    """What a placement needs to make a device map.

    ``max_memory`` maps devices (int GPU ids, ``"cpu"``, ``"disk"``) to bytes. ``reserve`` is ``None``
    for the reference rule (the main devices hold back room for the largest unit still offloadable) or a
    dict of bytes held back per device instead (``{"cpu": 0}``: none; devices not named hold back nothing).
    ``fallback_allocation``: when a GPU would get nothing, put there the first unit (breadth first) that fits.
    """

    model: nn.Module
    max_memory: Mapping[Any, int | str] | None = None
    no_split_module_classes: list[str] = field(default_factory=list)
    dtype: torch.dtype | str | None = None
    special_dtypes: Mapping[str, torch.dtype | str] | None = None
    reserve: Mapping[Any, int | str] | None = None
    fallback_allocation: bool = False


class Placement(StrategyBase):
    """Decides the device map: which device (GPU index, ``"cpu"``, ``"disk"``) holds each module or tensor."""

    @abstractmethod
    def make_device_map(self, request: PlacementRequest) -> dict[str, int | str]:
        """The device map for ``request`` (the model, the budgets, the no-split classes, the reservation)."""
