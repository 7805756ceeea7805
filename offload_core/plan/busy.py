"""Whether other work is loading this machine, so that what a run measures now (calibration, predicted against
measured) says more about that work than about the machine: such measurements are used for the run, never kept; and
the one line that says so, with what helped most on a shared machine (one compute thread)."""

from __future__ import annotations

import os
import sys

#: busy when the 1-minute load average is over this many times the cores (``$OFFLOAD_CORE_BUSY_LOAD`` instead, ``inf``
#: never): our own run adds at most about one runnable thread per core, so this much means at least as many others
#: compete for every core
BUSY_LOAD_PER_CORE = 2.0

#: whether this process has said that the machine is busy (it says so once, however many runs a sweep makes)
told = False


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


def busy_line(loaded: str, threads: int) -> str:
    """The line that says the machine is busy (``loaded``: :func:`busy`'s words) and, when torch computes with more
    than one thread (``threads``), that one thread per process is often several times faster then: each of its
    threads waits for a core the other work holds (a shared 2-core machine ran 3-14x faster with one)."""
    line = f"offload_core: the machine is busy ({loaded}): what this run measures is used for it, not kept"
    if threads > 1:
        line += (
            f"; torch computes with {threads} threads, each waiting for a core the other work holds: one thread is "
            "often several times faster here (OMP_NUM_THREADS=1 python run.py ...)"
        )
    return line


def busy_notice() -> str | None:
    """:func:`busy`; and the first time this process finds the machine busy, :func:`busy_line` on stderr."""
    global told
    loaded = busy()
    if loaded is not None and not told:
        import torch

        told = True
        print(busy_line(loaded, torch.get_num_threads()), file=sys.stderr, flush=True)
    return loaded
