"""``cpu_offload_with_hook``: chain whole models through host memory, each moving to the device when called."""

from __future__ import annotations

import torch
from torch import nn

from offload_core.loading.dispatch import default_execution_device
from offload_core.module_hooks.chained import ChainHandle, chain_model
from offload_core.storage import StoreContext


def cpu_offload_with_hook(model: nn.Module, execution_device: torch.device | str | int | None = None,
                          prev_module_hook: ChainHandle | None = None) -> tuple[nn.Module, ChainHandle]:
    """Offload ``model`` to host memory (page-locked on a GPU run); it moves to ``execution_device`` when
    called and stays there until the next model of the chain (whose ``prev_module_hook`` is this handle)
    is called. The last model of a chain needs an explicit ``handle.offload()``; ``handle.remove()``
    puts the weights back in the model (on the CPU) and removes the module hook.
    """
    from offload_core.storage.memory import HostMemoryStore

    if execution_device is None:
        device = default_execution_device()
    else:
        device = torch.device(f"cuda:{execution_device}" if isinstance(execution_device, int) else execution_device)
    store = HostMemoryStore(StoreContext(names=[], pin_memory=device.type == "cuda"))
    return chain_model(model, store, device, prev_module_hook)
