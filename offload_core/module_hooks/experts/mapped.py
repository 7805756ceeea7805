"""Fused experts computed where their bytes lie: on a CPU run with a store that hands the expert tensors out as mapped
views (an offload folder; safetensors shards, per-expert tensors spliced into the fused layout once per load), the
experts module runs on those views. A routed expert costs no copy and no anonymous memory: its rows are read in
(those not in the page cache) with their file ranges merged and asked for at once, in file order, then mapped."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from offload_core.module_hooks.experts.loader import ExpertLayer
from offload_core.storage.base import as_store
from offload_core.storage.pagecache import read_in, resident

DONE: Future = Future()  # a guess whose rows were in memory already
DONE.set_result(None)


def mapped_views(store: Any, keys: list[str]) -> dict[str, torch.Tensor] | None:
    """``{key: view}`` where the store hands every key out as a mapped view to compute on in place; else None."""
    store = as_store(store)
    views = {key: store.mapped_view(key) for key in keys}
    return views if all(v is not None and v.device.type == "cpu" for v in views.values()) else None


class MappedLayer(ExpertLayer):
    """A fused experts module on a CPU run that computes on the store's mapped views.

    The expert cache keeps its meaning (which experts count as held, so a hit does no read); holding costs
    page cache, not the budget. A miss is read in on this thread; a guess for the next layer on the reader
    thread, while this layer computes.
    """

    def __init__(self, *args: Any, views: dict[str, torch.Tensor], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.views = views
        self.sizes = {key: view[0].numel() * view.element_size() for key, view in views.items()}

    def ranges_of(self, key: str, expert: int) -> list[tuple[Path, int, int]]:
        """The file byte ranges of ``expert``'s row of tensor ``key``."""
        size = self.sizes[key]
        return self.store.file_ranges(key, expert * size, (expert + 1) * size)

    def read_in(self, experts: list[int]) -> list[int]:
        """Read ``experts``' rows in: every range asked for at once (neighbours merged, in file order), then
        each row waited for and mapped, in file order too."""
        rows = [(view[expert], key, expert) for expert in sorted(experts) for key, view in self.views.items()]
        read_in([row for row, _, _ in rows], [self.ranges_of(key, expert) for _, key, expert in rows])
        self.counters.add_bytes(len(self.views) * len(experts), self.row_bytes * len(experts))
        return experts

    def read_ahead(self, experts: list[int]) -> None:
        with self.counters.lock:
            self.counters.guessed += len(experts)
        if not self.counters.guessing:  # guesses do not pay now: scored, not read
            self.shadow = set(experts)
            return
        ahead = [e for e in experts if e not in self.guess and self.cache.get(e) is None]
        # Rows already in memory need no reader (waking a thread beside the compute's costs more than a mincore).
        cold = [e for e in ahead if not self.in_memory(e)]
        self.guess.update({expert: DONE for expert in ahead})
        if cold:
            future = self.reader.submit(self.read_in, cold)
            self.guess.update({expert: future for expert in cold})

    def in_memory(self, expert: int) -> bool:
        """Whether every page of ``expert``'s rows is in the page cache (one ``mincore`` per tensor)."""
        return all(resident(view[expert]) for view in self.views.values())

    def load(self, args: tuple, kwargs: dict) -> None:
        experts = self.selected(args, kwargs)
        self.score_guess(experts)
        self.cache.request(experts)
        # A held expert costs page cache, which the kernel (or a cold benchmark) may have taken back: one whose pages
        # are gone is read in as a miss is (all at once, in file order), not faulted in while it computes (a fault
        # reads a read-ahead window around it: 8 MiB on this disk, most of it neighbouring experts no token chose).
        missing = [e for e in experts if e not in self.guess and (self.cache.get(e) is None or not self.in_memory(e))]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        whole = bool(missing) and len(missing) >= self.whole_fraction * self.num_experts
        if whole:  # most experts (a long prompt): every row, one pass over the tensors
            self.drop_guesses([])
            self.read_in(list(range(self.num_experts)))
            self.counters.whole_reads += 1
        elif missing:
            self.read_in(missing)
        if self.next is not None:
            self.next.read_ahead(self.guess_next(hidden))
        for expert in experts:
            if expert in self.guess:
                self.guess.pop(expert).result()
                self.counters.predicted_hits += 1
            elif whole:
                pass
            elif expert in missing:
                self.counters.misses += 1
            else:
                self.counters.hits += 1
            if self.cache.get(expert) is None and self.cache.wants(expert):
                self.cache.spare()
                self.cache.admit(expert, {})
        self.drop_guesses(experts)
        self.unit.load(self.store, self.buffers.device, None, fetched=dict(self.views))
        self.previous = experts

    def drop_guesses(self, experts: list[int] | None = None) -> None:
        """Guesses the routing did not select: cancelled if not started (their pages stay in the page cache)."""
        for expert in [e for e in self.guess if not experts or e not in experts]:
            self.guess.pop(expert).cancel()
