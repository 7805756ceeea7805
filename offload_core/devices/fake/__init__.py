"""A fake accelerator for tests: GPU semantics (devices, memory, streams, events, pinned memory) on CPU memory."""

from offload_core.devices.fake.accelerator import FakeAccelerator
from offload_core.devices.fake.tensor import BACKEND, FakeTensor
from offload_core.devices.fake.timeline import HazardError

__all__ = ["BACKEND", "FakeAccelerator", "FakeTensor", "HazardError"]
