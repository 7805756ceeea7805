"""The reader thread: brings predicted units in ahead of use (mapped pages or copies into the block pool) and hands
them to the units as they run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from offload_core.module_hooks.prefetch.hook import PrefetchHook  # noqa: F401 (its home before: imported from here)
from offload_core.module_hooks.prefetch.layout import _aligned, _max_nesting, _nbytes
from offload_core.module_hooks.prefetch.pool import BlockPool
from offload_core.module_hooks.prefetch.trace import Trace
from offload_core.module_hooks.prefetch.transfer import STAGING_CHUNK, StagingRing, Streams, flat_bytes
from offload_core.module_hooks.keeper import PageCacheKeeper
from offload_core.module_hooks.reader import Reader
from offload_core.module_hooks.units import TransferStats, Unit, tensor_spec
from offload_core.storage.base import as_store, moved_bytes
from offload_core.storage.pagecache import page_spans, resident, spans_resident
from offload_core.storage.residency import Residency


@dataclass
class Fetched:
    """A unit's tensors ready on the execution device, and what they hold until released."""

    tensors: dict[str, torch.Tensor]
    buffers: list[int] = field(default_factory=list)
    event: Any = None  # the compute stream waits on it before using ``tensors``
    moved: int = 0  # bytes brought in: copied, or read into the page cache (borrowed tensors move nothing)
    mapped: list[str] = field(default_factory=list)  # keys served as mapped pages (the page cache may evict them)
    complete: bool = True  # False: a read-ahead that found no free block buffer; its unit is read when it runs
    params: dict[str, nn.Parameter] | None = None  # the unit's parameters made of ``tensors`` (made once, reused)


