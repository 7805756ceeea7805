"""A static prefetch schedule: offloaded unit i always lands in slot i mod K of a ring on the execution device, so
one decoding step (its copies and the event waits between them and the compute) is the same stream work each token
and can be captured in a graph."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from offload_core.module_hooks.prefetch.layout import _aligned, _nbytes
from offload_core.module_hooks.prefetch.trace import Trace
from offload_core.module_hooks.prefetch.transfer import Streams
from offload_core.module_hooks.units import TransferStats, Unit, tensor_spec


class StaticRing:
    """Drives the prefetch module hooks as the :class:`Prefetcher` does, without a reader thread or host waits.

    Units run in module order, each once per forward pass. As unit p starts, the copies of units up to p + K - 1 are
    queued on the side stream, each into slot q mod K after an event the compute stream recorded when unit q - K let
    go of that slot (the first K after an event at the start of the pass); the compute stream waits for the event
    after unit p's copies. Nothing here waits on the host, so a pass can be captured and replayed.
    """

    def __init__(
        self,
        units: list[Unit],
        store: Mapping[str, torch.Tensor],
        device: torch.device,
        depth: int,
        stats: TransferStats,
    ) -> None:
        self.units = units
        self.store = store
        self.device = device
        self.depth = max(int(depth), 0)
        self.slots_count = self.depth + 1
        self.stats = stats
        self.accel = Streams(device)
        self.trace = Trace()  # counters only (the order is fixed)
        self.hits = self.misses = self.late = self.borrowed = self.reread = 0
        self.waited_s = 0.0
        self.layouts = [self._layout(unit) for unit in units]
        self.capacity = max((end for _, end in self.layouts), default=0)
        self.slots: list[torch.Tensor] | None = None
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._copied: list[Any] = [None] * len(units)
        self._freed: list[Any] = [None] * self.slots_count
        self._issued = 0  # units whose copies this pass has queued
        self._next = 0  # the unit expected to run next
        self.pass_bytes = sum(unit.nbytes(store) for unit in units)

    @property
    def reads_ahead(self) -> bool:
        return self.depth > 0

    @property
    def block_pool(self) -> None:
        return None

    def _layout(self, unit: Unit) -> tuple[dict[str, tuple[int, torch.Size, torch.dtype]], int]:
        offsets, end = {}, 0
        for key in unit.keys:
            shape, dtype = tensor_spec(self.store, key)
            start = _aligned(end)
            offsets[key] = (start, shape, dtype)
            end = start + _nbytes(shape, dtype)
        return offsets, _aligned(end)

    def slot_of(self, index: int) -> int:
        return index % self.slots_count

    def _slot_views(self, index: int) -> dict[str, torch.Tensor]:
        views = self._views.get(index)
        if views is None:
            if self.slots is None:  # allocated once, before any capture
                empty = self.accel.accelerator.empty
                self.slots = [empty(self.capacity, torch.uint8, self.device) for _ in range(self.slots_count)]
            buffer = self.slots[self.slot_of(index)]
            views = {}
            for key, (offset, shape, dtype) in self.layouts[index][0].items():
                views[key] = buffer[offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)
            self._views[index] = views
        return views

    def _copy(self, q: int) -> None:
        if q >= self.slots_count:
            self.accel.side_waits(self._freed[self.slot_of(q)])
        views = self._slot_views(q)
        with self.accel.on_side():
            for key, view in views.items():
                if view.numel():
                    view.copy_(self.store[key], non_blocking=self.accel.cuda)
        self._copied[q] = self.accel.record_on_side()

    def load(self, index: int) -> None:
        from offload_core.errors import GraphsError

        unit = self.units[index]
        if unit.loaded:
            return
        if index == 0:  # a pass starts: the first slots are free once the work queued so far is done
            self._issued = 0
            self.accel.side_waits(self.accel.record_on_compute())
        elif index != self._next:
            raise GraphsError(
                f"graphs=true streams the offloaded blocks in module order, once each per forward pass: "
                f"{unit.name!r} ran where {self.units[self._next].name!r} was expected; drop graphs for this model"
            )
        for q in range(self._issued, min(index + self.slots_count, len(self.units))):
            self._copy(q)
        self._issued = max(self._issued, min(index + self.slots_count, len(self.units)))
        self.accel.compute_waits(self._copied[index])
        unit.load(self.store, self.device, None, fetched=self._slot_views(index))
        self.hits += 1
        self.stats.add_moved(len(unit.keys), unit.nbytes(self.store))
        self._next = (index + 1) % len(self.units)

    def release(self, index: int) -> None:
        unit = self.units[index]
        if not unit.loaded:
            return
        unit.release()
        self._freed[self.slot_of(index)] = self.accel.record_on_compute()

    def replayed(self) -> None:
        """A captured pass ran again: count what it moved."""
        self.stats.add_moved(sum(len(u.keys) for u in self.units), self.pass_bytes)
        self.hits += len(self.units)

    def revalidate(self) -> None:
        return None

    def close(self) -> None:
        for index, unit in enumerate(self.units):
            self.release(index)
        self.accel.synchronize()
        self.slots = None
        self._views.clear()
        self._next = self._issued = 0
