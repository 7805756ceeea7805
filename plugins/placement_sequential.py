"""Built-in placement ``sequential``: fill the GPUs in order, then cpu, then disk."""

from __future__ import annotations

from dataclasses import dataclass

from offload_core.hookspecs import hookimpl
from offload_core.registry.contracts import Placement
from offload_core.planning import PlacementRequest, plan_device_map


@dataclass
class SequentialConfig:
    name: str = "sequential"


class SequentialPlacement(Placement):
    config: SequentialConfig

    def make_device_map(self, request: PlacementRequest) -> dict:
        return plan_device_map(request)


@hookimpl
def offload_register_placements(register):
    register("sequential", SequentialPlacement, SequentialConfig)
