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
    clean page cache) and moves blocks from the end of the kept set to the streamed set until it fits.
    """

    budget: int
    available: Callable[[], int] = available_memory
    margin: int = SAFETY_MARGIN
    kept: dict[str, int] = field(default_factory=dict)
    streamed: dict[str, int] = field(default_factory=dict)
    #: times the kept set shrank under memory pressure, and the bytes it gave up
    shrinks: int = 0
    shrunk_bytes: int = 0
    #: bytes of kept blocks handed to a forward (served from the page cache) and streamed blocks dropped
    kept_served: int = 0
    dropped: int = 0

    def assign(self, blocks: list[tuple[str, int]]) -> None:
        """Choose the kept set from ``blocks`` (name, bytes) in execution order: blocks are kept while they
        fit in the budget, the rest are streamed. Which blocks are kept does not matter for a scan that
        reads every block once per token; keeping a prefix lets the reader run ahead through it."""
        self.kept, self.streamed = {}, {}
        used = 0
        for name, size in blocks:
            if name in self.kept or name in self.streamed:
                continue
            if used + size <= self.budget:
                self.kept[name] = size
                used += size
            else:
                self.streamed[name] = size

    def is_kept(self, name: str) -> bool:
        return name in self.kept

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
        """Shrink the kept set to :meth:`limit` (called as a token starts); returns the blocks that moved
        to the streamed set (their pages are the caller's to drop)."""
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
        return moved

    def counters(self) -> dict[str, int]:
        """The kept and streamed sets' sizes now, what was served from the kept set, dropped after use,
        and given up under memory pressure."""
        return {"kept_blocks": len(self.kept), "kept_bytes": self.kept_bytes, "streamed_blocks": len(self.streamed),
                "streamed_bytes": self.streamed_bytes, "kept_served_bytes": self.kept_served,
                "dropped_bytes": self.dropped, "kept_shrinks": self.shrinks, "kept_shrunk_bytes": self.shrunk_bytes}
