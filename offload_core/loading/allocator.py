"""Keep host memory inside its budget: freed large blocks go back to the OS instead of staying in the process."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache

_M_MMAP_THRESHOLD = -3
_THRESHOLD = 128 * 1024


@lru_cache(maxsize=1)
def return_freed_memory_to_os() -> bool:
    """Fix glibc's mmap threshold at 128 KiB (its default start value).

    glibc raises the threshold each time a large mapped block is freed, so later blocks of that size
    come from the heap and stay in the process after ``free`` — a tensor converted while loading, or a
    matmul's packed weights, then counts against the budget for the rest of the run. With the threshold
    fixed, every block over 128 KiB is its own mapping and is returned on free. Set before planning allocates
    (``run.py``, the prepare step, ``from_pretrained``, the dispatch): a block that planning frees into the heap
    would serve later blocks from it and stay resident (a float32 run of the bfloat16 0.3b preset with
    ``storage=safetensors`` kept its last converted LM head beside the next: 0.51-0.74 GB from run to run on a
    0.60 GB budget, 0.51-0.52 GB set first). Process-wide; a no-op off glibc. Returns whether it was applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    except (OSError, AttributeError):
        return False
