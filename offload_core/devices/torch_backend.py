"""The real accelerator, through torch: CUDA, and other accelerators through ``torch.accelerator`` where torch has
it."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import threading
import weakref
from typing import Any, ContextManager

import torch

from offload_core.devices.base import Accelerator

log = logging.getLogger(__name__)

#: cudaHostRegister pins whole pages
PAGE = 4096


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None) -> int:
    """The cuBLAS workspace torch allocates per stream: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs) where
    set, else torch's default, 32 MiB from Hopper (compute capability 9) on and ``:4096:2:16:8`` (8.125 MiB) before."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * int(count) * 1024 for size, count in pairs)
    return 4096 * 8 * 1024 if capability[0] >= 9 else 4096 * 2 * 1024 + 16 * 8 * 1024


def page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous memory on pages of their own, as a uint8 tensor whose storage starts at its first page:
    torch asks whether a tensor is pinned at its storage's start (its copies during a graph capture refuse one that
    is not), so a range registered with the driver must begin there."""
    pages = -(-nbytes // PAGE) * PAGE
    private = mmap.mmap(-1, pages, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # anonymous memory, as RSS counts it
    return torch.frombuffer(private, dtype=torch.uint8)[:nbytes]


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a runtime call of ours failed and was handled: left set, it would surface at the
    caller's next kernel launch check as that kernel's error (an "invalid argument" in an unrelated ``.to()``)."""
    clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if clear is not None:
        clear()


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class TorchAccelerator(Accelerator):
    """The accelerator torch reports (``cuda``, ``xpu``, ...); streams and events are torch's."""

    def __init__(self, device_type: str) -> None:
        self.type = device_type
        self.index_type = device_type
        self._module = getattr(torch, device_type, None)  # torch.cuda, torch.xpu: what torch.accelerator lacks
        self._generic = getattr(torch, "accelerator", None)
        self._arenas: dict[int, tuple[torch.Tensor, int, bool]] = {}  # data_ptr -> (arena, counted bytes, registered)
        self._pinned = 0
        self._lock = threading.Lock()

    def _call(self, name: str, *args: Any) -> Any:
        """``torch.accelerator.<name>`` where this torch has it, else ``torch.<type>.<name>``."""
        fn = getattr(self._generic, name, None) if self._generic is not None else None
        if fn is None:
            fn = getattr(self._module, name)
        return fn(*args)

    # -- devices ----------------------------------------------------------------------------------
    def count(self) -> int:
        return int(self._call("device_count"))

    def device_name(self, index: int) -> str | None:
        get = getattr(self._module, "get_device_name", None)
        return get(index) if get is not None else None

    # -- memory -----------------------------------------------------------------------------------
    def mem_get_info(self, index: int) -> tuple[int, int]:
        if self._module is not None and hasattr(self._module, "mem_get_info"):
            return tuple(self._module.mem_get_info(index))
        return tuple(self._call("get_memory_info", index))

    def memory_allocated(self, index: int) -> int:
        return int(self._call("memory_allocated", index))

    def max_memory_allocated(self, index: int) -> int:
        return int(self._call("max_memory_allocated", index))

    def reset_peak_memory_stats(self, index: int) -> None:
        self._call("reset_peak_memory_stats", index)

    def workspace_bytes(self, index: int) -> int:
        if self.type != "cuda":
            return 0
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        return cublas_workspace_bytes(torch.cuda.get_device_capability(index), config)

    # -- pinned host memory -----------------------------------------------------------------------
    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if nbytes:  # the caching host allocator rounds to a power of two; counted while the tensor lives
            held = _pow2(nbytes)
            with self._lock:
                self._pinned += held
            weakref.finalize(tensor.untyped_storage(), self._uncount, held)
        return tensor

    def _uncount(self, nbytes: int) -> None:
        with self._lock:
            self._pinned -= nbytes

    def pinned_arena(self, nbytes: int) -> torch.Tensor:
        """Anonymous pages of its own registered with the driver as they are (cudaHostRegister,
        :func:`page_aligned`): PyTorch's pinned allocator would round ``nbytes`` up to a power of two (up to twice
        the memory). Elsewhere, or if registering fails, torch's pinned allocator."""
        if self.type == "cuda" and nbytes:
            pages = -(-nbytes // PAGE) * PAGE
            arena = page_aligned(nbytes)
            try:
                error = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), pages, 0)
                if int(error) == 0:
                    self._count(arena, pages, registered=True)
                    return arena
                log.info(
                    "cudaHostRegister of %d bytes failed (error %s): using torch's pinned allocator", nbytes, int(error)
                )
                _clear_cuda_error()
            except (AttributeError, AssertionError, RuntimeError, TypeError) as error:
                log.info("cudaHostRegister unavailable (%s): using torch's pinned allocator", error)
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._count(tensor, _pow2(nbytes), registered=False)
        return tensor

    def _count(self, tensor: torch.Tensor, nbytes: int, registered: bool) -> None:
        if tensor.numel():
            with self._lock:
                self._arenas[tensor.data_ptr()] = (tensor, nbytes, registered)
                self._pinned += nbytes

    def free_arena(self, arena: torch.Tensor) -> None:
        with self._lock:
            held = self._arenas.pop(arena.data_ptr(), None) if arena.numel() else None
            if held is None:
                return
            self._pinned -= held[1]
        self.synchronize()  # no copy may still read it
        if held[2] and int(torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())) != 0:
            log.warning("cudaHostUnregister of a pinned arena failed: its pages stay registered while it lives")
            _clear_cuda_error()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    @property
    def pinned_bytes(self) -> int:
        return self._pinned

    # -- streams, events, synchronization ---------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        if device is None:
            for index in range(self.count()):
                self._call("synchronize", index)
        else:
            self._call("synchronize", device)

    def new_stream(self, device: torch.device) -> Any:
        if self.type == "cuda":
            return torch.cuda.Stream(device)
        return torch.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        if self.type == "cuda":  # a torch.cuda.Stream: what torch.cuda.Event.record and record_stream take
            return torch.cuda.current_stream(device)
        return self._call("current_stream", device)

    def on_stream(self, stream: Any) -> ContextManager:
        if stream is None:
            return contextlib.nullcontext()
        if self.type == "cuda":
            return torch.cuda.stream(stream)
        return stream  # torch.Stream is a context manager that makes itself current

    def record_event(self, stream: Any) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event() if self.type == "cuda" else torch.Event(device=stream.device)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def synchronize_event(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def synchronize_stream(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if stream is not None and self.owns(tensor.device):
            tensor.record_stream(stream)

    # -- graphs -----------------------------------------------------------------------------------
    def supports_graphs(self, device: torch.device) -> bool:
        return self.type == "cuda" and torch.device(device).type == "cuda"

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def graph_capture(self, graph: Any, device: torch.device):
        # torch.cuda.graph synchronizes first and captures on a stream of its own, allocating from the graph's pool
        with torch.cuda.device(device), torch.cuda.graph(graph):
            yield

    def replay(self, graph: Any) -> None:
        graph.replay()


def detect() -> str | None:
    """The accelerator type torch reports on this machine, or None."""
    generic = getattr(torch, "accelerator", None)
    if generic is not None and hasattr(generic, "is_available"):
        if generic.is_available():
            current = generic.current_accelerator()
            return current.type if current is not None else None
        return None
    return "cuda" if torch.cuda.is_available() else None
