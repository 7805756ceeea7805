"""What differs by device, asked in one place: the accelerator interface, and the machine without one.

Module hooks, loading, planning and the runner never call ``torch.cuda`` themselves: they ask the
active :class:`Accelerator` (:func:`offload_core.devices.active`) for its device count, free memory,
streams and events, asynchronous copies and pinned host memory. This base class is the machine with no
accelerator: every call is synchronous, nothing is pinned, there are no devices. The real accelerator
(:mod:`offload_core.devices.torch_backend`) and the test double (:mod:`offload_core.devices.fake`)
override what they do differently.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch


class Accelerator:
    """An accelerator (GPU) family as the rest of offload_core sees it; this class is the host without one.

    Streams and events are opaque objects of the implementation (None here: work is done when issued).
    """

    #: the torch device type of its devices ("cuda", "xpu", ...); "cpu" for the host without one
    type: str = "cpu"
    #: the device type a bare GPU index names when there is no accelerator (device maps say ``0``)
    index_type: str = "cuda"

    # -- devices ----------------------------------------------------------------------------------
    def count(self) -> int:
        """How many devices this machine has."""
        return 0

    def available(self) -> bool:
        return self.count() > 0

    def device(self, index: int) -> torch.device:
        """The torch device of GPU ``index``."""
        return torch.device(self.index_type if self.type == "cpu" else self.type, index)

    def owns(self, device: torch.device | str) -> bool:
        """Whether ``device`` is one of this accelerator's (never the cpu)."""
        return self.type != "cpu" and torch.device(device).type == self.type

    def default_device(self) -> torch.device:
        """Where a run computes unless told otherwise: device 0 where there is one, else the cpu."""
        return self.device(0) if self.available() else torch.device("cpu")

    def normalize(self, device: torch.device | str | int) -> torch.device:
        """``device`` as a torch device with an index on an accelerator (``cuda`` -> ``cuda:0``)."""
        if isinstance(device, int):
            return self.device(device)
        device = torch.device(device)
        if device.type not in ("cpu", "meta", "disk") and device.index is None:
            return torch.device(device.type, 0)
        return device

    def device_name(self, index: int) -> str | None:
        return None

    # -- memory -----------------------------------------------------------------------------------
    def mem_get_info(self, index: int) -> tuple[int, int]:
        """(free, total) bytes of device ``index``."""
        raise RuntimeError(f"no accelerator device {index} on this machine")

    def memory_allocated(self, index: int) -> int:
        return 0

    def max_memory_allocated(self, index: int) -> int:
        return 0

    def reset_peak_memory_stats(self, index: int) -> None:
        return None

    def workspace_bytes(self, index: int) -> int:
        """Device memory the math libraries take through the allocator once device ``index`` multiplies matrices
        (cuBLAS's workspace for the compute stream), kept for the process's life: a run holds it back beside what
        it plans."""
        return 0

    def empty(
        self, shape: tuple[int, ...] | torch.Size | int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new uninitialized tensor on ``device`` (any thread may call it)."""
        return torch.empty(shape, dtype=dtype, device=device)

    # -- pinned host memory -----------------------------------------------------------------------
    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory from the caching pinned allocator (small, reused buffers:
        it may round the request up); plain memory where nothing can be pinned."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def pinned_arena(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory in one piece, pinned as it is (no rounding beyond pages),
        for a store to sub-allocate; :meth:`free_arena` gives it back."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def free_arena(self, arena: torch.Tensor) -> None:
        """Unpin an arena from :meth:`pinned_arena` (copies from it must be done: this synchronizes)."""
        return None

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held now through this layer (with any rounding)."""
        return 0

    # -- streams, events, synchronization ---------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait until all work queued on ``device`` (every device when None) has finished."""
        return None

    def new_stream(self, device: torch.device) -> Any:
        return None

    def current_stream(self, device: torch.device) -> Any:
        return None

    def on_stream(self, stream: Any) -> ContextManager:
        """Work issued inside runs on ``stream`` (nothing changes for None)."""
        return contextlib.nullcontext()

    def record_event(self, stream: Any) -> Any:
        """An event after everything queued on ``stream`` so far (None on the host)."""
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on starts after ``event``."""
        return None

    def synchronize_event(self, event: Any) -> None:
        """The host waits until ``event`` has happened."""
        return None

    def synchronize_stream(self, stream: Any) -> None:
        return None

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is used on ``stream``: freeing it must wait for the work queued there now."""
        return None

    # -- graphs: a step's stream work captured once and replayed --------------------------------
    def supports_graphs(self, device: torch.device) -> bool:
        """Whether work on ``device`` can be captured into a graph and replayed (:meth:`graph_capture`)."""
        return False

    def new_graph(self) -> Any:
        raise RuntimeError(f"{self.type}: no graph capture on this machine")

    def graph_capture(self, graph: Any, device: torch.device) -> ContextManager:
        """Inside, the stream work issued on ``device`` (the current stream, and side streams that wait on its
        events) is recorded into ``graph`` instead of run; a host synchronization inside is an error."""
        raise RuntimeError(f"{self.type}: no graph capture on this machine")

    def replay(self, graph: Any) -> None:
        """Queue the captured work again on the current stream (same buffers, their contents as they are now)."""
        raise RuntimeError(f"{self.type}: no graph capture on this machine")


#: the machine without an accelerator
HOST = Accelerator()
