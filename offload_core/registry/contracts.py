"""The three strategy contracts a plugin implements, in one place: Placement, Storage and Policy, each optional
capability declared once with its default. Each is defined beside the layer it serves (planning, storage,
module hooks), so those layers never import the registry; plugins import them from here."""

from __future__ import annotations

from offload_core.module_hooks.policy import Policy
from offload_core.planning.request import Placement
from offload_core.storage.base import Storage
from offload_core.strategy import StrategyBase

CONTRACTS: dict[str, type[StrategyBase]] = {"placement": Placement, "storage": Storage, "policy": Policy}

__all__ = ["CONTRACTS", "Placement", "Policy", "Storage", "StrategyBase"]
