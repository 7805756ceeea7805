"""Waits that wait for a state (never a fixed sleep), each with a deadline that fails the test instead of hanging."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60) -> object:
    """``condition()``'s first true value, polled until ``timeout`` seconds pass; then the test fails naming
    ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.002)


def blocked_in(thread: threading.Thread, function: str, timeout: float = 60) -> None:
    """Wait until ``thread`` is waiting on a lock or condition inside ``function`` (its stack holds both); fails if
    the thread ends first or the deadline passes."""

    def waiting() -> bool:
        assert thread.is_alive(), f"{thread.name} ended instead of waiting in {function}"
        frame, names = sys._current_frames().get(thread.ident), set()
        while frame is not None:
            names.add(_source_name(frame.f_code.co_name))
            frame = frame.f_back
        return function in names and bool(names & {"wait", "wait_for", "_wait_for_tstate_lock"})

    wait_until(waiting, f"{thread.name} waiting in {function}", timeout)


def _source_name(name: str) -> str:
    """A function's name as written: mutation testing (bench/mutation.py, mutmut) runs ``BlockPool.acquire`` as
    ``xǁBlockPoolǁacquire__mutmut_orig`` (or a mutant of it) and a function ``f`` as ``x_f__mutmut_3``."""
    if "__mutmut_" not in name:
        return name
    base = name.split("__mutmut_")[0]
    return base.rsplit("ǁ", 1)[-1] if "ǁ" in base else base.removeprefix("x_")