class Prefetcher:
    """Owns the reader thread, the block pool and the in-flight fetches (at most ``depth`` units ahead)."""

    def __init__(
        self,
        units: list[Unit],
        store: Mapping[str, torch.Tensor],
        device: torch.device,
        depth: int,
        stats: TransferStats,
        copy: bool | None = None,
        staging: bool | None = None,
        staging_chunk: int = STAGING_CHUNK,
        residency: Residency | None = None,
    ) -> None:
        """``copy``: copy units into the block pool even on a CPU run with a mapped store (default: only
        where needed). ``staging``: carry bytes through the pinned ring (default: on a GPU run, for a
        store that is not pinned); forced on, it runs the GPU data path on a CPU. ``residency``: the
        units it streams have their pages dropped from the page cache once they have run; the ones it
        keeps stay cached across tokens."""
        self.units = units
        self.store = store = as_store(store)
        self.device = device
        self.depth = max(int(depth), 0)
        self.stats = stats
        self.accel = Streams(device)
        self.copy = device.type != "cpu" if copy is None else bool(copy)
        if staging is None:
            staging = self.accel.cuda and not store.pinned
        self.staging = StagingRing(self.accel, chunk=staging_chunk) if staging else None
        # Copies from pinned memory only queue DMA on the side stream: issued by the compute thread itself, the next
        # units' copies are queued before the current unit's kernels, with no hand-off to a reader thread to wait for.
        self.inline = self.accel.cuda and self.copy and not staging and store.pinned
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
        self._reader = Reader("prefetch")
        self.residency = residency
        # The reader brings pages in: the keeper counts, drops and fits the kept set.
        self.keeper = PageCacheKeeper(residency, store, units, warm=False) if residency is not None else None
        # Kept units of a mapped run all in memory when last served: checked where they run, not handed to the reader
        # each token (on a warm 2-core run its wake-ups cost a quarter of decoding: mixtral-2.6g 13.2-14.6 tokens/s
        # against 15.4-19.6 reading nothing ahead); :meth:`revalidate` hands it those whose pages went. Each is
        # handed to its unit as it was last fetched (no store look-ups, no page checks per call: a warm in-memory
        # run pays neither), its pages checked once per pass, one ``mincore`` per run of neighbouring pages.
        self._settled: dict[int, tuple[Fetched, list[tuple[int, int]]]] = {}

    # -- the block pool ---------------------------------------------------------------------------
    @property
    def reads_ahead(self) -> bool:
        """Whether a reader thread brings units in ahead of use (``depth`` > 0)."""
        return self.depth > 0

    @property
    def block_pool(self) -> BlockPool | None:
        """The block pool, or None while no unit has been copied into one."""
        return self._blocks

    def unit_bytes(self, unit: Unit) -> int:
        """The bytes ``unit`` takes in a block buffer (each tensor aligned to :data:`ALIGN`)."""
        return self._layout(unit)[1]

    @property
    def blocks(self) -> BlockPool:
        """The pool, sized on first use: depth + the deepest nesting of units (1 for a plain stack of blocks)."""
        with self._blocks_lock:
            if self._blocks is None:
                capacity = max((self._layout(u)[1] for u in self.units), default=0)
                self._blocks = BlockPool(self.depth + self._nesting, capacity, self.device)
            return self._blocks

    def _layout(self, unit: Unit) -> tuple[dict[str, tuple[int, torch.Size, torch.dtype]], int]:
        """Where each of the unit's tensors sits in a block buffer, and the bytes it needs: each tensor starts on
        an :data:`ALIGN` boundary, plus on a CPU its reference offset (:meth:`Store.offset`), so that
        kernels that depend on alignment compute as with the in-memory model."""
        layout = self._layouts.get(unit.name)
        if layout is None:
            offsets, end = {}, 0
            for key in unit.keys:
                shape, dtype = tensor_spec(self.store, key)
                start = _aligned(end) + (self.store.offset(key) if self.device.type == "cpu" else 0)
                offsets[key] = (start, shape, dtype)
                end = start + _nbytes(shape, dtype)
            layout = self._layouts[unit.name] = (offsets, _aligned(end))
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
            if need and not self._copy_in(unit, need, fetched, wait=dropped is None):
                self._drop(fetched)  # a read-ahead with no free buffer: handed back unread
                fetched.complete = False
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
            if not self.copy and self.store.warm(key):
                tensor = fetched.tensors[key] = self.store[key]
                fetched.moved += tensor.numel() * tensor.element_size()
                fetched.mapped.append(key)
            else:
                need.append(key)
        return need

    def _copy_in(self, unit: Unit, keys: list[str], fetched: Fetched, wait: bool) -> bool:
        """Copy ``keys`` into a free block buffer, each at its place in the unit's layout (False: no buffer was
        free and ``wait`` is off, as on the reader: see :meth:`BlockPool.acquire`)."""
        pool = self.blocks
        offsets, _ = self._layout(unit)
        acquired = pool.acquire(wait)
        if acquired is None:
            return False
        index, buffer, free_event = acquired
        fetched.buffers.append(index)
        self.accel.side_waits(free_event)
        for key in keys:
            offset, shape, dtype = offsets[key]
            nbytes = _nbytes(shape, dtype)
            dst = buffer[offset : offset + nbytes]
            view = dst.view(dtype).view(shape)  # an empty tensor is an empty view of the buffer
            if nbytes:
                self._copy_tensor(key, view, dst)
            pool.publish(key, view, index)
            fetched.tensors[key] = view
            fetched.moved += moved_bytes(self.store, key, nbytes)
        return True

    def _copy_tensor(self, key: str, view: torch.Tensor, dst_bytes: torch.Tensor) -> None:
        if not self.accel.cuda and self.staging is None and self.store.reads_into:
            self.store.read_into(key, view)  # host to host: one pass, converting where the store does
            return
        src = self.store[key]
        if self.staging is not None and not self.accel.is_pinned(src):
            self.staging.copy(flat_bytes(src), dst_bytes)
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
        ahead = self._window(-1, predicted=True) if self.reads_ahead and self.trace.complete else []
        if self.keeper is not None:
            busy = set(self.pending) | set(self.held) | (set(self._settled) & set(ahead))
            self.keeper.start_pass(self.units[index].name for index in busy)
        # settled units that left the kept set or whose pages were let go of: read ahead again from now on
        settled = self._settled.items()
        unsettled = [i for i, (_, spans) in settled if not self._kept_mapped(i) or not spans_resident(spans)]
        for index in unsettled:
            del self._settled[index]
        if unsettled and ahead:
            self._schedule(ahead)
        if not self.pending and len(self._settled) == len(self.units):
            self._reader.stop()  # idle: its thread's OpenMP team would throttle the compute threads' spinning
        for index, (future, dropped, fetched) in list(self.pending.items()):
            if future.done() and not future.cancelled() and future.exception() is None and self._evicted(fetched):
                self.pending[index] = (self._reader.submit(self._read_again, fetched), dropped, fetched)
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

    def _kept_mapped(self, index: int) -> bool:
        """Whether unit ``index`` is in the kept set of a run that computes on mapped pages."""
        return self.residency is not None and not self.copy and self.residency.is_kept(self.units[index].name)

    def _schedule(self, indices: list[int]) -> None:
        for index in indices:
            if index in self._settled and self._kept_mapped(index):
                continue  # checked where it runs (see __init__)
            if index not in self.pending and not self.units[index].loaded:
                dropped = threading.Event()
                with torch.inference_mode(False):  # blocks and copies made by any caller are plain tensors
                    fetched = self._borrow(self.units[index])
                    self.pending[index] = (self._issue(index, fetched, dropped), dropped, fetched)

    def _issue(self, index: int, fetched: Fetched, dropped: threading.Event) -> Future:
        """Unit ``index`` read ahead: on the reader thread, or at once where its copies only queue (:attr:`inline`;
        a read-ahead never waits for a block buffer, and a failure is raised where the unit runs, as a reader's)."""
        if not self.inline:
            return self._reader.submit(self._fetch, index, fetched, dropped)
        future: Future = Future()
        try:
            future.set_result(self._fetch(index, fetched, dropped))
        except Exception as error:
            future.set_exception(error)
        return future

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
            started = time.perf_counter() if late else 0.0
            try:
                fetched = future.result()
            except BaseException:  # Ctrl-C while waiting, or the read failed: its buffers go back when it ends
                self._let_go(future, dropped, scheduled)
                raise
            if not fetched.complete:
                # No buffer was free for it: read it now, with the other read-aheads let go (their buffers too).
                for stale in list(self.pending):
                    self._drop_pending(stale)
                started = started or time.perf_counter()
                fetched = self._fetch(index, self._borrow(unit))
                late = True
            elif self._evicted(fetched):
                # Evicted since it was read ahead: one read now beats page faults while it computes.
                started = started or time.perf_counter()
                self._read_again(fetched)
                self.reread += 1
                late = True
            if late:
                self.late += 1
                self.waited_s += time.perf_counter() - started
        elif index in self._settled and self._kept_mapped(index):
            self.hits += 1
            fetched = self._settled[index][0]
        else:
            self.misses += 1
            # Whatever was read ahead was for another order: let it go, so its buffers are free.
            for stale in list(self.pending):
                self._drop_pending(stale)
            fetched = self._fetch(index)
        if not fetched.buffers and self._kept_mapped(index):
            if index not in self._settled:
                self._settled[index] = (fetched, page_spans([fetched.tensors[key] for key in fetched.mapped]))
        else:
            self._settled.pop(index, None)
        self.accel.compute_waits(fetched.event)
        self.held[index] = fetched
        if fetched.params is None:
            fetched.params = unit.as_params(fetched.tensors)
        unit.load(self.store, self.device, None, fetched=fetched.tensors, params=fetched.params)
        self.stats.add_moved(len(fetched.tensors), fetched.moved)
        # every unit settled and nothing in flight (a warm mapped run, all kept): there is nothing to read ahead
        if self.reads_ahead and (self.pending or len(self._settled) < len(self.units)):
            # Fetches for units no longer expected are dropped (bounded memory).
            upcoming = self._window(index, predicted)
            for stale in [i for i in self.pending if i not in upcoming]:
                self._drop_pending(stale)
            self._schedule(upcoming)

    def _window(self, index: int, predicted: bool) -> list[int]:
        """The units to have in flight after ``index`` (along the trace once there is one, else in module
        order): the next ``depth``; on a mapped run with a kept set, kept units ride free (:meth:`Residency.window`)."""
        free_kept = self.residency is not None and not self.copy
        n = len(self.units) if free_kept else self.depth
        ahead = self.trace.upcoming(n) if predicted else list(range(index + 1, min(index + 1 + n, len(self.units))))
        return ahead[: self.residency.window([self.units[i].name for i in ahead], self.depth)] if free_kept else ahead

    def release(self, index: int) -> None:
        unit = self.units[index]
        unit.release()
        fetched = self.held.pop(index, None)
        if fetched is not None and fetched.buffers:
            self._drop(fetched, self.accel.record_on_compute())

    def close(self) -> None:
        """Let go of every read-ahead, end the reader thread (after the read it is doing) and release every
        loaded unit. The prefetcher stays usable: a later pass starts the reader again."""
        for index in list(self.pending):
            self._drop_pending(index)
        self._reader.stop()
        self._settled.clear()  # no view of the store's pages outlives its use
        for index in list(self.held):
            self.release(index)
        # Copies still queued on the side stream write into pool buffers (and read staging buffers) that are
        # about to be freed: wait for them, then let the pool go now rather than at garbage collection.
        self.accel.synchronize()
        with self._blocks_lock:
            self._blocks = None
        if self.staging is not None:
            self.staging.clear()
