"""How fast this machine dequantizes each GGML type as :class:`~offload_core.storage.gguf.store.GGUFStore` does it:
float32 bytes written per second into a new tensor (a module hook without buffers of its own) and into a held buffer
(``hook=prefetch``'s), and the extra pass of a tensor transformers' processor converts (llama's q and k). What the time
prediction of ``storage=gguf`` reads (cached with the rest of the calibration)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np
import torch

from offload_core.storage.gguf.dequant import block_shape, dequantize_into, unpermute_into

#: elements of the tensor each rate is timed on (4 MiB of float32: a typical decoder matrix of a small model, past
#: the allocator's threshold, so a new tensor pays its page faults as a run's does)
ELEMENTS = 2**20
#: tensors of each type cycled through in turn (128 MiB of float32 in all: a run's tensors come from memory, not from
#: the CPU's caches a tensor timed alone would stay in; with 32 MiB, as large as this machine's last-level cache, the
#: rate came out 1.4-1.5x what the same kernels met on SmolLM2's offloaded tensors in a run)
COPIES = 32
#: rounds over them timed per rate (their median counts), after one untimed round
REPEATS = 5
#: the rates each GGML type's entry holds (bytes of float32 written per second)
RATE_KEYS = ("fresh_bps", "into_bps")
#: the entry of the processor's extra pass (a converted tensor is dequantized into a new tensor, then this)
CONVERT = "convert_bps"
#: byte offsets of each block's float16 scales (types whose random bytes would decode to scales of any size)
_SCALES = {10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}
_HALF_SCALES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,)}


def _median_seconds(call: Callable[[], object], repeats: int = REPEATS) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return max(statistics.median(times), 1e-9)


def random_blocks(kind: int, elements: int = ELEMENTS, seed: int = 0) -> torch.Tensor:
    """``elements`` values of GGML type ``kind`` as valid raw blocks (random bytes, their float16 scales small and
    finite; plain float types as small normal values)."""
    rng = np.random.default_rng(seed)
    per, nbytes = block_shape(kind)
    count = max(elements // per, 1)
    if kind in (0, 1, 30):  # F32, F16, BF16: the values themselves
        values = torch.from_numpy(rng.standard_normal(count * per).astype(np.float32))
        plain = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}[kind]
        return values.to(plain).view(torch.uint8).reshape(count, nbytes)
    raw = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    for offset in _SCALES.get(kind, _HALF_SCALES.get(kind, ())):
        raw[:, offset : offset + 2] = (
            (rng.standard_normal(count) * 2e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return torch.from_numpy(raw)


def type_rates(kind: int, elements: int = ELEMENTS) -> dict[str, float]:
    """Float32 bytes per second dequantizing :data:`COPIES` tensors of ``elements`` of GGML type ``kind`` in turn:
    each into a new tensor (``fresh_bps``) and each into a buffer held for it (``into_bps``)."""
    raws = [random_blocks(kind, elements, seed) for seed in range(COPIES)]
    count = raws[0].shape[0] * block_shape(kind)[0]
    outs = [torch.empty(count, dtype=torch.float32) for _ in raws]
    nbytes = 4 * count * len(raws)
    with torch.inference_mode(False):
        into = _median_seconds(lambda: [dequantize_into(raw, kind, out) for raw, out in zip(raws, outs)])
        fresh = _median_seconds(lambda: [dequantize_into(raw, kind, torch.empty(count)) for raw in raws])
    return {"fresh_bps": nbytes / fresh, "into_bps": nbytes / into}


def convert_rate(elements: int = ELEMENTS) -> float:
    """Float32 bytes per second of the pass a processor-converted tensor takes after its dequantization: llama's q/k
    un-permutation (:func:`~offload_core.storage.gguf.dequant.unpermute_into`) into the tensor the module computes
    on (:data:`COPIES` tensors in turn, as :func:`type_rates`)."""
    rows = 64
    pairs = [(torch.randn(elements), torch.empty((rows, elements // rows))) for _ in range(COPIES)]  # cycled through
    return 4 * elements * len(pairs) / _median_seconds(lambda: [unpermute_into(v, 8, out) for v, out in pairs])
