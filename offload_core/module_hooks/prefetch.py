"""prefetch: while block i computes, the next k offloaded blocks are brought in on a reader thread (CPU and GPU).

The first forward records the order in which units run (meanwhile the next units in module order
are read ahead); afterwards each call predicts the next k units and hands them to a background
reader. A unit that runs out of the predicted order invalidates the trace (it is recorded again),
every fetch in flight is dropped, and the unit is loaded synchronously: data always comes from the
store by name, so a mispredicted or late prefetch can cost time, never correctness.

How a unit's bytes arrive depends on where it runs and what the store hands out:

- CPU run, mapped store (memmap, safetensors in place): the reader pulls the next blocks' pages into
  the page cache; the unit then maps them. No copy and no anonymous memory. The page cache may
  evict read-ahead before it is used (memory pressure between two tokens): each forward pass starts
  by handing the reader again what was evicted, and a unit whose pages went missing after that is
  read in at once (one sequential read) rather than page-faulted in while it computes.
- Everything else (a GPU run; a CPU run whose store converts on read, or with ``pool=true``): the
  unit's tensors are copied into one buffer of a :class:`BlockPool` — ``depth + 1`` reusable buffers
  on the execution device (one more per level of units nested in units), each the size of the largest
  unit, allocated once. On a GPU, pageable bytes (a mapped store) travel
  through a :class:`StagingRing` of pinned host buffers on a side stream: the reader thread copies the
  next chunk from the mapped file into a pinned buffer (disk → pinned, page faults read the disk) while
  the previous chunk's copy to the device runs (pinned → device) and the compute stream runs the
  current block. The compute stream waits on an event recorded after a unit's last copy; a buffer is
  rewritten only after an event recorded when the compute stream let go of it. No blocking ``.to()``,
  no ``empty_cache``.
- Tied weights: a store key already on the device (another unit holds it, or brought it in) is
  borrowed, not copied again; its buffer is reference-counted and reused only when no unit holds it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import nn

from offload_core.module_hooks.align import attach_io_hooks
from offload_core.module_hooks.base import ModuleHook, add_hook_to_module, send_to_device
from offload_core.module_hooks.policy import PolicyContext, PolicyHandle
from offload_core.module_hooks.units import TransferStats, Unit, find_units
from offload_core.planning.reservation import InFlight, reserve_units
from offload_core.registry.contracts import Policy
from offload_core.storage.base import resident

log = logging.getLogger(__name__)

#: byte alignment of each tensor inside a block buffer (CUDA kernels want 256-byte aligned operands)
ALIGN = 256
#: pinned staging ring: this many buffers of this many bytes (host memory a GPU run spends on staging)
STAGING_BUFFERS = 3
STAGING_CHUNK = 16 * 2**20
#: a reader waiting this long for a free block buffer means the pool is wrongly sized: fail, never hang
ACQUIRE_TIMEOUT_S = 300.0


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


def tensor_spec(store: Mapping[str, torch.Tensor], key: str) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype ``store[key]`` hands out, without converting it where the store can tell."""
    spec = getattr(store, "spec", None)
    if spec is not None:
        return spec(key)
    tensor = store[key]
    return tensor.shape, tensor.dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class _Accelerator:
    """The few stream and event calls of a CUDA run; on a CPU run every one is a synchronous no-op."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def record_on_side(self) -> Any:
        """An event on the side stream after everything queued there so far."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def record_on_compute(self) -> Any:
        """An event on the compute stream after everything queued there so far (kernels reading a buffer)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def side_waits(self, event: Any) -> None:
        if event is not None:
            self.stream.wait_event(event)

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def on_side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()


class StagingRing:
    """A fixed ring of pinned host buffers carrying pageable bytes to the device in chunks.

    For each chunk: wait until the copy that last read this buffer has finished (its event), copy the
    chunk from the source into it on this thread (for a mapped file, this is where the disk is read),
    then queue its copy to the device on the side stream and record the buffer's event. With
    ``count >= 2`` the host copy of one chunk overlaps the device copy of the one before.
    """

    def __init__(self, accel: _Accelerator, count: int = STAGING_BUFFERS, chunk: int = STAGING_CHUNK) -> None:
        self.accel = accel
        self.count = count
        self.chunk = chunk
        self.buffers: list[torch.Tensor] = []
        self.events: list[Any] = [None] * count
        self.next = 0
        self.chunks = 0
        # The reader and, on a miss, the compute thread may both copy: one tensor at a time goes through.
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def _buffer(self, i: int) -> torch.Tensor:
        while len(self.buffers) <= i:  # allocated on first use, once
            self.buffers.append(torch.empty(self.chunk, dtype=torch.uint8, pin_memory=self.accel.cuda))
        return self.buffers[i]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the 1-D uint8 host tensor ``src`` into the 1-D uint8 device tensor ``dst`` (same length)."""
        with self._lock:
            self._copy(src, dst)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        total = src.numel()
        for start in range(0, total, self.chunk):
            n = min(self.chunk, total - start)
            i = self.next
            self.next = (i + 1) % self.count
            if self.events[i] is not None:
                self.events[i].synchronize()
            stage = self._buffer(i)[:n]
            stage.copy_(src[start:start + n])
            with self.accel.on_side():
                dst[start:start + n].copy_(stage, non_blocking=True)
            self.events[i] = self.accel.record_on_side()
            self.chunks += 1


