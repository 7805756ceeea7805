"""Memory and time readings for a run: peak anonymous and file-backed RSS (sampled with psutil), GPU peaks, token
timings."""

from __future__ import annotations

import threading
import time

import psutil
import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria

from offload_core import devices


def rss_split() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process; psutil's ``shared`` is the file-backed part."""
    info = psutil.Process().memory_info()
    shared = getattr(info, "shared", 0)
    return info.rss - shared, shared


class MemoryMonitor:
    """Samples this process's RSS on a thread; peaks are reported relative to the baseline at start."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.baseline_anon, self.baseline_file = rss_split()
        self.peak_anon, self.peak_file = self.baseline_anon, self.baseline_file
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="offload-memory-monitor", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        anon, file = rss_split()
        self.peak_anon = max(self.peak_anon, anon)
        self.peak_file = max(self.peak_file, file)

    def __enter__(self) -> "MemoryMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def anon_delta(self) -> int:
        return self.peak_anon - self.baseline_anon

    @property
    def file_delta(self) -> int:
        return self.peak_file - self.baseline_file


class TokenTimer(StoppingCriteria):
    """A stopping criterion that never stops: it stamps the time each step ends and the sequence's length then (a
    speculative step adds several tokens)."""

    def __init__(self, total: int | None = None, progress: bool = False) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self.lengths: list[int] = []
        self.last: torch.Tensor | None = None  # the sequences as last stamped: what an interrupted run keeps
        self.bar = tqdm(total=total, desc="generating", unit="token", leave=False) if progress else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        # on an accelerator the token is computed, not only queued, when it is stamped
        devices.for_device(input_ids.device).synchronize(input_ids.device)
        self.stamps.append(time.perf_counter())
        self.lengths.append(int(input_ids.shape[-1]))
        self.last = input_ids
        if self.bar is not None:
            self.bar.update(self.lengths[-1] - self.lengths[-2] if len(self.lengths) > 1 else 1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def rows_after(self, start: int) -> list[list[int]]:
        """Each row's tokens after position ``start`` of the sequences as last stamped (none before the first)."""
        return [] if self.last is None else self.last[:, start:].tolist()

    @property
    def time_to_first_token(self) -> float:
        return self.stamps[0] - self.start if self.stamps else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        if len(self.stamps) < 2:
            return float("nan")
        return (self.lengths[-1] - self.lengths[0]) / (self.stamps[-1] - self.stamps[0])
