"""The layout of the block pool: where a unit's tensors sit in a block buffer (each aligned), and the pool's shape
(how many buffers, how large) that a prefetcher makes for a model, for planning to reserve before it exists."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.module_hooks.units import Unit, find_units

#: byte alignment of each tensor inside a block buffer (CUDA kernels want 256-byte aligned operands)
ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def pool_shape(
    model: nn.Module,
    no_split: Any,
    dtype: torch.dtype | None,
    device: torch.device,
    offloaded: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """``(nesting, capacity)`` of the pool a prefetcher makes for ``model`` with the ``offloaded`` tensors (name ->
    store key; None: were every tensor offloaded, an upper bound for any placement): the longest chain of block units
    inside one another, and the largest unit's bytes with each tensor aligned as :meth:`Prefetcher._layout` lays it
    out (and a reference offset on a CPU); ``(1, 0)`` where nothing is offloaded."""
    tensors = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    if offloaded is None:
        offloaded = {name: name for name in tensors}
    units = find_units(model, offloaded, no_split, "block")

    def nbytes(t: torch.Tensor) -> int:
        itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        return _aligned(t.numel() * itemsize + (ALIGN if device.type == "cpu" else 0))

    capacity = max((sum(nbytes(tensors[name]) for name in {*u.keys}) for u in units), default=0)
    return _max_nesting(units), capacity


def _max_nesting(units: list[Unit]) -> int:
    """The most units that can be loaded at once: the longest chain of units inside one another."""
    names = [u.name for u in units]

    def depth(name: str) -> int:
        return 1 + sum(1 for other in names if other != name and (other == "" or name.startswith(other + ".")))

    return max((depth(n) for n in names), default=1)
