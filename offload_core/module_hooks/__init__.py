"""Module hooks: what wraps an ``nn.Module``'s forward to bring offloaded tensors in and drop them again."""

from offload_core.module_hooks.base import (
    ModuleHook,
    ModuleHookHandle,
    add_hook_to_module,
    remove_hook_from_module,
    send_to_device,
)
from offload_core.module_hooks.units import DispatchPlan, InFlight, PolicyHandle, TransferStats, Unit, find_units, reserve_units

__all__ = [
    "DispatchPlan",
    "InFlight",
    "ModuleHook",
    "ModuleHookHandle",
    "PolicyHandle",
    "TransferStats",
    "Unit",
    "add_hook_to_module",
    "find_units",
    "remove_hook_from_module",
    "reserve_units",
    "send_to_device",
]
