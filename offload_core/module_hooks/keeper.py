"""The kept set applied to the units a policy streams from a mapped store, whichever the policy: kept units' pages
stay in the page cache across tokens, a streamed unit's pages are dropped once it has run (so streaming never evicts
the kept set), and the kept set is fitted to the memory available as each forward pass starts.

A streamed unit's pages are dropped on a thread of their own, off the compute thread: ``POSIX_FADV_DONTNEED`` waits for
every CPU to drain its page lists (milliseconds a call on a busy machine), which the next layer's compute need not
wait for. The drop holds the store's views (so their mappings live until it is done), and a unit fetched again
first waits for its own drop (its fresh pages are never dropped under it)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from offload_core.module_hooks.base import ForwardStartHook, add_hook_to_module
from offload_core.module_hooks.units import Unit, stored_nbytes
from offload_core.storage.base import Store
from offload_core.storage.residency import Residency


class PageCacheKeeper:
    """Watches ``units`` (it becomes their :attr:`Unit.observer`) and applies ``residency`` to them.

    A unit counts in the kept set for what its pages take in the page cache (:meth:`Unit.stored_nbytes`). ``warm``: read
    a unit's pages in with one read as it is fetched (:meth:`Store.warm`), rather than by a page fault per page while
    it computes; off where a reader thread has brought them in already.
    """

    def __init__(
        self,
        residency: Residency,
        store: Mapping[str, torch.Tensor],
        units: list[Unit],
        warm: bool,
    ) -> None:
        self.residency = residency
        self.store = store
        self.units = units
        self.warm = warm and isinstance(store, Store)
        self._bytes = {unit.name: unit.stored_nbytes(store) for unit in units}
        self._warmed: set[str] = set()  # kept units whose pages were read in and have not been dropped since
        self._dropping: dict[str, tuple[int, Future]] = {}  # streamed units whose pages are being dropped: (pid, drop)
        residency.settle = self.settle
        residency.assign([(unit.name, self._bytes[unit.name]) for unit in units])
        for unit in units:
            unit.observer = self

    def start_pass(self, busy: Iterable[str] = ()) -> None:
        """Fit the kept set to the memory available now (as a forward pass starts): units that left it
        have their pages dropped now, unless loaded or named in ``busy`` (being read ahead)."""
        moved = set(self.residency.check())
        busy = set(busy)
        for unit in self.units:
            if unit.name in moved and not unit.loaded and unit.name not in busy:
                self.drop(unit)  # memory is short: at once

    def fetching(self, unit: Unit) -> None:
        """``unit`` is about to be used: count a kept unit as served from the page cache, and read its pages in;
        a kept unit's once, until they are dropped (asking again walks every page of it each token: SmolLM2's
        decoding step took 0.054 s with it against 0.044 s without)."""
        _wait(self._dropping.pop(unit.name, None))
        kept = self.residency.is_kept(unit.name)
        if kept:
            self.residency.kept_served += self._bytes.get(unit.name, 0)
        if self.warm and unit.name not in self._warmed:
            for key in unit.keys:
                self.store.warm(key)
            if kept:
                self._warmed.add(unit.name)

    def used(self, unit: Unit) -> None:
        """``unit`` has run: a streamed unit's pages leave the page cache."""
        if not self.residency.is_kept(unit.name) and isinstance(self.store, Store):
            self._warmed.discard(unit.name)
            self._dropping[unit.name] = (os.getpid(), dropper().submit(self._drop_keys, unit.keys))

    def drop(self, unit: Unit) -> None:
        """Drop ``unit``'s pages now."""
        self._warmed.discard(unit.name)
        if isinstance(self.store, Store):
            self._drop_keys(unit.keys)

    def _drop_keys(self, keys: list[str]) -> None:
        dropped = self.store.drop_all(keys)
        with _COUNTING[0]:
            self.residency.dropped += sum(stored_nbytes(self.store, key) for key in dropped)

    def settle(self) -> None:
        """Wait for the drops under way (a drop that failed raises here)."""
        for name in list(self._dropping):
            _wait(self._dropping.pop(name, None))  # the reader thread may have taken it


#: the lock of the dropped-bytes counts; the thread that drops streamed units' pages, by process (a forked child has
#: none of its parent's threads: its drops get a thread of their own, and its parent's drops are not waited for)
_COUNTING = [threading.Lock()]
_DROPPERS: dict[int, ThreadPoolExecutor] = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _COUNTING.__setitem__(0, threading.Lock()))


def dropper() -> ThreadPoolExecutor:
    """This process's one thread that drops streamed units' pages, started at first use."""
    found = _DROPPERS.get(os.getpid())
    if found is None:  # two threads asking at once make two executors: the one kept is the only one ever started
        found = _DROPPERS.setdefault(os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="offload_core-drop"))
    return found


def _wait(dropping: tuple[int, Future] | None) -> None:
    """Wait for a drop this process started (one inherited through a fork never ends here)."""
    if dropping is not None and dropping[0] == os.getpid():
        dropping[1].result()


def keep_page_cache(
    model: nn.Module, store: Mapping[str, torch.Tensor] | None, residency: Residency | None, units: list[Unit]
) -> list[Any]:
    """For a policy that fetches units on call: apply ``residency`` (the plan's kept set, None for none) to
    ``units``, reading each unit's pages in as it is fetched; returns the module-hook handles to remove."""
    if residency is None or store is None or not units:
        return []
    keeper = PageCacheKeeper(residency, store, units, warm=True)
    # each forward pass starts by fitting the kept set to the memory available
    return [add_hook_to_module(model, ForwardStartHook("page_cache_keeper", keeper.start_pass))]
