"""Expert-granular loading: before a fused MoE experts module runs, only the experts its routing selected are read
from the store.

A transformers experts module holds its weights as parameters indexed by expert (``gate_up_proj[E, …]``,
``down_proj[E, …]``) and is called with the routing (``top_k_index``); it touches only the rows of the
experts it was routed to. Each such parameter is served from one full-shape buffer on the execution
device (shared by every layer of that shape, allocated once) in which only the selected rows are
filled: from the expert cache, from a read-ahead guess, or from the store. The other rows hold
whatever an earlier layer left there and are never read, so the arithmetic is the in-memory model's.
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.module_hooks.base import ModuleHook
from offload_core.module_hooks.experts.cache import ExpertCache
from offload_core.module_hooks.units import Slot, TransferStats, Unit
from offload_core.storage.base import as_store, moved_bytes


def routing_argument(module: nn.Module) -> int | None:
    """Position of ``top_k_index`` in ``module.forward``'s arguments, or None when it takes no routing."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("top_k_index") if "top_k_index" in names else None


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module: called with the routing, parameters indexed by expert."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or routing_argument(module) is None:
        return False
    return any(p.dim() == 3 and p.shape[0] == count for p in module.parameters(recurse=False))


#: calls a guess is judged over (the last GUESS_WINDOW, once there are GUESS_JUDGED), and the share of routed experts
#: it must have guessed to be read ahead
GUESS_WINDOW = 32
GUESS_JUDGED = 8
GUESS_PAYS = 0.8


@dataclass
class ExpertCounters:
    """What the expert-granular policy counts: shared by every MoE layer of one model."""

    hits: int = 0  # selected experts found in the cache
    predicted_hits: int = 0  # selected experts read ahead on a guess
    misses: int = 0  # selected experts read from the store on demand
    whole_reads: int = 0  # calls that read whole expert tensors (most experts selected)
    bytes: int = 0  # bytes read from the store for experts (read-ahead guesses included)
    guessed: int = 0  # experts guessed ahead
    guessed_right: int = 0  # ... that the routing then selected
    routed: int = 0  # experts selected, over every call that had a guess
    decode_bytes: int = 0
    decode_tokens: int = 0
    transfers: int = 0  # copies from host memory to an accelerator issued for experts
    decode_transfers: int = 0
    guessing: bool = True  # guesses are read ahead (False while they do not pay: computed and scored only)
    guess_pauses: int = 0  # times guessing stopped for want of hits
    pays: float = GUESS_PAYS  # the share of routed experts guesses must hit to be read ahead
    window: deque = field(default_factory=lambda: deque(maxlen=GUESS_WINDOW), repr=False)  # (right, routed) per call
    stats: TransferStats | None = None  # the run's transfer counters, which count expert reads too
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def score(self, right: int, routed: int) -> None:
        """Count one call's guess; guessing stops while fewer than :attr:`pays` of the routed experts of the
        last calls were guessed (a wrong guess reads bytes no one uses), and starts again when as many are."""
        with self.lock:
            self.guessed_right += right
            self.routed += routed
            self.window.append((right, routed))
            if len(self.window) < GUESS_JUDGED:
                return
            pays = sum(r for r, _ in self.window) >= self.pays * sum(n for _, n in self.window)
            if self.guessing and not pays:
                self.guess_pauses += 1
            self.guessing = pays

    def add_bytes(self, tensors: int, nbytes: int) -> None:
        with self.lock:
            self.bytes += nbytes
        if self.stats is not None:
            self.stats.add_moved(tensors, nbytes)


