"""Per-layer expert tensors on a CPU run: full shape over reserved address space, where a row takes memory only once
written and gives it back when released."""

from __future__ import annotations

import mmap
from typing import Any

import torch

from offload_core.alignment import ALIGNMENT
from offload_core.module_hooks.experts.loader import ExpertLayer, read_expert, read_whole
from offload_core.storage.base import Store
from offload_core.storage.mapping import map_anonymous, view


class ReservedRows:
    """A ``shape`` tensor (``shape[0]`` experts) over a private anonymous mapping that commits no memory up front.

    Writing an expert's row takes its pages (anonymous memory, counted in the process's RSS);
    :meth:`release` hands the pages of a row back to the system (``MADV_DONTNEED``), so a row that is
    read again is written into fresh zeroed pages. A layer's routed experts are read straight into
    their rows and the experts module runs on the tensor itself: rows that stay (the expert cache, a
    read-ahead guess) cost no copy at all. Rows never written read as zeros and are never read by
    the experts module, which only touches the rows it is routed to.
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, offset: int = 0) -> None:
        """``offset``: where the tensor starts modulo :data:`ALIGNMENT` (its reference offset,
        :mod:`offload_core.alignment`)."""
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.row_bytes = self.shape[1:].numel() * dtype.itemsize
        self.start = offset % ALIGNMENT  # the mapping starts on a page
        size = self.start + max(self.row_bytes * self.shape[0], 1)
        self.map = map_anonymous(size)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.map.madvise(mmap.MADV_HUGEPAGE)  # a row written after a release faults in 2 MiB at a time
        with torch.inference_mode(False):  # the experts' weights: normal tensors, as the in-memory model's
            self.tensor = view(self.map, dtype, self.shape, self.start)

    def release(self, expert: int) -> None:
        """Give back the memory of row ``expert`` (the whole pages inside it; a page shared with a
        neighbouring row stays)."""
        start = self.start + expert * self.row_bytes
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (start + self.row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, end - first)


class RowsLayer(ExpertLayer):
    """A fused experts module on a CPU run: its own :class:`ReservedRows` per expert tensor, in which the
    routed experts are read in place and the cached ones simply stay (a cache hit copies nothing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows = {
            key: ReservedRows(shape, dtype, self.store.offset(key) if isinstance(self.store, Store) else 0)
            for key, (shape, dtype) in self.specs.items()
        }
        self.present: set[int] = set()  # experts whose rows hold their weights
        self.routed: list[int] = []

    def read_row(self, expert: int) -> int:
        """Read expert ``expert`` from the store into its rows (the reader thread for a guess, else the compute
        thread)."""
        for key, rows in self.rows.items():
            read_expert(self.store, key, expert, rows.tensor[expert])
        self.counters.add_bytes(len(self.rows), self.row_bytes)
        return expert

    def advise(self, experts: list[int]) -> None:
        """Tell the store that ``experts`` are about to be read (a cold disk starts on all of them at once)."""
        for expert in experts:
            for key in self.rows:
                self.store.advise_expert(key, expert)

    def read_ahead(self, experts: list[int]) -> None:
        if not self.counters.guessing:
            self.shadow = set(experts)
            with self.counters.lock:
                self.counters.guessed += len(experts)
            return
        ahead = [e for e in experts if e not in self.guess and e not in self.present]
        self.advise(ahead)
        for expert in ahead:
            self.guess[expert] = self.reader.submit(self.read_row, expert)
        with self.counters.lock:
            self.counters.guessed += len(experts)

    def load(self, args: tuple, kwargs: dict) -> None:
        experts = self.selected(args, kwargs)
        self.score_guess(experts)
        self.cache.request(experts)
        missing = [e for e in experts if e not in self.present and e not in self.guess]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if missing and len(missing) >= self.whole_fraction * self.num_experts:
            self.drop_guesses([])
            for key, rows in self.rows.items():
                read_whole(self.store, key, rows.tensor)
            self.counters.add_bytes(len(self.rows), self.row_bytes * self.num_experts)
            self.counters.whole_reads += 1
            self.present = set(range(self.num_experts))
            self.start_next(hidden)
        else:
            self.advise(missing)
            # The reader thread reads all misses but the first while this thread reads that one; the
            # next layer's guesses are queued behind them and read while this layer computes.
            helped = {expert: self.reader.submit(self.read_row, expert) for expert in missing[1:]}
            self.start_next(hidden)
            for expert in experts:
                if expert in self.guess:
                    self.guess.pop(expert).result()
                    self.counters.predicted_hits += 1
                elif expert in helped:
                    helped.pop(expert).result()
                    self.counters.misses += 1
                elif expert in self.present:
                    self.counters.hits += 1
                else:
                    self.read_row(expert)
                    self.counters.misses += 1
                self.present.add(expert)
            self.drop_guesses(experts)
        self.routed = experts
        self.unit.load(
            self.store, self.buffers.device, None, fetched={key: rows.tensor for key, rows in self.rows.items()}
        )
        self.previous = experts

    def start_next(self, hidden: torch.Tensor) -> None:
        if self.next is not None:
            self.next.read_ahead(self.guess_next(hidden))

    def drop_guesses(self, experts: list[int]) -> None:
        """Guesses the routing did not select: cancelled if not started, else waited for; their rows go back."""
        for expert, future in list(self.guess.items()):
            if expert in experts:
                continue
            if not future.cancel():
                try:
                    future.result()
                except Exception:  # a guess that failed costs nothing but its bytes: the routing did not need it
                    pass
            self.release_row(expert)
            del self.guess[expert]

    def release_row(self, expert: int) -> None:
        for rows in self.rows.values():
            rows.release(expert)
        self.present.discard(expert)

    def release(self) -> None:
        """After ``forward``: the routed experts the cache keeps stay in their rows; the others' memory goes back."""
        self.unit.release()
        for expert in sorted(self.present):
            if expert not in self.present or expert in self.cache.resident:  # evicted just now, or kept
                continue
            if expert in self.routed and self.cache.wants(expert):
                evicted = self.cache.spare()
                if evicted is not None:
                    self.release_row(evicted)
                self.cache.admit(expert, expert)
                continue
            self.release_row(expert)
        self.routed = []
