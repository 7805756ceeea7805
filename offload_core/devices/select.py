"""Which accelerator is active: the one torch reports, unless ``OFFLOAD_CORE_ACCELERATOR`` or :func:`use` says
otherwise."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch

from offload_core.devices.base import HOST, Accelerator

#: ``cpu`` (or ``none``) hides the machine's accelerator from offload_core; unset or ``auto`` uses it
ENV = "OFFLOAD_CORE_ACCELERATOR"

_lock = threading.Lock()
_active: Accelerator | None = None
_detected: Accelerator | None = None


def _detect() -> Accelerator:
    global _detected
    if _detected is None:
        from offload_core.devices.torch_backend import TorchAccelerator, detect

        wanted = os.environ.get(ENV, "auto").strip().lower()
        if wanted in ("cpu", "none", "0", "off"):
            _detected = HOST
        else:
            found = detect()
            _detected = TorchAccelerator(found) if found is not None and found != "fakegpu" else HOST
    return _detected


def active() -> Accelerator:
    """The accelerator every device question goes to."""
    current = _active
    return current if current is not None else _detect()


@contextlib.contextmanager
def use(accelerator: Accelerator | None) -> Iterator[Accelerator]:
    """Make ``accelerator`` the active one inside the block (None: the detected one). Tests use it to run
    on the cpu on a machine with a GPU, or on a fake GPU on a machine without one."""
    global _active
    with _lock:
        before, _active = _active, accelerator
    try:
        yield active()
    finally:
        with _lock:
            _active = before


def for_device(device: torch.device | str) -> Accelerator:
    """The accelerator that runs ``device``: the active one if it owns it, else the host (synchronous)."""
    accelerator = active()
    return accelerator if accelerator.owns(device) else HOST


def is_accelerator(device: torch.device | str) -> bool:
    """Whether ``device`` is an accelerator device (not the cpu, meta or disk)."""
    return torch.device(device).type not in ("cpu", "meta")


def gpu(index: int) -> torch.device:
    """The torch device a device map's GPU ``index`` names."""
    return active().device(index)


def gpu_count() -> int:
    return active().count()


def default_execution_device() -> torch.device:
    """Device 0 of the active accelerator, else the cpu."""
    return active().default_device()
