"""The run's honest accounting of its page-cache plan (:func:`offload_core.storage.residency.page_cache_plan`): bytes
this process read from disk while generating, and the bandwidth achieved."""

from __future__ import annotations

import time
from typing import Any

import psutil


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
        first, since, since_t = (
            (self.marks[2][0] - start, *self.marks[2]) if forwards > 1 else (end - start, *self.marks[0])
        )
        seconds = end_t - since_t
        each = [first] + [b - a for (a, _), (b, _) in zip(self.marks[2:-1], self.marks[3:])]
        return {
            "disk_read_bytes_first_token": first,
            "disk_read_bytes_per_token": (end - since) / max(forwards - 1, 1),
            "disk_read_bytes_by_token": each,
            "read_bandwidth_bytes_per_s": (end - since) / seconds if seconds > 0 else 0.0,
        }
