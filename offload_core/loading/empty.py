"""Build models without allocating their weights: parameters (and buffers if asked) created inside land on a device such
as meta."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

# the device of the innermost block in this thread (None outside any block)
_PARAMETER_DEVICE: ContextVar[torch.device | None] = ContextVar("offload_core_parameter_device", default=None)


def _to_block_device(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    """Parameter-registration hook: the parameter on the block's device (same class and attributes), or None to keep
    it."""
    device = _PARAMETER_DEVICE.get()
    if device is None or param is None or param.device == device:
        return None
    moved = param.to(device)
    if type(param) is nn.Parameter:
        return nn.Parameter(moved, requires_grad=param.requires_grad)
    kwargs = dict(param.__dict__)
    kwargs["requires_grad"] = param.requires_grad
    return type(param)(moved, **kwargs)


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Inside this block every parameter a module registers lands on ``device`` (buffers too with ``include_buffers``).

    With ``include_buffers`` every tensor made inside is made on ``device`` by torch's device context
    (nothing is allocated elsewhere first). Without it a parameter-registration hook moves parameters
    as modules register them; it acts only in this thread, and only inside the block.
    """
    device = torch.device(device)
    if include_buffers:
        with device:
            yield
        return
    token = _PARAMETER_DEVICE.set(device)
    handle = register_module_parameter_registration_hook(_to_block_device)
    try:
        yield
    finally:
        handle.remove()
        _PARAMETER_DEVICE.reset(token)


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models whose parameters (and buffers with ``include_buffers``) are on the meta device: shapes, no storage.

    ``with init_empty_weights(): model = AutoModelForCausalLM.from_config(config)``
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield
