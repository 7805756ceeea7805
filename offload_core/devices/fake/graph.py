"""The fake accelerator's graphs: stream work recorded while captured and issued again, in order, on each replay.

As on CUDA, a capture runs nothing that lasts (buffers the step writes get their bytes back when the capture ends,
and memory allocated inside holds garbage), a host synchronization, a copy to the host, a copy from pageable memory,
pinned allocation, work on a stream that did not join the capture by an event, a wait on an event recorded before
it, or a side stream whose work the capturing stream never waited for, raises :class:`CaptureError`. A replay issues
the recorded operations on their streams again (copies from pinned memory run late, as eagerly), so an unordered
use of a buffer in the captured schedule is a hazard on every replay as it was while capturing.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from offload_core.devices.fake.timeline import FakeEvent, FakeStream, HazardError

if TYPE_CHECKING:
    from offload_core.devices.fake.timeline import Timeline


class CaptureError(HazardError):
    """Something inside a capture that a CUDA graph cannot hold (a host synchronization, an uncaptured stream)."""


def _bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _assign(captured: Any, fresh: Any) -> None:
    """Write a replayed operation's results into the tensors the capture handed out (fixed addresses)."""
    for old, new in zip(tree_flatten(captured)[0], tree_flatten(fresh)[0]):
        if isinstance(old, torch.Tensor) and old is not new and old.numel():
            with torch.inference_mode():
                old.copy_(new)


class FakeGraph:
    """What one capture recorded: ``("op" | "record" | "wait", ...)`` actions in the order they were issued."""

    def __init__(self) -> None:
        self.actions: list[tuple] = []
        self.origin: FakeStream | None = None
        self.device: torch.device | None = None
        self.replays = 0

    def replay(self, timeline: Timeline) -> None:
        if self.origin is None:
            raise CaptureError("fake accelerator: replay of a graph that was never captured")
        current = timeline.current(self.device)
        timeline.wait(self.origin, timeline.record(current))  # the graph starts after the work queued before it
        before = getattr(timeline.local, "streams", {}).get(self.device.index)
        try:
            for action in self.actions:
                if action[0] == "op":
                    _, device, stream, reads, writes, run, what, deferred = action
                    timeline.set_current(stream, device)
                    timeline.operate(device, reads, writes, run, what, deferred)
                elif action[0] == "record":
                    action[2].seq = action[1].seq
                else:
                    timeline.wait(action[1], action[2])
        finally:
            timeline.set_current(before, self.device)
        timeline.wait(current, timeline.record(self.origin))
        self.replays += 1


class Capture:
    """The state of a capture in progress (``Timeline.capture``)."""

    def __init__(self, graph: FakeGraph, origin: FakeStream) -> None:
        self.graph = graph
        self.streams = {origin.id: origin}
        self.events: set[int] = set()
        self.saved: dict[int, tuple[Any, torch.Tensor]] = {}  # blocks that existed before: their bytes
        self.pool: dict[int, Any] = {}  # storages the step's operations made inside (the graph's pool), by address

    def fail(self, timeline: Timeline, message: str) -> CaptureError:
        timeline.hazards.append(message)
        return CaptureError(message)

    def issue(self, timeline: Timeline, stream: FakeStream, writes: list[int], what: str) -> None:
        if stream.id not in self.streams:
            raise self.fail(
                timeline,
                f"{what} on {stream!r} during a capture: that stream never waited on an event of the capturing "
                "stream, so its work would run outside the graph",
            )
        if what in ("copy to the host", "_local_scalar_dense"):
            raise self.fail(timeline, f"{what} during a capture: the host would wait for the device")
        if what == "copy to the device":
            raise self.fail(timeline, "a synchronous copy to the device during a capture (from pageable memory)")
        for ptr in writes:
            block = timeline.blocks.get(ptr)
            if ptr not in self.saved and ptr not in self.pool and block is not None and block.storage is not None:
                self.saved[ptr] = (block.storage, _bytes(block.storage).clone())

    def ran(self, device: torch.device, stream: FakeStream, reads: list, writes: list, run: Callable, what: str,
            result: Any) -> None:  # fmt: skip
        if not all(isinstance(x, torch.Tensor) or x is None for x in tree_flatten(result)[0]):
            raise CaptureError(f"{what} during a capture returned a host value: the host would wait for the device")
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
                ptr = tensor.untyped_storage().data_ptr()
                if ptr not in reads and ptr not in writes:  # a new allocation, not an operand handed back
                    self.pool[ptr] = tensor.untyped_storage()

        def again() -> Any:
            fresh = run()
            _assign(result, fresh)
            return result

        self.graph.actions.append(("op", device, stream, reads, writes, again, what, False))

    def factory(self, device: torch.device, stream: FakeStream, elem: torch.Tensor, make: Callable) -> None:
        """A tensor made on the device from host values (``arange``, ``full``): made again on each replay."""
        if elem.untyped_storage().nbytes():
            self.pool[elem.untyped_storage().data_ptr()] = elem.untyped_storage()
        self.graph.actions.append(("op", device, stream, [], [], lambda: _assign(elem, make()), "factory", False))

    def view(self, device: torch.device, stream: FakeStream, reads: list, out: Any, make: Callable) -> None:
        """A view operation: nothing to replay, unless it made new memory (``to`` converting a dtype)."""
        fresh = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()]
        if all(t.untyped_storage().data_ptr() in reads for t in fresh):
            return
        for tensor in fresh:
            self.pool[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage()

        def again() -> Any:
            with torch.inference_mode():
                _assign(out, make())
            return out

        self.graph.actions.append(("op", device, stream, reads, [], again, "view that copies", False))

    def deferred(self, device: torch.device, stream: FakeStream, reads: list, writes: list, run: Callable,
                 what: str) -> None:  # fmt: skip
        self.graph.actions.append(("op", device, stream, reads, writes, run, what, True))

    def recorded(self, stream: FakeStream, event: FakeEvent) -> None:
        if stream.id in self.streams:
            self.events.add(id(event))
            self.graph.actions.append(("record", stream, event))

    def waits(self, timeline: Timeline, stream: FakeStream, event: FakeEvent) -> None:
        if id(event) not in self.events:
            raise self.fail(
                timeline,
                f"{stream!r} waits during a capture on an event recorded outside it: a graph cannot depend on "
                "work issued before the capture (record a new event inside)",
            )
        self.streams[stream.id] = stream
        self.graph.actions.append(("wait", stream, event))

    def end(self, timeline: Timeline, origin: FakeStream) -> None:
        """Check every side stream joined the capturing stream; undo what the capture ran (as CUDA never ran it)."""
        try:
            for stream in self.streams.values():
                if stream is not origin and origin.waits.get(stream.id, 0) < stream.seq:
                    raise self.fail(
                        timeline,
                        f"{stream!r} has work in the capture that the capturing stream never waited for "
                        "(an unjoined stream: join it by an event before the capture ends)",
                    )
        finally:
            with torch.inference_mode():
                for storage, saved in self.saved.values():
                    _bytes(storage).copy_(saved)
                for storage in self.pool.values():
                    _bytes(storage).fill_(255)


@contextlib.contextmanager
def capture(accelerator: Any, graph: FakeGraph, device: torch.device):
    """Capture the stream work issued on ``device`` into ``graph`` (see :meth:`Accelerator.graph_capture`)."""
    timeline = accelerator.timeline
    if timeline.capture is not None:
        raise CaptureError("fake accelerator: a capture is already in progress")
    accelerator.synchronize()  # as torch.cuda.graph does before it captures
    device = torch.device(device)
    current = timeline.current(device)
    origin = FakeStream(current.device, "capture")
    timeline.wait(origin, timeline.record(current))
    before = getattr(timeline.local, "streams", {}).get(current.device.index)
    graph.origin, graph.device, graph.actions = origin, current.device, []
    state = timeline.capture = Capture(graph, origin)
    timeline.set_current(origin, current.device)
    failed = False
    try:
        yield graph
    except BaseException:
        failed = True
        raise
    finally:
        timeline.set_current(before, current.device)
        timeline.capture = None
        if failed:  # the capture is discarded: nothing of it will ever run
            graph.origin = None
            for stream in state.streams.values():
                timeline.host_known[stream.id] = max(timeline.host_known.get(stream.id, 0), stream.seq)
            with torch.inference_mode():
                for storage, saved in state.saved.values():
                    _bytes(storage).copy_(saved)
        else:
            try:
                state.end(timeline, origin)
            except BaseException:
                graph.origin = None
                raise
            timeline.wait(current, timeline.record(origin))