class Buffers:
    """One full-shape buffer per (shape, dtype) on the execution device, shared by the layers that use it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self.buffers:
            with torch.inference_mode(False):  # the experts' weights: normal tensors, as the in-memory model's
                self.buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return self.buffers[key]


class ExpertLayer:
    """One fused experts module: its offloaded slots, its cache, its read-ahead guess and the module hook's work."""

    def __init__(
        self,
        unit: Unit,
        store: Mapping[str, torch.Tensor],
        buffers: Buffers,
        cache: ExpertCache,
        counters: ExpertCounters,
        whole_fraction: float,
        reader: Any,
        router: Any = None,
    ) -> None:
        self.unit = unit
        self.store = as_store(store)
        self.buffers = buffers
        self.cache = cache
        self.counters = counters
        self.whole_fraction = whole_fraction
        self.reader = reader
        self.router = router  # the next layer's router as a function of this layer's hidden state
        self.num_experts = int(unit.module.num_experts)
        self.position = routing_argument(unit.module)
        self.specs = {s.key: (s.original.shape, s.original.dtype) for s in unit.slots}
        #: what reading one expert's rows moves (a quantized store's blocks, not the dequantized rows)
        self.row_bytes = sum(
            moved_bytes(self.store, key, shape.numel() * dtype.itemsize) // shape[0]
            for key, (shape, dtype) in self.specs.items()
        )
        self.next: ExpertLayer | None = None
        self.guess: dict[int, Future] = {}
        self.shadow: set[int] = set()  # the guess while guessing does not pay: scored, not read
        self.previous: list[int] = []

    # -- reading ----------------------------------------------------------------------------------
    def read_rows(self, expert: int, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Expert ``expert``'s rows from the store in host memory (the reader thread, or on demand), read
        into ``into`` (an evicted cache slot's rows) where given."""
        rows = {}
        for key, (shape, dtype) in self.specs.items():
            if into is not None:
                out = into[key]
            else:
                with torch.inference_mode(False):  # kept in the cache across calls
                    out = torch.empty(shape[1:], dtype=dtype)
            read_expert(self.store, key, expert, out)
            rows[key] = out
        self.counters.add_bytes(len(rows), self.row_bytes)
        return rows

    def read_ahead(self, experts: list[int]) -> None:
        """Start reading ``experts`` on the reader thread (those neither cached nor already under way)."""
        if not self.counters.guessing:
            self.shadow = set(experts)
            with self.counters.lock:
                self.counters.guessed += len(experts)
            return
        for expert in experts:
            if expert not in self.guess and self.cache.get(expert) is None:
                self.guess[expert] = self.reader.submit(self.read_rows, expert)
        with self.counters.lock:
            self.counters.guessed += len(experts)

    # -- the compute thread -----------------------------------------------------------------------
    def selected(self, args: tuple, kwargs: dict) -> list[int]:
        index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[self.position]
        return [e for e in torch.unique(index).tolist() if 0 <= e < self.num_experts]

    def load(self, args: tuple, kwargs: dict) -> None:
        experts = self.selected(args, kwargs)
        self.score_guess(experts)
        self.cache.request(experts)
        tensors = {key: self.buffers.get(shape, dtype) for key, (shape, dtype) in self.specs.items()}
        missing = [e for e in experts if self.cache.get(e) is None and e not in self.guess]
        if missing and len(missing) >= self.whole_fraction * self.num_experts:
            self.read_whole(tensors)
        else:
            for expert in experts:
                self.place(expert, tensors)
        self.drop_guesses()
        self.unit.load(self.store, self.buffers.device, None, fetched=tensors)
        self.previous = experts
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if self.next is not None:
            self.next.read_ahead(self.guess_next(hidden))

    def score_guess(self, experts: list[int]) -> None:
        guessed, self.shadow = set(self.guess) | self.shadow, set()
        if guessed:
            self.counters.score(len(guessed & set(experts)), len(experts))

    def read_whole(self, tensors: dict[str, torch.Tensor]) -> None:
        """Most experts must come from the store (a long prompt): one read of each whole tensor beats
        many row reads (the cache and the guesses are left as they are)."""
        for key, buffer in tensors.items():
            read_whole(self.store, key, buffer)
        self.counters.add_bytes(len(tensors), self.row_bytes * self.num_experts)
        self.counters.whole_reads += 1

    def place(self, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        rows = self.cache.get(expert)
        if rows is not None:
            self.counters.hits += 1
        elif expert in self.guess:
            rows = self.guess.pop(expert).result()
            self.counters.predicted_hits += 1
            self.cache.admit(expert, rows)
        elif self.cache.wants(expert):
            rows = self.read_rows(expert, self.cache.spare())
            self.counters.misses += 1
            self.cache.admit(expert, rows)
        else:  # not kept: read straight into the buffer's row
            for key, buffer in tensors.items():
                read_expert(self.store, key, expert, buffer[expert])
            self.counters.add_bytes(len(tensors), self.row_bytes)
            self.counters.misses += 1
            return
        for key, buffer in tensors.items():
            buffer[expert].copy_(rows[key])

    def drop_guesses(self, experts: list[int] | None = None) -> None:
        """Guesses the routing did not select (all but ``experts``): cancelled if not started (their bytes, once
        read, are lost)."""
        for expert in [e for e in self.guess if not experts or e not in experts]:
            self.guess.pop(expert).cancel()

    def guess_next(self, hidden: torch.Tensor) -> list[int]:
        """The experts the next MoE layer will probably select: its router on this layer's hidden state
        where there is one, else what this layer selected."""
        if self.router is not None:
            guessed = self.router(hidden)
            if guessed is not None:
                return guessed
        return list(self.next.previous) if self.next is not None else []

    def release(self) -> None:
        self.unit.release()


class ExpertsHook(ModuleHook):
    """On a fused experts module: bring the routed experts in before ``forward``, put the placeholders back after."""

    name = "experts_offload"

    def __init__(self, layer: ExpertLayer) -> None:
        self.layer = layer

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.layer.load(args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.layer.release()
        return output

    def on_error(self, module: nn.Module) -> None:
        self.layer.release()

    def detach_hook(self, module: nn.Module) -> None:
        self.layer.release()


def read_expert(store: Mapping[str, torch.Tensor], key: str, expert: int, out: torch.Tensor) -> None:
    """Copy row ``expert`` of ``store[key]`` into ``out``: the store's own ``read_expert`` where it has one
    (assembled or converted tensors), else a row of the view it hands out (only that row's bytes are read)."""
    as_store(store).read_expert(key, expert, out)


def read_whole(store: Mapping[str, torch.Tensor], key: str, buffer: torch.Tensor) -> None:
    """Copy all of ``store[key]`` into ``buffer``: in one pass where the store reads into host memory itself; to
    a device buffer from such a store (it builds the tensor on read: assembled from per-expert checkpoint tensors,
    or converted) expert by expert through one host row, never the whole tensor in pageable memory."""
    store = as_store(store)
    if store.reads_into and buffer.device.type == "cpu":
        store.read_into(key, buffer)
    elif store.reads_into:
        row = torch.empty(buffer.shape[1:], dtype=buffer.dtype)
        for expert in range(buffer.shape[0]):
            read_expert(store, key, expert, row)
            buffer[expert].copy_(row)  # from pageable memory: done when it returns, so the row is free again
    else:
        buffer.copy_(store[key])


def expert_sizes(model: nn.Module, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """The bytes of one expert in the largest fused experts module, and how many such modules the model has."""
    largest, layers = 0, 0
    for module in model.modules():
        if is_fused_experts(module):
            layers += 1
            row = sum(
                p[0].numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
                for p in module.parameters(recurse=False)
                if p.dim() == 3 and p.shape[0] == module.num_experts
            )
            largest = max(largest, row)
    return largest, layers


def most_experts(model: nn.Module) -> int:
    """The most experts one fused experts module of ``model`` holds (0 where it has none)."""
    return max((module.num_experts for module in model.modules() if is_fused_experts(module)), default=0)


def expert_slots(module_name: str, module: nn.Module, offloaded: Mapping[str, str]) -> list[Slot]:
    """The offloaded parameters of a fused experts module that are indexed by expert."""
    slots = []
    for local, tensor in module._parameters.items():
        full = f"{module_name}.{local}" if module_name else local
        if tensor is not None and tensor.dim() == 3 and tensor.shape[0] == module.num_experts and full in offloaded:
            slots.append(Slot(module, local, full, offloaded[full], True, tensor))
    return slots
