"""The kept set and the streamed set: which offloaded blocks stay in the page cache across tokens, which are
streamed and dropped right after use, and how the kept set shrinks when available memory falls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import psutil

#: held back from the memory available at load (and at every token) before anything is kept
SAFETY_MARGIN = 1 << 30


def available_memory() -> int:
    """Bytes the kernel says can be had without swapping (``MemAvailable``; it counts clean page cache)."""
    return int(psutil.virtual_memory().available)


def page_cache_budget(page_cache: int | None, available: Callable[[], int] = available_memory,
                      margin: int = SAFETY_MARGIN) -> int:
    """Bytes of offloaded blocks that may stay cached: ``page_cache`` when given, else the memory
    available now less ``margin``."""
    if page_cache is not None:
        return max(int(page_cache), 0)
    return max(available() - margin, 0)


@dataclass
class Residency:
    """Splits offloaded blocks into a kept set (cached across tokens) and a streamed set (dropped after use).

    ``budget``: bytes the kept set may hold (:func:`page_cache_budget`). ``available`` is a seam: the
    memory available now (tests give a function that fakes it). At every token :meth:`check` compares
    the kept set with ``min(budget, available() - margin)`` (our kept pages count as available, being
    clean page cache) and moves blocks from the end of the kept set to the streamed set until it fits, or
    back again when there is room.
    """

    budget: int
    available: Callable[[], int] = available_memory
    margin: int = SAFETY_MARGIN
    kept: dict[str, int] = field(default_factory=dict)
    streamed: dict[str, int] = field(default_factory=dict)
    #: times the kept set shrank under memory pressure, and the bytes it gave up
    shrinks: int = 0
    shrunk_bytes: int = 0
    #: times blocks came back to the kept set once memory was available again, and their bytes
    grows: int = 0
    grown_bytes: int = 0
    #: bytes of kept blocks handed to a forward (served from the page cache) and streamed blocks dropped
    kept_served: int = 0
    dropped: int = 0
    #: blocks that left the kept set under memory pressure, in the order they left
    _left: list[str] = field(default_factory=list, init=False, repr=False)

    def assign(self, blocks: list[tuple[str, int]]) -> None:
        """Choose the kept set from ``blocks`` (name, bytes) in execution order, up to the budget; the rest
        are streamed. The kept blocks are spread evenly through the order (the kept share of the bytes
        seen so far follows ``budget / total``) rather than taken as a prefix: while a kept block
        computes, the reader has a streamed block to read, so the disk is not left idle through a run of
        kept blocks."""
        sizes: dict[str, int] = {}
        for name, size in blocks:
            sizes.setdefault(name, size)
        total = sum(sizes.values())
        share = min(self.budget / total, 1.0) if total else 1.0
        kept: set[str] = set()
        used = credit = 0.0
        for name, size in sizes.items():
            credit += size * share
            if size <= credit + 1e-9 * total and used + size <= self.budget:
                kept.add(name)
                used += size
                credit -= size
        for name, size in sizes.items():  # what rounding left of the budget
            if name not in kept and used + size <= self.budget:
                kept.add(name)
                used += size
        self._left = []
        self.kept = {name: size for name, size in sizes.items() if name in kept}
        self.streamed = {name: size for name, size in sizes.items() if name not in kept}

    def is_kept(self, name: str) -> bool:
        return name in self.kept

    def window(self, ahead: list[str], depth: int) -> int:
        """How many of the blocks ``ahead`` (in the order they run) to read ahead: up to and including the
        ``depth``-th streamed one. Kept blocks on a mapped run cost no read and no memory (their pages stay
        cached), so counting only streamed ones lets the reader read the next streamed blocks while kept
        ones compute, instead of leaving the disk idle until the window reaches them."""
        streamed = 0
        for count, name in enumerate(ahead):
            if streamed == depth:
                return count
            streamed += name not in self.kept
        return len(ahead)

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())

    @property
    def streamed_bytes(self) -> int:
        return sum(self.streamed.values())

    def limit(self) -> int:
        """What the kept set may hold now: the budget, or less where available memory has fallen."""
        return max(min(self.budget, self.available() - self.margin), 0)

    def check(self) -> list[str]:
        """Fit the kept set to :meth:`limit` (called as a token starts); returns the blocks that moved to
        the streamed set (their pages are the caller's to drop).

        Blocks leave from the end of the kept set while it is over the limit. When the limit has room
        again (the other process let go of its memory), blocks that left come back, most recent first,
        while they fit: their pages stay cached after their next use instead of being dropped.
        """
        limit, moved = self.limit(), []
        kept = self.kept_bytes
        while self.kept and kept > limit:
            name, size = self.kept.popitem()
            self.streamed = {name: size, **self.streamed}
            kept -= size
            moved.append(name)
        if moved:
            self.shrinks += 1
            self.shrunk_bytes += sum(self.streamed[name] for name in moved)
            self._left.extend(moved)
            return moved
        back = []
        while self._left and kept + self.streamed[self._left[-1]] <= limit:
            name = self._left.pop()
            size = self.kept[name] = self.streamed.pop(name)
            kept += size
            back.append(name)
        if back:
            self.grows += 1
            self.grown_bytes += sum(self.kept[name] for name in back)
        return moved

    def counters(self) -> dict[str, int]:
        """The kept and streamed sets' sizes now, what was served from the kept set, dropped after use,
        given up under memory pressure and taken back once memory was available again."""
        return {"kept_blocks": len(self.kept), "kept_bytes": self.kept_bytes, "streamed_blocks": len(self.streamed),
                "streamed_bytes": self.streamed_bytes, "kept_served_bytes": self.kept_served,
                "dropped_bytes": self.dropped, "kept_shrinks": self.shrinks, "kept_shrunk_bytes": self.shrunk_bytes,
                "kept_grows": self.grows, "kept_grown_bytes": self.grown_bytes}
