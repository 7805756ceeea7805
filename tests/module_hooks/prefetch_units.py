"""Small units for driving a Prefetcher by hand: a stack of Linear units whose store holds other weights than the
model, and stores that map in place or hold a read back until the test lets it go on."""

from __future__ import annotations

import threading

import torch
from torch import nn

from offload_core.module_hooks.units import find_units
from offload_core.storage.base import MappingStore

CPU = torch.device("cpu")
X = torch.arange(8, dtype=torch.float32).view(2, 4)


def stack(n=4):
    """``n`` Linear(4, 4) units "0".."n-1" whose store holds other weights than the model (so a unit that ran on
    the store's weights is told apart), and the in-memory model with the store's weights."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    store = {name: torch.randn(t.shape) for name, t in model.state_dict().items()}
    reference = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    reference.load_state_dict(store)
    units = find_units(model, {name: name for name in store}, [], "block")
    return model, reference, store, units


def settle(prefetcher):
    """Wait for every read-ahead in flight (a state: their futures done)."""
    for future, _, _ in prefetcher.pending.values():
        future.result(timeout=30)


class MappedStore(MappingStore):
    """A store that maps its tensors in place (``warm`` brings them in and says no copy is needed)."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.warmed = []

    def warm(self, key):
        self.warmed.append(key)
        return True


class GatedStore(MappingStore):
    """Reading a key in ``gated`` (``store[key]``) stalls until ``gate`` is set: a slow read held in flight."""

    def __init__(self, tensors, gated):
        super().__init__(tensors)
        self.gated, self.gate, self.reading = set(gated), threading.Event(), threading.Event()

    def spec(self, key):
        tensor = super().__getitem__(key)
        return tensor.shape, tensor.dtype

    def __getitem__(self, key):
        if key in self.gated:
            self.reading.set()
            assert self.gate.wait(30), "the test never let the read go on"
        return super().__getitem__(key)
