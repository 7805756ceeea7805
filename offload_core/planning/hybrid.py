"""The hybrid split: which offloaded blocks a batch-1 decoding step computes on the host, from their host-resident
weights, while the others stream to the GPU, solved from measured rates so that the two sides take about as long."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: tokens in one step (rows x new positions) up to which a unit is computed on the host: a decoding step of one
#: sequence. A prefill or a batch computes on the GPU, where the host loses by far
HOST_MAX_TOKENS = 1


@dataclass(frozen=True)
class Rates:
    """Measured rates of one machine, in weight bytes per second: ``h2d_bps`` copying pinned host memory to the GPU,
    ``host_bps`` computing a batch-1 decoding step on the host, ``gpu_bps`` computing it on the GPU (inf: free);
    ``resident_s``: seconds per step of the part resident on the GPU."""

    h2d_bps: float
    host_bps: float
    gpu_bps: float = math.inf
    resident_s: float = 0.0


@dataclass
class Split:
    """Per offloaded unit (by index) where a decoding step computes it, and the per-step times the rates predict:
    ``copy_s`` the streamed units' transfers, ``host_s`` the host units' compute, ``gpu_s`` the GPU's compute (resident
    part and streamed units), ``step_s`` the bound max(copy, host + gpu) and ``copy_only_s`` the bound streaming all."""

    host: list[int] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)
    copy_s: float = 0.0
    host_s: float = 0.0
    gpu_s: float = 0.0
    step_s: float = 0.0
    copy_only_s: float = 0.0

    @property
    def ratio(self) -> float:
        """The bound with the split over the copy-only bound (1.0 when there is nothing to split)."""
        return self.step_s / self.copy_only_s if self.copy_only_s > 0 else 1.0


def _times(sizes: list[int], host: set[int], rates: Rates) -> tuple[float, float, float, float]:
    streamed = sum(b for i, b in enumerate(sizes) if i not in host)
    on_host = sum(b for i, b in enumerate(sizes) if i in host)
    copy_s = streamed / rates.h2d_bps
    host_s = on_host / rates.host_bps
    gpu_s = rates.resident_s + streamed / rates.gpu_bps
    return copy_s, host_s, gpu_s, max(copy_s, host_s + gpu_s)


def spread(count: int, eligible: list[int]) -> list[int]:
    """``count`` of ``eligible`` (in execution order) spread evenly along it, so that streamed units lie between the
    host ones and their copies run while the host computes."""
    n = len(eligible)
    return [eligible[int((j + 0.5) * n / count)] for j in range(count)] if count else []


def solve_split(sizes: list[int], eligible: list[int], rates: Rates) -> Split:
    """The split of units of ``sizes`` bytes (in execution order; only ``eligible`` indices may go to the host) that
    minimises a step's bound max(copy time of the streamed, host time of the host units + GPU compute): units move to
    the host one at a time while the bound falls (it is convex in their number), spread along the order."""
    if rates.h2d_bps <= 0 or rates.host_bps <= 0:
        raise ValueError("rates must be positive")
    pool = sorted(eligible, key=lambda i: (-sizes[i], i))
    best = _times(sizes, set(), rates)[3]
    count = 0
    for k in range(1, len(pool) + 1):
        bound = _times(sizes, set(pool[:k]), rates)[3]
        if bound >= best:
            break
        best, count = bound, k
    host = spread(count, sorted(eligible))
    copy_s, host_s, gpu_s, step_s = _times(sizes, set(host), rates)
    copy_only = _times(sizes, set(), rates)[3]
    streamed = [i for i in range(len(sizes)) if i not in set(host)]
    return Split(host, streamed, copy_s, host_s, gpu_s, step_s, copy_only)
