"""What a GPU run of the benchmarks measures beside the systems: the pinned host-to-device bandwidth."""

from __future__ import annotations

import torch


def pinned_h2d_bandwidth(nbytes: int = 256 * 2**20, reps: int = 7) -> float:
    """Median bytes/s of copies from pinned host memory to the GPU (the bound offloaded weights can reach)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        samples.append(nbytes / (start.elapsed_time(end) / 1e3))
    del host, device
    torch.cuda.empty_cache()
    return sorted(samples)[len(samples) // 2]
