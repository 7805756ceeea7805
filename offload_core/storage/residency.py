"""The kept set and the streamed set: which offloaded blocks stay in the page cache across tokens, which are
streamed and dropped right after use, how the kept set shrinks when available memory falls, and the plan of
it a run prints (``page_cache``: kept and streamed bytes, predicted disk reads per token)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import psutil

from offload_core.errors import ConfigError
from offload_core.values import format_size, is_offloaded, parse_size

#: held back from the memory available at load (and at every token) before anything is kept
SAFETY_MARGIN = 1 << 30


def available_memory() -> int:
    """Bytes the kernel says can be had without swapping (``MemAvailable``; it counts clean page cache)."""
    return int(psutil.virtual_memory().available)


def page_cache_budget(
    page_cache: int | None, available: Callable[[], int] = available_memory, margin: int = SAFETY_MARGIN
) -> int:
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
    #: waits until the drops still under way are done (their bytes counted): set by whoever drops in the background
    settle: Callable[[], None] = field(default=lambda: None, repr=False)
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
        self.settle()
        return {
            "kept_blocks": len(self.kept),
            "kept_bytes": self.kept_bytes,
            "streamed_blocks": len(self.streamed),
            "streamed_bytes": self.streamed_bytes,
            "kept_served_bytes": self.kept_served,
            "dropped_bytes": self.dropped,
            "kept_shrinks": self.shrinks,
            "kept_shrunk_bytes": self.shrunk_bytes,
            "kept_grows": self.grows,
            "kept_grown_bytes": self.grown_bytes,
        }


#: streamed blocks whose pages are in memory at once: the one running, two read ahead, one being dropped
STREAMED_AT_ONCE = 4


def page_cache_setting(value: Any) -> int | None | str:
    """``page_cache`` as the run uses it: None (auto), a size in bytes, or ``"lru"`` (no kept set)."""
    text = str(value).strip().lower() if value is not None else "auto"
    if text in ("auto", "", "none"):
        return None
    if text == "lru":
        return "lru"
    try:
        return parse_size(value, what="page_cache")
    except ConfigError:
        raise ConfigError(
            f"page_cache={value!r} is not auto, lru or a size: give e.g. page_cache=8GiB "
            "(0 streams every offloaded block)"
        ) from None


def offloaded_in_plan(summary: dict, execution_device: Any) -> int:
    """Bytes of the model the plan offloads (read from the store while generating)."""
    return sum(info["bytes"] for dev, info in summary["devices"].items() if is_offloaded(dev, execution_device))


def page_cache_plan(
    page_cache: Any,
    summary: dict,
    execution_device: Any,
    keeps: bool,
    anon_budget: int = 0,
    largest_block: int = 0,
    available=available_memory,
    offloaded: int | None = None,
) -> dict[str, Any]:
    """The plan's kept and streamed bytes and the bytes predicted to be read from disk per token.

    ``keeps``: the policy honours a kept set. Without one (``page_cache=lru`` or a policy that does not
    keep one) nothing is predicted: the kernel's page cache decides what stays. ``anon_budget``: memory
    the run will still take once loaded (its cpu budget), left out of an ``auto`` page cache. The margin
    kept free (at load and as each token starts) is :data:`SAFETY_MARGIN` plus the streamed blocks in
    memory at once (:data:`STREAMED_AT_ONCE` of ``largest_block``). ``offloaded``: the bytes the store's files hold
    for the offloaded tensors, where they differ from the tensors' (a GGUF file's quantized blocks: what the page cache
    holds and the disk reads); the summary's by default.
    """
    setting = page_cache_setting(page_cache)
    offloaded = offloaded_in_plan(summary, execution_device) if offloaded is None else offloaded
    if setting == "lru" or not keeps or offloaded == 0:
        return {"page_cache": "lru", "offloaded_bytes": offloaded}
    margin = SAFETY_MARGIN + STREAMED_AT_ONCE * largest_block
    budget = page_cache_budget(setting, lambda: available() - anon_budget, margin)
    kept = min(budget, offloaded)
    return {
        "page_cache": "auto" if setting is None else setting,
        "page_cache_budget": budget,
        "page_cache_margin": margin,
        "offloaded_bytes": offloaded,
        "kept_bytes": kept,
        "streamed_bytes": offloaded - kept,
        "predicted_disk_bytes_per_token": offloaded - kept,
    }


def page_cache_text(plan: dict[str, Any], per: str = "generated token") -> str:
    """The page-cache plan as printed with the rest of the plan (``per``: what one forward makes)."""
    if plan.get("page_cache") == "lru":
        return "page cache: no kept set (the kernel's cache decides what stays between tokens)"
    return (
        f"page cache: kept set {format_size(plan['kept_bytes'])} of {format_size(plan['offloaded_bytes'])} offloaded "
        f"(budget {format_size(plan['page_cache_budget'])}), streamed {format_size(plan['streamed_bytes'])}; "
        f"predicted disk reads per {per}: {format_size(plan['predicted_disk_bytes_per_token'])}"
    )


def make_residency(plan: dict[str, Any], available=available_memory) -> Residency | None:
    """The kept/streamed split the policy applies (None where the plan keeps no set)."""
    if "page_cache_budget" not in plan:
        return None
    return Residency(plan["page_cache_budget"], available=available, margin=plan["page_cache_margin"])
