"""Build models without allocating their weights: parameters (and buffers if asked) created inside land on a device such as meta."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

# the unpatched methods: the innermost block decides where a tensor lands when blocks are nested
_REGISTER_PARAMETER = nn.Module.register_parameter
_REGISTER_BUFFER = nn.Module.register_buffer


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Inside this block every parameter a module registers is moved to ``device`` (buffers too with ``include_buffers``).

    ``nn.Module.register_parameter`` (and ``register_buffer``) are patched for the duration of the
    block and restored on exit, also when the block raises.
    """
    device = torch.device(device)
    old_register_parameter = nn.Module.register_parameter
    old_register_buffer = nn.Module.register_buffer

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        _REGISTER_PARAMETER(module, name, param)
        current = module._parameters[name]
        if current is None or current.device == device:
            return
        moved = current.to(device)
        if type(current) is nn.Parameter:
            module._parameters[name] = nn.Parameter(moved, requires_grad=current.requires_grad)
        else:  # a Parameter subclass: keep its class and attributes
            kwargs = dict(current.__dict__)
            kwargs["requires_grad"] = current.requires_grad
            module._parameters[name] = type(current)(moved, **kwargs)

    def register_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        _REGISTER_BUFFER(module, name, tensor, persistent=persistent)
        if tensor is not None and tensor.device != device:
            module._buffers[name] = module._buffers[name].to(device)

    nn.Module.register_parameter = register_parameter
    if include_buffers:
        nn.Module.register_buffer = register_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter = old_register_parameter
        nn.Module.register_buffer = old_register_buffer


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build models whose parameters (and buffers with ``include_buffers``) are on the meta device: shapes, no storage.

    ``with init_empty_weights(): model = AutoModelForCausalLM.from_config(config)``
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield
