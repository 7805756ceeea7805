"""The fake accelerator's streams and events, and the hazards they exist to prevent.

Every operation on a fake device is issued on its thread's current stream and numbered there. Copies from
pinned host memory issued with ``non_blocking=True`` are queued and run later: when their stream issues
something else, or when an event recorded after them is waited for or synchronized. Each device
buffer remembers the last stream operation that wrote it and the last ones that read it; a stream that
touches it without having waited for those (an event, a stream or device synchronization) is a hazard,
and so is a buffer freed while another stream may still use it (unless ``record_stream`` said so), and a
pinned host buffer rewritten before the copy reading it ran. Hazards are recorded (the test fails at
teardown) and raised where they happen.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import torch


class HazardError(RuntimeError):
    """A use of device or pinned memory that a real accelerator would not order: the result would be wrong."""


_ids = itertools.count(1)

#: operations a real device makes the host wait for (a blocking copy either way, a value read back)
HOST_WAITS = frozenset({"copy to the host", "copy to the device", "_local_scalar_dense", "equal", "is_nonzero"})


@dataclass(eq=False)
class FakeStream:
    device: torch.device
    name: str
    id: int = field(default_factory=lambda: next(_ids))
    seq: int = 0  # operations issued
    done: int = 0  # operations run (queued copies run late)
    queue: deque = field(default_factory=deque)  # (seq, run) of queued copies
    waits: dict = field(default_factory=dict)  # stream id -> the seq of it this stream has waited for

    def __repr__(self) -> str:
        return f"<{self.name} stream of {self.device}>"


@dataclass(eq=False)
class FakeEvent:
    stream: FakeStream | None = None
    seq: int = 0


@dataclass
class Block:
    """A device allocation (one CPU storage) and the stream operations that last used it."""

    device: torch.device
    nbytes: int
    stream: FakeStream  # allocated on
    wrappers: int = 0
    write: tuple[FakeStream, int] | None = None
    reads: dict = field(default_factory=dict)  # stream id -> (stream, seq)
    recorded: set = field(default_factory=set)  # stream ids from record_stream
    storage: object = None  # the CPU storage (a capture gives the bytes it wrote back)


class Timeline:
    """Streams, events and the per-buffer bookkeeping of every fake device (one lock for all threads)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.defaults: dict[int, FakeStream] = {}
        self.local = threading.local()
        self.host_known: dict[int, int] = {}  # stream id -> seq the host has seen complete
        self.blocks: dict[int, Block] = {}  # storage data_ptr -> block
        self.hazards: list[str] = []
        self.side_streams: weakref.WeakSet = weakref.WeakSet()
        self.capture = None  # a graph capture in progress (fake/graph.py)
        #: (thread name, what) -> times that thread waited for a device: a synchronization, or a blocking operation
        self.host_waits: Counter = Counter()

    def host_waited(self, what: str) -> None:
        self.host_waits[(threading.current_thread().name, what)] += 1

    # -- streams ----------------------------------------------------------------------------------
    def default(self, device: torch.device) -> FakeStream:
        with self.lock:
            stream = self.defaults.get(device.index)
            if stream is None:
                stream = self.defaults[device.index] = FakeStream(device, "default")
            return stream

    def current(self, device: torch.device) -> FakeStream:
        current = getattr(self.local, "streams", {}).get(device.index)
        return current if current is not None else self.default(device)

    def set_current(self, stream: FakeStream | None, device: torch.device) -> None:
        if not hasattr(self.local, "streams"):
            self.local.streams = {}
        self.local.streams[device.index] = stream

    def known(self, stream: FakeStream, other: FakeStream, seq: int) -> bool:
        """Whether work issued on ``stream`` now is ordered after operation ``seq`` of ``other``."""
        return other is stream or seq <= max(stream.waits.get(other.id, 0), self.host_known.get(other.id, 0))

    def run_until(self, stream: FakeStream, seq: int) -> None:
        """Run ``stream``'s queued copies up to operation ``seq``."""
        while stream.queue and stream.queue[0][0] <= seq:
            _, run = stream.queue.popleft()
            run()
        stream.done = max(stream.done, seq)

    def record(self, stream: FakeStream) -> FakeEvent:
        with self.lock:
            event = FakeEvent(stream, stream.seq)
            if self.capture is not None:
                self.capture.recorded(stream, event)
            return event

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        if event is None or event.stream is None:
            return
        with self.lock:
            if self.capture is not None:
                self.capture.waits(self, stream, event)
            stream.waits[event.stream.id] = max(stream.waits.get(event.stream.id, 0), event.seq)
            for other_id, seq in event.stream.waits.items():  # what the event's stream had waited for, too
                stream.waits[other_id] = max(stream.waits.get(other_id, 0), seq)
            self.run_until(event.stream, event.seq)

    def synchronize_event(self, event: FakeEvent) -> None:
        if event is None or event.stream is None:
            return
        with self.lock:
            if self.capture is not None:
                raise self.capture.fail(self, "the host waits for the device during a capture (a synchronization)")
            self.host_waited("synchronize")
            self.run_until(event.stream, event.seq)
            self.host_known[event.stream.id] = max(self.host_known.get(event.stream.id, 0), event.seq)
            for other_id, seq in event.stream.waits.items():
                self.host_known[other_id] = max(self.host_known.get(other_id, 0), seq)

    def synchronize_stream(self, stream: FakeStream) -> None:
        self.synchronize_event(self.record(stream))

    # -- operations -------------------------------------------------------------------------------
    def hazard(self, message: str) -> HazardError:
        self.hazards.append(message)
        return HazardError(message)

    def _check(self, stream: FakeStream, ptr: int, writes: bool, what: str) -> None:
        block = self.blocks.get(ptr)
        if block is None:
            return
        if block.write is not None and not self.known(stream, *block.write):
            other = block.write[0]
            raise self.hazard(
                f"{what} on {stream!r} uses a {block.device} buffer that {other!r} writes "
                f"without waiting for it (an event or a synchronization)"
            )
        if writes:
            for other, seq in block.reads.values():
                if not self.known(stream, other, seq):
                    raise self.hazard(
                        f"{what} on {stream!r} overwrites a {block.device} buffer that {other!r} may "
                        f"still be reading (it did not wait for that stream's event)"
                    )

    def operate(
        self,
        device: torch.device,
        reads: list[int],
        writes: list[int],
        run: Callable,
        what: str,
        deferred: bool = False,
    ):
        """Issue ``run`` on ``device``'s current stream, reading and writing the buffers of these storage
        pointers; ``deferred``: queue it (a copy from pinned memory), else run it now."""
        with self.lock:
            stream = self.current(device)
            capture = self.capture
            if capture is not None:
                capture.issue(self, stream, writes, what)
            if not deferred:
                self.run_until(stream, stream.seq)  # the stream's queued copies come first
                if what in HOST_WAITS:
                    self.host_waited(what)
            for ptr in reads:
                self._check(stream, ptr, False, what)
            for ptr in writes:
                self._check(stream, ptr, True, what)
            stream.seq += 1
            seq = stream.seq
            for ptr in reads:
                block = self.blocks.get(ptr)
                if block is not None:
                    block.reads[stream.id] = (stream, seq)
            for ptr in writes:
                block = self.blocks.get(ptr)
                if block is not None:
                    block.write = (stream, seq)
                    block.reads = {}
            if deferred:
                if capture is not None:  # recorded, never run: a capture runs nothing
                    capture.deferred(device, stream, reads, writes, run, what)
                else:
                    stream.queue.append((seq, run))
                return None
            result = run()
            stream.done = seq
            if capture is not None:
                capture.ran(device, stream, reads, writes, run, what, result)
            return result

    def freed(self, ptr: int) -> Block | None:
        """The program let go of the buffer at ``ptr``: a hazard if another stream may still use it."""
        with self.lock:
            block = self.blocks.pop(ptr, None)
            if block is None:
                return None
            users = ([block.write] if block.write is not None else []) + list(block.reads.values())
            for other, seq in users:
                if other.id not in block.recorded and not self.known(block.stream, other, seq):
                    self.hazard(
                        f"a {block.device} buffer was freed while {other!r} may still use it (no "
                        f"synchronization or record_stream): the allocator could hand it out again"
                    )
                    break
            return block
