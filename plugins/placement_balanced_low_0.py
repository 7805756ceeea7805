"""Built-in placement ``balanced_low_0``: spread the model over GPUs 1.. and keep the first GPU as light as possible."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Placement
from offload_core.planning import PlacementRequest, get_balanced_memory, plan_device_map


@dataclass
class BalancedLow0Config:
    name: str = "balanced_low_0"


class BalancedLow0Placement(Placement):
    config: BalancedLow0Config

    def make_device_map(self, request: PlacementRequest) -> dict:
        return plan_device_map(request, max_memory=get_balanced_memory(request, low_zero=True))


@hookimpl
def offload_register_placements(register):
    register("balanced_low_0", BalancedLow0Placement, BalancedLow0Config)
