"""A small fused experts module, its store and an :class:`ExpertLayer` over them, for the loader's value tests.

Four experts. ``gate_up_proj`` [4, 2, 3] float32: one expert's rows are 6 floats, 24 bytes; ``down_proj`` [4, 1, 2]
float16: 2 halves, 4 bytes. One expert: 28 bytes. Row ``e`` of ``gate_up_proj`` in the store holds 6e+1 .. 6e+6,
row ``e`` of ``down_proj`` 100+2e and 101+2e: every value tells which expert and tensor it came from.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch import nn

from offload_core.module_hooks.experts.cache import ExpertCache
from offload_core.module_hooks.experts.loader import Buffers, ExpertCounters, ExpertLayer, expert_slots
from offload_core.module_hooks.units import TransferStats, Unit
from offload_core.storage.base import MappingStore

EXPERTS = 4
ROW_BYTES = 2 * 3 * 4 + 1 * 2 * 2  # 24 + 4
KEYS = {"moe.gate_up_proj": "gu", "moe.down_proj": "dn"}


class Moe(nn.Module):
    """The shapes above, as meta placeholders (what an offloaded module holds while not loaded)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.gate_up_proj = nn.Parameter(torch.empty(EXPERTS, 2, 3, device="meta"), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(EXPERTS, 1, 2, dtype=torch.float16, device="meta"))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def store_tensors() -> dict[str, torch.Tensor]:
    return {
        "gu": torch.arange(1, EXPERTS * 6 + 1, dtype=torch.float32).view(EXPERTS, 2, 3),
        "dn": torch.arange(100, 100 + EXPERTS * 2, dtype=torch.float16).view(EXPERTS, 1, 2),
    }


class RecordingStore(MappingStore):
    """A store that reads rows and whole tensors itself (as the on-disk stores do), and records each call."""

    reads_into = True

    def __init__(self) -> None:
        super().__init__(store_tensors())
        self.calls: list[tuple] = []
        self.outs: list[tuple[tuple, torch.dtype]] = []  # the shape and dtype of each row read into

    def read_expert(self, key: str, expert: int, out: torch.Tensor) -> None:
        self.calls.append(("read_expert", key, expert))
        self.outs.append((tuple(out.shape), out.dtype))
        out.copy_(self.tensors[key][expert])

    def read_into(self, key: str, out: torch.Tensor) -> None:
        self.calls.append(("read_into", key))
        out.copy_(self.tensors[key])


class Queued:
    """A reader whose work runs only when the test calls :meth:`run`: what is still queued can be cancelled."""

    def __init__(self) -> None:
        self.work: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.work.append((future, fn, args))
        return future

    def run(self) -> None:
        for future, fn, args in self.work:
            if future.set_running_or_notify_cancel():
                future.set_result(fn(*args))
        self.work = []


def make_layer(
    store=None,
    slots: int = 0,
    whole_fraction: float = 1.0,
    device: torch.device | str = "cpu",
    router=None,
) -> ExpertLayer:
    module = Moe()
    unit = Unit("moe", module, expert_slots("moe", module, KEYS))
    counters = ExpertCounters(stats=TransferStats())
    return ExpertLayer(
        unit,
        store if store is not None else store_tensors(),
        Buffers(torch.device(device)),
        ExpertCache(slots),
        counters,
        whole_fraction,
        Queued(),
        router,
    )


def routing(*experts: int, kwargs: bool = False) -> tuple[tuple, dict]:
    """The experts module's call for one token routed to ``experts`` (positional, or keywords)."""
    hidden = torch.zeros(1, 3)
    index = torch.tensor([list(experts)])
    weights = torch.ones(1, len(experts))
    if kwargs:
        return (), {"hidden_states": hidden, "top_k_index": index, "top_k_weights": weights}
    return (hidden, index, weights), {}


def fill(layer: ExpertLayer, value: float) -> dict[str, torch.Tensor]:
    """The layer's shared buffers, every row set to ``value`` (rows a call does not fill keep it)."""
    buffers = {key: layer.buffers.get(shape, dtype) for key, (shape, dtype) in layer.specs.items()}
    for buffer in buffers.values():
        buffer.fill_(value)
    return buffers


class PinnedStore(MappingStore):
    """:func:`store_tensors` in page-locked memory of ``accelerator`` (one arena), as the pinned_cpu store has them."""

    pinned = True

    def __init__(self, accelerator) -> None:
        tensors = store_tensors()
        arena = accelerator.pinned_arena(sum(t.numel() * t.element_size() for t in tensors.values()))
        at, held_tensors = 0, {}
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            held = arena[at : at + nbytes].view(tensor.dtype).view(tensor.shape)
            held.copy_(tensor)
            held_tensors[key] = held
            at += nbytes
        super().__init__(held_tensors)
        self.arena = arena


def make_device_layers(store, device, count: int = 1, cache_slots: int = 0, ahead: int = 2, router=None):
    """``count`` :class:`DeviceLayer` over ``store`` on ``device`` sharing one :class:`DeviceExperts`, each the next
    of the one before (``router``: every layer's guess of the next)."""
    from offload_core.module_hooks.experts.device import DeviceLayer
    from offload_core.module_hooks.experts.slots import DeviceExperts

    shared = DeviceExperts(torch.device(device), cache_slots, ahead)
    counters = ExpertCounters(stats=TransferStats())
    layers = []
    for index in range(count):
        module = Moe()
        unit = Unit("moe", module, expert_slots("moe", module, KEYS))
        layers.append(DeviceLayer(unit, store, shared, counters, 1.0, Queued(), index))
    for layer, following in zip(layers, layers[1:]):
        layer.next, layer.router = following, router
    return layers
