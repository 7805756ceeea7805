"""The run's page-cache plan (kept and streamed offloaded bytes, predicted disk reads per token) and its honest
accounting: bytes this process read from disk while generating, and the bandwidth achieved."""

from __future__ import annotations

import time
from typing import Any

import psutil

from offload_core.errors import ConfigError
from offload_core.storage.residency import SAFETY_MARGIN, Residency, available_memory, page_cache_budget
from offload_core.values import format_size, is_offloaded, parse_size

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
        raise ConfigError(f"page_cache={value!r} is not auto, lru or a size: give e.g. page_cache=8GiB "
                          "(0 streams every offloaded block)") from None


def offloaded_bytes(summary: dict, execution_device: Any) -> int:
    """Bytes of the model the plan offloads (read from the store while generating)."""
    return sum(info["bytes"] for dev, info in summary["devices"].items() if is_offloaded(dev, execution_device))


def page_cache_plan(page_cache: Any, summary: dict, execution_device: Any, keeps: bool, anon_budget: int = 0,
                    largest_block: int = 0, available=available_memory) -> dict[str, Any]:
    """The plan's kept and streamed bytes and the bytes predicted to be read from disk per token.

    ``keeps``: the policy honours a kept set. Without one (``page_cache=lru`` or a policy that does not
    keep one) nothing is predicted: the kernel's page cache decides what stays. ``anon_budget``: memory
    the run will still take once loaded (its cpu budget), left out of an ``auto`` page cache. The margin
    kept free (at load and as each token starts) is :data:`SAFETY_MARGIN` plus the streamed blocks in
    memory at once (:data:`STREAMED_AT_ONCE` of ``largest_block``).
    """
    setting = page_cache_setting(page_cache)
    offloaded = offloaded_bytes(summary, execution_device)
    if setting == "lru" or not keeps or offloaded == 0:
        return {"page_cache": "lru", "offloaded_bytes": offloaded}
    margin = SAFETY_MARGIN + STREAMED_AT_ONCE * largest_block
    budget = page_cache_budget(setting, lambda: available() - anon_budget, margin)
    kept = min(budget, offloaded)
    return {"page_cache": "auto" if setting is None else setting, "page_cache_budget": budget, "page_cache_margin": margin,
            "offloaded_bytes": offloaded,
            "kept_bytes": kept, "streamed_bytes": offloaded - kept, "predicted_disk_bytes_per_token": offloaded - kept}


def page_cache_text(plan: dict[str, Any]) -> str:
    """The page-cache plan as printed with the rest of the plan."""
    if plan.get("page_cache") == "lru":
        return "page cache: no kept set (the kernel's cache decides what stays between tokens)"
    return (f"page cache: kept set {format_size(plan['kept_bytes'])} of {format_size(plan['offloaded_bytes'])} offloaded "
            f"(budget {format_size(plan['page_cache_budget'])}), streamed {format_size(plan['streamed_bytes'])}; "
            f"predicted disk reads per generated token: {format_size(plan['predicted_disk_bytes_per_token'])}")


def make_residency(plan: dict[str, Any], available=available_memory) -> Residency | None:
    """The kept/streamed split the policy applies (None where the plan keeps no set)."""
    if "page_cache_budget" not in plan:
        return None
    return Residency(plan["page_cache_budget"], available=available, margin=plan["page_cache_margin"])


def read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage (``/proc/self/io`` read_bytes); None where unknown."""
    try:
        return int(psutil.Process().io_counters().read_bytes)
    except (AttributeError, psutil.Error, OSError):
        return None


class DiskReads:
    """Measures the bytes read from disk while a model generates: sampled as each forward pass (one per
    generated token) starts, so the first token, which reads the kept set in, is reported apart from
    the steady state."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.marks: list[tuple[int, float]] = []

    def _mark(self, *_: Any) -> None:
        now = read_bytes()
        if now is not None:
            self.marks.append((now, time.perf_counter()))

    def __enter__(self) -> "DiskReads":
        self._hook = self.model.register_forward_pre_hook(self._mark)
        self._mark()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        self._mark()

    def figures(self) -> dict[str, Any]:
        """Disk bytes read by the first forward, per forward after it (the steady state; the first
        forward's when it is the only one), by each forward (the last one's bytes run to the end, read-ahead
        for a forward that never came included), and the read bandwidth achieved after the first."""
        forwards = len(self.marks) - 2  # marks: the start, one as each forward starts, the end
        if forwards < 1:  # read_bytes unknown here, or no forward ran
            return {}
        (start, _), (end, end_t) = self.marks[0], self.marks[-1]
        first, since, since_t = (self.marks[2][0] - start, *self.marks[2]) if forwards > 1 else (end - start, *self.marks[0])
        seconds = end_t - since_t
        each = [first] + [b - a for (a, _), (b, _) in zip(self.marks[2:-1], self.marks[3:])]
        return {"disk_read_bytes_first_token": first, "disk_read_bytes_per_token": (end - since) / max(forwards - 1, 1),
                "disk_read_bytes_by_token": each, "read_bandwidth_bytes_per_s": (end - since) / seconds if seconds > 0 else 0.0}
