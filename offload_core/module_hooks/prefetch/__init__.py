"""prefetch: while block i computes, the next k offloaded blocks are brought in on a reader thread (CPU and GPU).

The first forward records the order in which units run (meanwhile the next units in module order
are read ahead); afterwards each call predicts the next k units and hands them to a background
reader. A unit that runs out of the predicted order invalidates the trace (it is recorded again),
every fetch in flight is dropped, and the unit is loaded synchronously: data always comes from the
store by name, so a mispredicted or late prefetch can cost time, never correctness.

How a unit's bytes arrive depends on where it runs and what the store hands out:

- CPU run, mapped store (memmap, safetensors in place): the reader pulls the next blocks' pages into
  the page cache; the unit then maps them. No copy and no anonymous memory. The page cache may
  evict read-ahead before it is used (memory pressure between two tokens): each forward pass starts
  by handing the reader again what was evicted, and a unit whose pages went missing after that is
  read in at once (one sequential read) rather than page-faulted in while it computes.
- Everything else (a GPU run; a CPU run whose store converts on read, or with ``pool=true``): the
  unit's tensors are copied into one buffer of a :class:`BlockPool` — ``depth + 1`` reusable buffers
  on the execution device (one more per level of units nested in units), each the size of the largest
  unit, allocated once. On a GPU, pageable bytes (a mapped store) travel
  through a :class:`StagingRing` of pinned host buffers on a side stream: the reader thread copies the
  next chunk from the mapped file into a pinned buffer (disk → pinned, page faults read the disk) while
  the previous chunk's copy to the device runs (pinned → device) and the compute stream runs the
  current block. The compute stream waits on an event recorded after a unit's last copy; a buffer is
  rewritten only after an event recorded when the compute stream let go of it. No blocking ``.to()``,
  no ``empty_cache``.
- Tied weights: a store key already on the device (another unit holds it, or brought it in) is
  borrowed, not copied again; its buffer is reference-counted and reused only when no unit holds it.
"""

from offload_core.module_hooks.prefetch.policy import Prefetch, PrefetchConfig, PrefetchHandle
from offload_core.module_hooks.prefetch.pool import BlockPool
from offload_core.module_hooks.prefetch.prefetcher import Prefetcher
from offload_core.module_hooks.prefetch.trace import Trace
from offload_core.module_hooks.prefetch.transfer import StagingRing, Streams

__all__ = ["BlockPool", "Prefetch", "PrefetchConfig", "PrefetchHandle", "Prefetcher", "StagingRing", "Streams", "Trace"]
