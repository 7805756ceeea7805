"""The device layer: everything that differs between a CPU run and an accelerator run (device counts and memory,
streams, events, asynchronous copies, pinned host memory, synchronization) behind one interface.

``active()`` is the accelerator in use: torch's (CUDA, or another ``torch.accelerator``) where the machine
has one, else :data:`HOST` (no accelerator: every call synchronous). ``OFFLOAD_CORE_ACCELERATOR=cpu``
hides the machine's accelerator; tests install a fake one with :func:`use`
(:class:`offload_core.devices.fake.FakeAccelerator`).
"""

from offload_core.devices.arena import PinnedArena
from offload_core.devices.base import HOST, Accelerator
from offload_core.devices.select import (
    ENV,
    active,
    default_execution_device,
    for_device,
    gpu,
    gpu_count,
    is_accelerator,
    use,
)

__all__ = [
    "ENV",
    "HOST",
    "Accelerator",
    "PinnedArena",
    "active",
    "default_execution_device",
    "for_device",
    "gpu",
    "gpu_count",
    "is_accelerator",
    "use",
]
