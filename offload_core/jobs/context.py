"""The context every run mode measures in: the prepared model dispatched as its plan says, the load timed, the
counters and peak memory reset once loaded, the process's memory watched, and everything released however it ends."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from offload_core import devices
from offload_core.jobs.metrics import MemoryMonitor
from offload_core.plan.prepare import Prepared


@contextmanager
def frozen_heap() -> Iterator[None]:
    """While the block runs, the garbage collector's full passes leave out every object made before it (the imports,
    the config, the empty model: ``gc.freeze``), and take them back after (``gc.unfreeze``): a full pass over them
    otherwise falls in the load or the first token by chance and makes their times vary from run to run."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def dispatched(job: Prepared) -> Iterator[Any]:
    """Load the prepared checkpoint into the model as the plan places it, with the run's storage and policy; yields
    the model's ``offload_state`` and, however the block ends, drops every loaded unit and closes the store."""
    from offload_core.plan.request import dispatch

    settings, run_model = job.settings, job.run_model
    dispatch(job.plan, run_model.model, job.checkpoint, settings.offload_folder, settings.progress)
    if settings.graphs:
        from offload_core.module_hooks.graphs import apply_graphs

        apply_graphs(run_model.model, settings.execution_device)
    with run_model.model.offload_state as state:
        yield state


@dataclass
class Loaded:
    """A dispatched run as its mode measures it: the model's ``offload_state``, the seconds loading took, the
    memory monitor running since before the load, and what ``ready`` made of the loaded model (if given)."""

    state: Any
    load_s: float
    memory: MemoryMonitor
    ready: Any = None


@contextmanager
def loaded(job: Prepared, ready: Callable[[Any], Any] | None = None) -> Iterator[Loaded]:
    """Watch memory, dispatch (timed, with ``ready(model)`` counted in the load: a speculation's drafts), then reset
    the transfer counters and the accelerator's peak memory so the figures count the run alone. The monitor stops
    when the block ends: read its deltas after it."""
    with frozen_heap(), MemoryMonitor() as memory:
        started = time.perf_counter()
        with dispatched(job) as state:
            made = ready(job.run_model.model) if ready is not None else None
            load_s = time.perf_counter() - started
            state.stats.reset()
            if devices.is_accelerator(job.settings.execution_device):
                accelerator = devices.active()
                for index in range(accelerator.count()):
                    accelerator.reset_peak_memory_stats(index)
            yield Loaded(state, load_s, memory, made)
