"""Built-in placement ``balanced``: cap every GPU but the last near an even share of the model, then fill in order."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Placement
from offload_core.planning import PlacementRequest, get_balanced_memory, plan_device_map


@dataclass
class BalancedConfig:
    name: str = "balanced"


class BalancedPlacement(Placement):
    config: BalancedConfig

    def make_device_map(self, request: PlacementRequest) -> dict:
        return plan_device_map(request, max_memory=get_balanced_memory(request, low_zero=False))


@hookimpl
def offload_register_placements(register):
    register("balanced", BalancedPlacement, BalancedConfig)
