"""prefetch: while block i computes, the next k offloaded blocks are brought in on a reader thread (CPU and GPU).

The first forward records the order in which units run (meanwhile the next units in module order
are read ahead); afterwards each call predicts the next k units and hands them to a background reader. On a CPU run with a mapped store (memmap, safetensors)
the reader pulls the next blocks' bytes into the page cache, so the compute thread never waits on the
disk and no anonymous memory is spent; on a GPU run it copies them on a side stream and the compute
stream waits on an event. A unit that runs out of the predicted order invalidates the trace (it is
recorded again) and is loaded synchronously: data always comes from the store by name, so a
mispredicted or late prefetch can cost time, never correctness.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.module_hooks.align import attach_io_hooks
from offload_core.module_hooks.base import ModuleHook, add_hook_to_module, send_to_device
from offload_core.module_hooks.units import DispatchPlan, PolicyHandle, TransferStats, Unit, find_units

log = logging.getLogger(__name__)


class Trace:
    """The recorded order of unit calls; predicts the units that come after a position (cyclically)."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.complete = False
        self.position = -1
        self.invalidations = 0

    def observe(self, unit: int) -> bool:
        """Record a call; returns True when it was the predicted one (the trace is usable)."""
        if not self.complete:
            if self.order and unit == self.order[0]:
                self.complete = True
                self.position = 0
                return True
            if unit in self.order:  # a repeat before the cycle closed: start again from here
                self.order = [unit]
                return False
            self.order.append(unit)
            self.position = len(self.order) - 1
            return False
        expected = self.order[(self.position + 1) % len(self.order)]
        if unit == expected:
            self.position = (self.position + 1) % len(self.order)
            return True
        self.invalidations += 1
        self.order = [unit]
        self.complete = False
        self.position = 0
        return False

    def upcoming(self, depth: int) -> list[int]:
        if not self.complete:
            return []
        n = len(self.order)
        return [self.order[(self.position + i) % n] for i in range(1, min(depth, n - 1) + 1)]


class Prefetcher:
    """Owns the reader thread and the in-flight fetches (at most ``depth`` units ahead, plus the current)."""

    def __init__(self, units: list[Unit], store: Mapping[str, torch.Tensor], device: torch.device,
                 depth: int, stats: TransferStats, non_blocking: bool) -> None:
        self.units = units
        self.store = store
        self.device = device
        self.depth = max(int(depth), 0)
        self.stats = stats
        self.non_blocking = non_blocking
        self.trace = Trace()
        self.pending: dict[int, Future] = {}
        self.hits = 0
        self.misses = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-prefetch") if self.depth else None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and self.depth else None

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self, index: int) -> Any:
        unit = self.units[index]
        if self.device.type == "cpu":
            # Mapped stores: pull the bytes into the page cache; the unit then maps them at no cost.
            # Stores with nothing to warm (or converting on read) get the tensors fetched ahead instead.
            warmed = [self.store.warm(key) for key in unit.keys] if hasattr(self.store, "warm") else [False]
            return None if all(warmed) else unit.fetch(self.store, self.device)
        with torch.cuda.stream(self._stream):
            fetched = unit.fetch(self.store, self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return fetched, event

    def _schedule(self, indices: list[int]) -> None:
        for index in indices:
            if index not in self.pending and not self.units[index].loaded:
                self.pending[index] = self._pool.submit(self._read, index)

    # -- the compute thread -----------------------------------------------------------------------
    def load(self, index: int) -> None:
        predicted = self.trace.observe(index)
        future = self.pending.pop(index, None)
        fetched = None
        if future is not None:
            result = future.result()
            self.hits += 1
            if self.device.type == "cuda":
                fetched, event = result
                current = torch.cuda.current_stream(self.device)
                current.wait_event(event)
                for tensor in fetched.values():
                    tensor.record_stream(current)
            else:
                fetched = result
        else:
            self.misses += 1
        self.units[index].load(self.store, self.device, self.stats, self.non_blocking, fetched=fetched)
        if self._pool is not None:
            # Along the recorded trace once there is one; until then, in module order (usually the
            # order of execution). Fetches for units no longer expected are dropped (bounded memory).
            upcoming = self.trace.upcoming(self.depth) if predicted else self._in_module_order(index)
            for stale in [i for i in self.pending if i not in upcoming]:
                self.pending.pop(stale).cancel()
            self._schedule(upcoming)

    def _in_module_order(self, index: int) -> list[int]:
        return list(range(index + 1, min(index + 1 + self.depth, len(self.units))))

    def release(self, index: int) -> None:
        self.units[index].release()

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class PrefetchHook(ModuleHook):
    name = "prefetch_offload"

    def __init__(self, index: int, prefetcher: Prefetcher, execution_device: torch.device) -> None:
        self.index = index
        self.prefetcher = prefetcher
        self.execution_device = execution_device

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.prefetcher.load(self.index)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.prefetcher.release(self.index)
        return output

    def on_error(self, module: nn.Module) -> None:
        self.prefetcher.release(self.index)

    def detach_hook(self, module: nn.Module) -> None:
        self.prefetcher.release(self.index)


class PrefetchHandle(PolicyHandle):
    def __init__(self, *args: Any, prefetcher: Prefetcher, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefetcher = prefetcher

    def remove(self, restore_device: torch.device | str = "cpu") -> nn.Module:
        self.prefetcher.close()
        return super().remove(restore_device)


@dataclass
class PrefetchConfig:
    name: str = "prefetch"
    #: look-ahead depth k: how many upcoming offloaded blocks are in flight while one computes
    depth: int = 2


class Prefetch:
    """Policy: block-granular units, loaded ahead of use along the recorded execution order."""

    def __init__(self, config: PrefetchConfig) -> None:
        if config.depth < 0:
            from offload_core.errors import ConfigError

            raise ConfigError(f"hook.depth={config.depth} is negative: give the number of blocks to read ahead (0 turns prefetch off)")
        self.config = config

    def attach(self, model: nn.Module, plan: DispatchPlan) -> PolicyHandle:
        units = find_units(model, plan.offloaded, plan.no_split_module_classes, "block")
        handles = attach_io_hooks(model, plan, True, ())
        prefetcher = Prefetcher(units, plan.store, plan.execution_device, self.config.depth, plan.stats, plan.non_blocking)
        for index, unit in enumerate(units):
            handles.append(add_hook_to_module(unit.module, PrefetchHook(index, prefetcher, plan.execution_device)))
        return PrefetchHandle(model, plan, units, handles, prefetcher=prefetcher)
