"""Module hooks: what wraps an ``nn.Module``'s forward to bring offloaded tensors in and drop them again."""

from offload_core.module_hooks.base import (
    ModuleHook,
    ModuleHookHandle,
    add_hook_to_module,
    remove_hook_from_module,
    send_to_device,
)
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.units import TransferStats, Unit, check_granularity, find_units
from offload_core.planning.reservation import InFlight, reserve_units

__all__ = [
    "InFlight",
    "ModuleHook",
    "ModuleHookHandle",
    "PolicyContext",
    "PolicyHandle",
    "TransferStats",
    "Unit",
    "add_hook_to_module",
    "check_granularity",
    "find_units",
    "remove_hook_from_module",
    "reserve_units",
    "send_to_device",
]
