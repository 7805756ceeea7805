"""A fake accelerator for tests, backed by CPU memory, that behaves like a GPU where offloading can go wrong.

Devices ``fakegpu:0..count-1`` with the memory the test gives (``mem_get_info`` and out-of-memory errors
follow what is allocated on them); streams and events whose copies from pinned memory run late
(:mod:`~offload_core.devices.fake.timeline`), with every unordered use of a buffer recorded as a hazard;
pinned host memory counted as PyTorch holds it (its caching allocator rounds each request up to a power
of two; an arena is pinned by the page). Install it with ``offload_core.devices.use(FakeAccelerator(...))``
(the test suite's ``fake_gpu`` fixture does, and fails the test on any hazard).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, ContextManager

import torch

from offload_core.devices.base import Accelerator
from offload_core.devices.fake import graph as fake_graph
from offload_core.devices.fake import tensor as fake_tensor
from offload_core.devices.fake.graph import FakeGraph
from offload_core.devices.fake.tensor import BACKEND, FakeTensor, register_backend
from offload_core.devices.fake.timeline import Block, FakeEvent, FakeStream, HazardError, Timeline

PAGE = 4096
#: the CUDA caching allocator hands out multiples of this
DEVICE_ROUND = 512


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class FakeAccelerator(Accelerator):
    """``count`` fake GPUs of ``memory`` bytes each."""

    type = BACKEND
    index_type = BACKEND

    def __init__(self, count: int = 1, memory: int = 2**30, name: str = "Fake GPU", workspace: int = 0) -> None:
        """``workspace``: bytes a device takes at its first matrix product and keeps, as cuBLAS's workspace does."""
        register_backend()
        self._count = int(count)
        self.memory = int(memory)
        self.name = name
        self.workspace = int(workspace)
        self._workspaces: set[int] = set()  # the devices that took theirs
        self.timeline = Timeline()
        self.allocated = [0] * self._count
        self.peak = [0] * self._count
        self._pinned: dict[int, tuple[int, int]] = {}  # data_ptr -> (nbytes asked, bytes held)
        self._pinned_cached = 0  # bytes of freed pinned_empty blocks the caching allocator keeps
        self._lock = threading.Lock()
        self.pinned_requests: list[tuple[int, int]] = []  # (asked, held) for each pinned allocation

    # -- installation -----------------------------------------------------------------------------
    def install(self) -> None:
        fake_tensor.set_runtime(self)

    def uninstall(self) -> None:
        if fake_tensor._runtime is self:
            fake_tensor.set_runtime(None)

    @property
    def hazards(self) -> list[str]:
        return self.timeline.hazards

    # -- devices ----------------------------------------------------------------------------------
    def count(self) -> int:
        return self._count

    def device_name(self, index: int) -> str | None:
        return f"{self.name} {index}"

    def _check_index(self, index: int) -> int:
        index = 0 if index is None else int(index)
        if not 0 <= index < self._count:
            raise RuntimeError(f"fake accelerator: device {index} does not exist ({self._count} device(s))")
        return index

    # -- device memory ----------------------------------------------------------------------------
    def adopt(self, wrapper: FakeTensor, elem: torch.Tensor, device: torch.device) -> None:
        """A new fake tensor: its storage is a new allocation on ``device`` unless another tensor has it."""
        index = self._check_index(device.index)
        storage = elem.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return
        timeline = self.timeline
        with timeline.lock:
            block = timeline.blocks.get(ptr)
            if block is None:
                held = -(-nbytes // DEVICE_ROUND) * DEVICE_ROUND
                if self.allocated[index] + held > self.memory:
                    raise torch.OutOfMemoryError(
                        f"fake accelerator: out of memory on {device} allocating {held} bytes "
                        f"({self.allocated[index]} of {self.memory} in use)"
                    )
                block = timeline.blocks[ptr] = Block(device, held, timeline.current(device), storage=storage)
                self.allocated[index] += held
                self.peak[index] = max(self.peak[index], self.allocated[index])
            block.wrappers += 1
        wrapper.__dict__["_fake_block"] = (self, ptr, index)

    def drop_wrapper(self, ptr: int, index: int) -> None:
        """A fake tensor died (FakeTensor.__del__): the last one of a block frees it."""
        timeline = self.timeline
        with timeline.lock:
            block = timeline.blocks.get(ptr)
            if block is None:
                return
            block.wrappers -= 1
            if block.wrappers > 0:
                return
            timeline.freed(ptr)
            self.allocated[index] -= block.nbytes

    def take_workspace(self, device: torch.device) -> None:
        """A matrix product on ``device``: its first takes the workspace (out of memory where it does not fit)."""
        index = self._check_index(device.index)
        with self.timeline.lock:
            if not self.workspace or index in self._workspaces:
                return
            if self.allocated[index] + self.workspace > self.memory:
                raise torch.OutOfMemoryError(f"fake accelerator: out of memory on {device} for the workspace")
            self._workspaces.add(index)
            self.allocated[index] += self.workspace
            self.peak[index] = max(self.peak[index], self.allocated[index])

    def workspace_bytes(self, index: int) -> int:
        return self.workspace

    def mem_get_info(self, index: int) -> tuple[int, int]:
        index = self._check_index(index)
        return self.memory - self.allocated[index], self.memory

    def memory_allocated(self, index: int) -> int:
        return self.allocated[self._check_index(index)]

    def max_memory_allocated(self, index: int) -> int:
        return self.peak[self._check_index(index)]

    def reset_peak_memory_stats(self, index: int) -> None:
        index = self._check_index(index)
        self.peak[index] = self.allocated[index]

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    # -- pinned host memory -----------------------------------------------------------------------
    def _pin(self, nbytes: int, held: int) -> torch.Tensor:
        if self.timeline.capture is not None:
            raise self.timeline.capture.fail(self.timeline, "pinned host memory allocated during a capture")
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            with self._lock:
                self._pinned[tensor.data_ptr()] = (nbytes, held)
                self.pinned_requests.append((nbytes, held))
        return tensor

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        tensor = self._pin(nbytes, _pow2(nbytes))
        if nbytes:
            weakref.finalize(tensor.untyped_storage(), self._unpin_cached, tensor.data_ptr())
        return tensor

    def _unpin_cached(self, ptr: int) -> None:
        with self._lock:
            held = self._pinned.pop(ptr, None)
            if held is not None:
                self._pinned_cached += held[1]  # PyTorch's host allocator keeps the block

    def pinned_arena(self, nbytes: int) -> torch.Tensor:
        return self._pin(nbytes, -(-nbytes // PAGE) * PAGE)

    def free_arena(self, arena: torch.Tensor) -> None:
        if not arena.numel():
            return
        self.synchronize()
        with self._lock:
            self._pinned.pop(arena.data_ptr(), None)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, FakeTensor) or tensor.device.type != "cpu" or not tensor.numel():
            return False
        start = tensor.untyped_storage().data_ptr()  # as torch asks: where the tensor's storage starts
        with self._lock:
            return start in self._pinned or any(base <= start < base + n for base, (n, _) in self._pinned.items())

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(held for _, held in self._pinned.values()) + self._pinned_cached

    # -- streams, events, synchronization ---------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        timeline = self.timeline
        with timeline.lock:
            streams = [
                s
                for s in [*timeline.defaults.values(), *timeline.side_streams]
                if device is None or s.device == torch.device(device)
            ]
            for stream in streams:
                timeline.synchronize_stream(stream)

    def new_stream(self, device: torch.device) -> FakeStream:
        device = torch.device(device)
        self._check_index(device.index)
        stream = FakeStream(torch.device(BACKEND, device.index or 0), "side")
        with self.timeline.lock:
            self.timeline.side_streams.add(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.timeline.current(torch.device(BACKEND, torch.device(device).index or 0))

    def on_stream(self, stream: Any) -> ContextManager:
        if stream is None:
            return contextlib.nullcontext()
        return _StreamContext(self.timeline, stream)

    def record_event(self, stream: Any) -> FakeEvent | None:
        return None if stream is None else self.timeline.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            self.timeline.wait(stream, event)

    def synchronize_event(self, event: Any) -> None:
        if event is not None:
            self.timeline.synchronize_event(event)

    def synchronize_stream(self, stream: Any) -> None:
        if stream is not None:
            self.timeline.synchronize_stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if stream is None or not isinstance(tensor, FakeTensor):
            return
        with self.timeline.lock:
            block = self.timeline.blocks.get(tensor.elem.untyped_storage().data_ptr())
            if block is not None:
                block.recorded.add(stream.id)

    # -- graphs ---------------------------------------------------------------------------------------
    def supports_graphs(self, device: torch.device) -> bool:
        return self.owns(device)

    def new_graph(self) -> FakeGraph:
        return FakeGraph()

    def graph_capture(self, graph: FakeGraph, device: torch.device) -> ContextManager:
        return fake_graph.capture(self, graph, device)

    def replay(self, graph: FakeGraph) -> None:
        with self.timeline.lock:
            graph.replay(self.timeline)

    def check(self) -> None:
        """Raise if any hazard was seen (the fixture calls it as the test ends)."""
        if self.hazards:
            raise HazardError("fake accelerator hazards:\n" + "\n".join(self.hazards))


class _StreamContext:
    def __init__(self, timeline: Timeline, stream: FakeStream) -> None:
        self.timeline = timeline
        self.stream = stream

    def __enter__(self) -> FakeStream:
        self.before = getattr(self.timeline.local, "streams", {}).get(self.stream.device.index)
        self.timeline.set_current(self.stream, self.stream.device)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        self.timeline.set_current(self.before, self.stream.device)
