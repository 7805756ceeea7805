"""What the MoE layers of one accelerator run share (:class:`DeviceExperts`): the compute buffers, the copy stream,
the device expert cache, the read-ahead slots (:class:`DeviceRows`) and the scratch that decodes packed experts;
and how a layer's routed experts are grouped into copies (:func:`runs`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from offload_core.module_hooks.experts.cache import ExpertCache
from offload_core.module_hooks.experts.loader import Buffers
from offload_core.storage.base import as_store


@dataclass(eq=False)
class DeviceRows:
    """One expert's rows of each expert tensor of a layer, on the device: a cache slot or a read-ahead slot."""

    rows: list[torch.Tensor]
    signature: tuple = ()  # each row's (shape, dtype): the layers whose experts it can hold
    written: Any = None  # the copy stream's event after it filled the rows (None: filled on the compute stream)
    used: Any = None  # the compute stream's event after its last use of the rows
    future: Future | None = None  # a read-ahead from an unpinned store under way on the reader thread (-> event)


def runs(experts: list[int]) -> list[tuple[int, int]]:
    """Sorted ``experts`` as runs of adjacent ones, ``(first, end)``: each run is one copy per tensor."""
    out: list[tuple[int, int]] = []
    for expert in experts:
        if out and out[-1][1] == expert:
            out[-1] = (out[-1][0], expert + 1)
        else:
            out.append((expert, expert + 1))
    return out


@dataclass(eq=False)
class DeviceExperts:
    """What the MoE layers of one accelerator run share: the compute buffers, the copy stream, the device expert cache
    (``cache_slots`` experts over all layers, keyed ``(layer, expert)``) and ``ahead`` read-ahead slots per shape."""

    device: torch.device
    cache_slots: int
    ahead: int
    accelerator: Any = None
    buffers: Buffers = field(init=False)
    cache: ExpertCache = field(init=False)
    free: dict = field(default_factory=dict)  # shape signature -> read-ahead slots not in use
    made: dict = field(default_factory=dict)  # shape signature -> read-ahead slots made
    stream: Any = None  # the copy stream (made on first use)
    scratches: dict = field(default_factory=dict)  # "compute" / "ahead" -> decoding scratch (made on first use)

    def __post_init__(self) -> None:
        from offload_core import devices

        self.accelerator = self.accelerator or devices.for_device(self.device)
        self.buffers = Buffers(self.device)
        self.cache = ExpertCache(self.cache_slots)

    def copy_stream(self) -> Any:
        if self.stream is None:
            self.stream = self.accelerator.new_stream(self.device)
        return self.stream

    def scratch(self, stream: str, packed: Any, elements: int) -> Any:
        """The decoding scratch of the compute or the copy ``stream`` (each used on that stream only, in order), for
        passes of ``elements`` at least (an expert's rows: what the plan reserves)."""
        held = self.scratches.get(stream)
        if held is None or held.elements < elements:
            held = self.scratches[stream] = packed.new_scratch(self.device, elements)
        return held

    def new_rows(self, signature: tuple) -> DeviceRows:
        with torch.inference_mode(False):
            rows = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in signature]
        return DeviceRows(rows, signature)

    def take(self, signature: tuple) -> DeviceRows | None:
        """A free read-ahead slot of ``signature`` (made up to ``ahead`` of them), or None."""
        free = self.free.setdefault(signature, [])
        if free:
            return free.pop()
        if self.made.get(signature, 0) >= self.ahead:
            return None
        self.made[signature] = self.made.get(signature, 0) + 1
        return self.new_rows(signature)

    def give(self, signature: tuple, rows: DeviceRows) -> None:
        self.free.setdefault(signature, []).append(rows)

    def close(self) -> None:
        """Let go of every slot once the copies into them are done (the device memory goes back)."""
        if self.stream is not None:
            self.accelerator.synchronize_stream(self.stream)
        self.cache.resident.clear()
        self.free.clear()
        self.made.clear()
        self.scratches.clear()


def packed_experts(store: Mapping[str, torch.Tensor], keys: list[str]) -> dict[str, Any] | None:
    """Each of ``keys`` as ``store`` packs it for decoding on the device (:meth:`Store.packed_experts`), where it packs
    every one; else None."""
    packed = {key: as_store(store).packed_experts(key) for key in keys}
    return None if any(value is None for value in packed.values()) else packed