class BlockPool:
    """``count`` reusable buffers of ``capacity`` bytes on ``device``, reference-counted.

    A buffer is allocated the first time it is needed and kept. Each fetch holds a reference on the
    buffer it filled and on every buffer it borrowed a tied tensor from; a buffer whose last
    reference goes is free again, after the compute stream is done with it (``free_event``).
    """

    def __init__(self, count: int, capacity: int, device: torch.device) -> None:
        self.count = count
        self.capacity = capacity
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.refs = [0] * count
        self.free_events: list[Any] = [None] * count
        self.free = deque(range(count))
        self.cond = threading.Condition()
        self.peak_in_use = 0
        #: key -> (tensor view in a buffer, buffer index): what is on the device now, for borrowing
        self.live: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    def acquire(self, dropped: threading.Event | None = None) -> tuple[int, torch.Tensor, Any] | None:
        """A free buffer (waiting for one), with one reference; returns (index, buffer, event to wait for).

        Returns None when ``dropped`` is set meanwhile: a fetch nobody wants any more never waits on,
        nor takes, a buffer that a wanted one needs.
        """
        with self.cond:
            if not self.cond.wait_for(lambda: self.free or (dropped is not None and dropped.is_set()),
                                      timeout=ACQUIRE_TIMEOUT_S):
                raise RuntimeError(f"prefetch: no free block buffer after {ACQUIRE_TIMEOUT_S:.0f} s "
                                   f"({self.count} buffers, all held)")
            if not self.free:
                return None
            index = self.free.popleft()
            self.refs[index] = 1
            self.peak_in_use = max(self.peak_in_use, self.count - len(self.free))
            event, self.free_events[index] = self.free_events[index], None
        if self.buffers[index] is None:
            self.buffers[index] = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return index, self.buffers[index], event

    def borrow(self, key: str) -> tuple[torch.Tensor, int] | None:
        """The device copy of ``key`` if a buffer holds it, with one more reference on that buffer."""
        with self.cond:
            hit = self.live.get(key)
            if hit is not None:
                self.refs[hit[1]] += 1
            return hit

    def publish(self, key: str, tensor: torch.Tensor, index: int) -> None:
        with self.cond:
            self.live[key] = (tensor, index)

    def release(self, index: int, event: Any = None) -> None:
        """Drop one reference; the last one frees the buffer (rewritten only after ``event``)."""
        with self.cond:
            if event is not None:  # the latest point the compute stream used it (a later holder may not have)
                self.free_events[index] = event
            self.refs[index] -= 1
            if self.refs[index] > 0:
                return
            for key in [k for k, (_, i) in self.live.items() if i == index]:
                del self.live[key]
            self.free.append(index)
            self.cond.notify_all()

    def wake(self) -> None:
        """Make waiting readers look again (one of them may have been dropped)."""
        with self.cond:
            self.cond.notify_all()


