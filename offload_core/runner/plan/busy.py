"""Whether other work is loading this machine, so that what a run measures now (calibration, predicted against
measured) says more about that work than about the machine: such measurements are used for the run, never kept."""

from __future__ import annotations

import os

#: busy when the 1-minute load average is over this many times the cores (``$OFFLOAD_CORE_BUSY_LOAD`` instead, ``inf``
#: never): our own run adds at most about one runnable thread per core, so this much means at least as many others
#: compete for every core
BUSY_LOAD_PER_CORE = 2.0


def busy() -> str | None:
    """A few words on the load when the machine is busy (``load average 6.2 on 2 cores``), else None (also where the
    system has no load average)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None
    cores = os.cpu_count() or 1
    try:
        per_core = float(os.environ.get("OFFLOAD_CORE_BUSY_LOAD", BUSY_LOAD_PER_CORE))
    except ValueError:
        per_core = BUSY_LOAD_PER_CORE
    return f"load average {load:.1f} on {cores} cores" if load > per_core * cores else None
