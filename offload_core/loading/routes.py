"""Per-tensor routes of a checked device map: which tensors stay resident on which device and which go to the store."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from offload_core.planning.sizing import kept_dtypes
from offload_core.storage.checkpoint import Checkpoint
from offload_core.values import is_offloaded, torch_device


@dataclass
class TensorRoutes:
    """Where each state-dict tensor of a model goes: resident on a device, or offloaded under a store key."""

    resident: dict[str, torch.device] = field(default_factory=dict)
    offloaded: dict[str, str] = field(default_factory=dict)  # name -> canonical store key
    canonical: dict[str, str] = field(default_factory=dict)  # every name -> first name of its tie group
    is_param: dict[str, bool] = field(default_factory=dict)

    @property
    def store_keys(self) -> list[str]:
        return list(dict.fromkeys(self.offloaded.values()))


def route_tensors(
    model: nn.Module, device_map: Mapping[str, int | str], execution_device: torch.device, offload_buffers: bool = False
) -> TensorRoutes:
    """Resolve a checked device map into per-tensor decisions (tied names share one store key)."""
    from offload_core.planning import device_of, tensor_aliases

    routes = TensorRoutes()
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    aliases = tensor_aliases(model)
    for name in model.state_dict(keep_vars=True):
        routes.canonical[name] = aliases.get(name, name)
        is_param = name in params
        routes.is_param[name] = is_param
        where = device_of(device_map, routes.canonical[name])
        if is_offloaded(where, execution_device) and (is_param or offload_buffers):
            routes.offloaded[name] = routes.canonical[name]
        else:
            routes.resident[name] = torch_device(where, execution_device)
    return routes


def set_tensor(model: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    owner_name, _, local = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if is_param:
        old = owner._parameters.get(local)
        requires_grad = bool(old is not None and old.requires_grad and value.is_floating_point())
        owner._parameters[local] = (
            value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=requires_grad)
        )
    else:
        owner._buffers[local] = value


def get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner_name, _, local = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    return owner._parameters[local] if local in owner._parameters else owner._buffers[local]


def retie(model: nn.Module, routes: TensorRoutes) -> None:
    """Point every resident tied alias at its canonical tensor (one tensor, one device copy)."""
    for name, canonical in routes.canonical.items():
        if name != canonical and name in routes.resident:
            set_tensor(model, name, get_tensor(model, canonical), routes.is_param[name])


def move_leftover_buffers(
    model: nn.Module, device_map: Mapping[str, int | str], execution_device: torch.device
) -> None:
    """Non-persistent buffers (e.g. rotary ``inv_freq``) are in no checkpoint: each goes where its module runs."""
    from offload_core.errors import DeviceMapError
    from offload_core.planning import device_of

    for name, module in model.named_modules():
        try:
            device = torch_device(device_of(device_map, name), execution_device)
        except DeviceMapError:  # a module holding only such buffers, under no key: the execution device
            device = execution_device
        for local, buf in module._buffers.items():
            if buf is not None and buf.device.type != "meta" and buf.device != device:
                module._buffers[local] = buf.to(device)


def store_bytes(
    model: nn.Module, routes: TensorRoutes, checkpoint: Checkpoint | None = None, dtype: torch.dtype | None = None
) -> int:
    """The bytes the store will hold for ``routes``' offloaded tensors, as read from ``checkpoint`` (its shapes and
    dtypes) or, without one, as the model holds them; floating tensors in ``dtype`` where given."""
    sources = {}
    if checkpoint is not None:
        keys = set(checkpoint.keys())
        for name, canonical in routes.canonical.items():
            if name in keys:
                sources.setdefault(canonical, name)
    state = model.state_dict(keep_vars=True)
    kept = kept_dtypes(model)
    total = 0
    for key in routes.store_keys:
        if key in sources:
            shape, stored = checkpoint.shape(sources[key]), checkpoint.dtype(sources[key])
        else:
            shape, stored = state[key].shape, state[key].dtype
        converts = dtype is not None and stored.is_floating_point and key not in kept
        itemsize = dtype.itemsize if converts else stored.itemsize
        total += math.prod(shape) * itemsize
    return total