@dataclass
class Fetched:
    """A unit's tensors ready on the execution device, and what they hold until released."""

    tensors: dict[str, torch.Tensor]
    buffers: list[int] = field(default_factory=list)
    event: Any = None  # the compute stream waits on it before using ``tensors``
    moved: int = 0  # bytes brought in: copied, or read into the page cache (borrowed tensors move nothing)
    mapped: list[str] = field(default_factory=list)  # keys served as mapped pages (the page cache may evict them)


class Prefetcher:
    """Owns the reader thread, the block pool and the in-flight fetches (at most ``depth`` units ahead)."""

    def __init__(self, units: list[Unit], store: Mapping[str, torch.Tensor], device: torch.device,
                 depth: int, stats: TransferStats, copy: bool | None = None, staging: bool | None = None,
                 staging_chunk: int = STAGING_CHUNK) -> None:
        """``copy``: copy units into the block pool even on a CPU run with a mapped store (default: only
        where needed). ``staging``: carry bytes through the pinned ring (default: on a GPU run, for a
        store that is not pinned). Both exist so that the GPU data path runs, and is tested, on a CPU."""
        self.units = units
        self.store = store
        self.device = device
        self.depth = max(int(depth), 0)
        self.stats = stats
        self.accel = _Accelerator(device)
        self.copy = device.type != "cpu" if copy is None else bool(copy)
        if staging is None:
            staging = self.accel.cuda and not getattr(store, "pinned", False)
        self.staging = StagingRing(self.accel, chunk=staging_chunk) if staging else None
        self.trace = Trace()
        self.pending: dict[int, tuple[Future, threading.Event, Fetched]] = {}
        self.held: dict[int, Fetched] = {}
        self.hits = 0
        self.misses = 0
        self.borrowed = 0
        self.late = 0  # predicted fetches the compute thread still had to wait for
        self.waited_s = 0.0  # ... and how long it waited for them
        self.reread = 0  # read-ahead pages evicted before use, read in again
        self._blocks: BlockPool | None = None
        self._blocks_lock = threading.Lock()
        self._layouts: dict[str, tuple[dict[str, tuple[int, torch.Size, torch.dtype]], int]] = {}
        self._nesting = _max_nesting(units)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-prefetch") if self.depth else None

    # -- the block pool ---------------------------------------------------------------------------
    @property
    def blocks(self) -> BlockPool:
        """The pool, sized on first use: depth + the deepest nesting of units (1 for a plain stack of blocks)."""
        with self._blocks_lock:
            if self._blocks is None:
                capacity = max((self._layout(u)[1] for u in self.units), default=0)
                self._blocks = BlockPool(self.depth + self._nesting, capacity, self.device)
            return self._blocks

    def _layout(self, unit: Unit) -> tuple[dict[str, tuple[int, torch.Size, torch.dtype]], int]:
        """Where each of the unit's tensors sits in a block buffer (aligned offsets), and the bytes it needs."""
        layout = self._layouts.get(unit.name)
        if layout is None:
            offsets, end = {}, 0
            for key in unit.keys:
                shape, dtype = tensor_spec(self.store, key)
                offsets[key] = (end, shape, dtype)
                end += _aligned(_nbytes(shape, dtype))
            layout = self._layouts[unit.name] = (offsets, end)
        return layout

    # -- fetching (the reader thread; the compute thread for a miss) ------------------------------
    def _fetch(self, index: int, fetched: Fetched | None = None, dropped: threading.Event | None = None) -> Fetched:
        """Bring unit ``index`` in; ``fetched`` may already hold the tensors borrowed when it was scheduled."""
        unit = self.units[index]
        # Borrow again here: a unit fetched just before this one (the reader goes in order) may have
        # brought in a tied tensor after this fetch was scheduled.
        fetched = self._borrow(unit, fetched)
        try:
            need = self._map(unit, fetched)
            if need and not self._copy_in(unit, need, fetched, dropped):
                self._drop(fetched)  # dropped while waiting for a buffer: nobody will use it
                return fetched
            fetched.event = self.accel.record_on_side()
        except BaseException:
            self._drop(fetched)
            raise
        return fetched

    def _borrow(self, unit: Unit, fetched: Fetched | None = None) -> Fetched:
        """``fetched`` (a new fetch if None) with the unit's tensors that a block buffer already holds.

        Tied weights: called on the compute thread when the unit is scheduled, while the unit that
        brought a tied tensor in may still hold it, so the reference is taken at once.
        """
        fetched = fetched if fetched is not None else Fetched({})
        if self._blocks is not None:
            for key in unit.keys:
                if key in fetched.tensors:
                    continue
                hit = self._blocks.borrow(key)
                if hit is not None:
                    fetched.tensors[key] = hit[0]
                    fetched.buffers.append(hit[1])
                    self.borrowed += 1
        return fetched

    def _map(self, unit: Unit, fetched: Fetched) -> list[str]:
        """Serve keys as mapped pages where the store can (read in now); returns the keys left to copy."""
        need = []
        for key in unit.keys:
            if key in fetched.tensors:
                continue
            if not self.copy and hasattr(self.store, "warm") and self.store.warm(key):
                tensor = fetched.tensors[key] = self.store[key]
                fetched.moved += tensor.numel() * tensor.element_size()
                fetched.mapped.append(key)
            else:
                need.append(key)
        return need

    def _copy_in(self, unit: Unit, keys: list[str], fetched: Fetched, dropped: threading.Event | None) -> bool:
        """Copy ``keys`` into a free block buffer, each at its place in the unit's layout (False: dropped first)."""
        pool = self.blocks
        offsets, _ = self._layout(unit)
        acquired = pool.acquire(dropped)
        if acquired is None:
            return False
        index, buffer, free_event = acquired
        fetched.buffers.append(index)
        self.accel.side_waits(free_event)
        for key in keys:
            offset, shape, dtype = offsets[key]
            nbytes = _nbytes(shape, dtype)
            if nbytes:
                dst = buffer[offset:offset + nbytes]
                view = dst.view(dtype).view(shape)
                self._copy_tensor(key, view, dst)
            else:
                view = torch.empty(shape, dtype=dtype, device=self.device)
            pool.publish(key, view, index)
            fetched.tensors[key] = view
            fetched.moved += nbytes
        return True

    def _copy_tensor(self, key: str, view: torch.Tensor, dst_bytes: torch.Tensor) -> None:
        read_into = getattr(self.store, "read_into", None)
        if not self.accel.cuda and self.staging is None and read_into is not None:
            read_into(key, view)  # host to host: one pass, converting where the store does
            return
        src = self.store[key]
        if self.staging is not None and not src.is_pinned():
            self.staging.copy(_flat_bytes(src), dst_bytes)
            return
        with self.accel.on_side():
            view.copy_(src, non_blocking=self.accel.cuda)

    # -- read-ahead whose pages the page cache let go of before use ------------------------------
    def _evicted(self, fetched: Fetched) -> bool:
        return any(not resident(fetched.tensors[key]) for key in fetched.mapped)

    def _read_again(self, fetched: Fetched) -> Fetched:
        for key in fetched.mapped:
            self.store.warm(key)
        return fetched

    def revalidate(self) -> None:
        """Hand the reader again the read-ahead whose pages were evicted before use (the compute thread,
        as a forward pass starts).

        Between two passes (tokens) the page cache may let go of pages read ahead for the next pass
        (memory pressure; a benchmark dropping the cache). Read in again now, they arrive while the
        resident layers run, instead of by page faults on the compute thread when their unit runs.
        """
        for index, (future, dropped, fetched) in list(self.pending.items()):
            if future.done() and not future.cancelled() and future.exception() is None and self._evicted(fetched):
                self.pending[index] = (self._pool.submit(self._read_again, fetched), dropped, fetched)
                self.reread += 1

    def _drop(self, fetched: Fetched, event: Any = None) -> None:
        for index in fetched.buffers:
            self._blocks.release(index, event)
        fetched.buffers = []

    def _drop_pending(self, index: int) -> None:
        self._let_go(*self.pending.pop(index))

    def _let_go(self, future: Future, dropped: threading.Event, fetched: Fetched) -> None:
        """Let go of a fetch nobody will use: cancelled if not started, else released once it ends."""
        dropped.set()
        if future.cancel():
            self._drop(fetched)  # what it borrowed when scheduled
            return
        if self._blocks is not None:
            self._blocks.wake()

        def done(f: Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self._drop(f.result())

        future.add_done_callback(done)

    def _schedule(self, indices: list[int]) -> None:
        for index in indices:
            if index not in self.pending and not self.units[index].loaded:
                dropped = threading.Event()
                fetched = self._borrow(self.units[index])
                self.pending[index] = (self._pool.submit(self._fetch, index, fetched, dropped), dropped, fetched)

    # -- the compute thread -----------------------------------------------------------------------
    def load(self, index: int) -> None:
        unit = self.units[index]
        predicted = self.trace.observe(index)
        if unit.loaded:  # a unit called again inside itself keeps what it has
            return
        if index in self.pending:
            self.hits += 1
            future, dropped, scheduled = self.pending.pop(index)
            late = not future.done()  # predicted, but not early enough: the compute thread waits
            started = time.perf_counter()
            try:
                fetched = future.result()
            except BaseException:  # Ctrl-C while waiting, or the read failed: its buffers go back when it ends
                self._let_go(future, dropped, scheduled)
                raise
            if self._evicted(fetched):
                # Evicted since it was read ahead: one read now beats page faults while it computes.
                self._read_again(fetched)
                self.reread += 1
                late = True
            if late:
                self.late += 1
                self.waited_s += time.perf_counter() - started
        else:
            self.misses += 1
            # Whatever was read ahead was for another order: let it go, so its buffers are free.
            for stale in list(self.pending):
                self._drop_pending(stale)
            fetched = self._fetch(index)
        self.accel.compute_waits(fetched.event)
        self.held[index] = fetched
        unit.load(self.store, self.device, None, fetched=fetched.tensors)
        self.stats.add_moved(len(unit.keys), fetched.moved)
        if self._pool is not None:
            # Along the recorded trace once there is one; until then, in module order (usually the
            # order of execution). Fetches for units no longer expected are dropped (bounded memory).
            upcoming = self.trace.upcoming(self.depth) if predicted else self._in_module_order(index)
            for stale in [i for i in self.pending if i not in upcoming]:
                self._drop_pending(stale)
            self._schedule(upcoming)

    def _in_module_order(self, index: int) -> list[int]:
        return list(range(index + 1, min(index + 1 + self.depth, len(self.units))))

    def release(self, index: int) -> None:
        self.units[index].release()
        fetched = self.held.pop(index, None)
        if fetched is not None and fetched.buffers:
            self._drop(fetched, self.accel.record_on_compute())

    def close(self) -> None:
        for index in list(self.pending):
            self._drop_pending(index)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for index in list(self.held):
            self.release(index)


def _max_nesting(units: list[Unit]) -> int:
    """The most units that can be loaded at once: the longest chain of units inside one another."""
    names = [u.name for u in units]

    def depth(name: str) -> int:
        return 1 + sum(1 for other in names if other != name and (other == "" or name.startswith(other + ".")))

    return max((depth(n) for n in names), default=1)


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


class RevalidateHook(ModuleHook):
    """On the model's root: each forward pass starts by re-queueing read-ahead the page cache evicted."""

    name = "prefetch_revalidate"

    def __init__(self, prefetcher: Prefetcher) -> None:
        self.prefetcher = prefetcher

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.prefetcher.revalidate()
        return args, kwargs


class PrefetchHandle(PolicyHandle):
    """The prefetch policy's handle: its counters are the prefetcher's."""

    def __init__(self, *args: Any, prefetcher: Prefetcher, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefetcher = prefetcher

    def counters(self) -> dict[str, int | float]:
        """Blocks read ahead (``hits``) or loaded on demand (``misses``), read-ahead waited for (``late``,
        ``wait_s``), tied tensors borrowed, read-ahead read again after the page cache evicted it, and
        recorded execution orders dropped because a unit ran out of order (``invalidations``)."""
        p = self.prefetcher
        return {"hits": p.hits, "misses": p.misses, "late": p.late, "wait_s": p.waited_s, "borrowed": p.borrowed,
                "read_again": p.reread, "invalidations": p.trace.invalidations}

    def offload_all(self) -> None:
        for index in list(self.prefetcher.held):
            self.prefetcher.release(index)
        super().offload_all()

    def remove(self, restore_device: torch.device | str = "cpu") -> nn.Module:
        self.prefetcher.close()
        return super().remove(restore_device)


@dataclass
class PrefetchConfig:
    name: str = "prefetch"
    #: look-ahead depth k: how many upcoming offloaded blocks are in flight while one computes
    depth: int = 2
    #: copy blocks into k+1 reusable buffers on the execution device (null: on a GPU run, or where the
    #: store converts on read; true on a CPU run reads mapped pages into private buffers ahead of use)
    pool: Optional[bool] = None
    #: GPU run from a store that is not pinned: size of each of the pinned staging buffers
    staging_chunk: str = "16MiB"


class Prefetch(Policy):
    """Policy: block-granular units, loaded ahead of use along the recorded execution order.

    ``staging`` forces the pinned staging ring on or off (default: on a GPU run whose store is not
    pinned); on a CPU run it sends the GPU data path through host buffers, which is how it is tested.
    """

    granularity = "block"

    def __init__(self, config: PrefetchConfig, staging: bool | None = None) -> None:
        from offload_core.errors import ConfigError
        from offload_core.values import parse_size

        if config.depth < 0:
            raise ConfigError(f"hook.depth={config.depth} is negative: give the number of blocks to read ahead (0 turns prefetch off)")
        self.chunk = parse_size(config.staging_chunk, what="hook.staging_chunk")
        if self.chunk < 4096:
            raise ConfigError(f"hook.staging_chunk={config.staging_chunk} is below 4KiB: give a size such as 16MiB")
        self.config = config
        self.staging = staging

    def reserve(self, need: InFlight) -> dict:
        """The block that runs and ``depth`` more read ahead: copies on a GPU, in the pool with
        ``pool=true``, or where the store converts; on a GPU run from a store that is not pinned, the
        staging ring in host memory too."""
        reserve = reserve_units(need, need.block_bytes, 1 + self.config.depth, copies_on_cpu=bool(self.config.pool))
        if need.execution_device.type != "cpu":
            reserve["cpu"] = 0 if need.store_pinned else STAGING_BUFFERS * self.chunk
        return reserve

    def attach(self, model: nn.Module, context: PolicyContext) -> PolicyHandle:
        units = find_units(model, context.offloaded, context.no_split_module_classes, self.granularity)
        handles = attach_io_hooks(model, context, True, ())
        prefetcher = Prefetcher(units, context.store, context.execution_device, self.config.depth, context.stats,
                                copy=self.config.pool, staging=self.staging, staging_chunk=self.chunk)
        if units and prefetcher.depth and not prefetcher.copy:
            handles.append(add_hook_to_module(model, RevalidateHook(prefetcher)))
        for index, unit in enumerate(units):
            handles.append(add_hook_to_module(unit.module, PrefetchHook(index, prefetcher, context.execution_device)))
        return PrefetchHandle(model, context, units, handles, prefetcher=prefetcher)
