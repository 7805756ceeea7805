"""``cpu_offload_with_hook``: chain whole models through host memory, each moving to the device when called."""

from __future__ import annotations

import torch
from torch import nn

from offload_core import devices
from offload_core.module_hooks.chained import ChainHandle, chain_model
from offload_core.storage import StoreContext


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: torch.device | str | int | None = None,
    prev_module_hook: ChainHandle | None = None,
) -> tuple[nn.Module, ChainHandle]:
    """Offload ``model`` to host memory (page-locked on a GPU run); it moves to ``execution_device`` when
    called and stays there until the next model of the chain (whose ``prev_module_hook`` is this handle)
    is called. The last model of a chain needs an explicit ``handle.offload()``; ``handle.remove()``
    puts the weights back in the model (on the CPU) and removes the module hook.
    """
    from offload_core.storage.memory import HostMemoryStore

    accelerator = devices.active()
    device = accelerator.default_device() if execution_device is None else accelerator.normalize(execution_device)
    nbytes = sum(
        t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    )
    store = HostMemoryStore(StoreContext(names=[], pin_memory=devices.is_accelerator(device), nbytes=nbytes))
    return chain_model(model, store, device, prev_module_hook)
