"""The reader thread of the policies that read ahead: started on first use, stopped when the run lets go."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

#: every thread offload_core starts has a name with this prefix (tests look for leftovers by it)
THREAD_PREFIX = "offload-"


class Reader:
    """One worker thread, started on the first :meth:`submit` and joined by :meth:`stop`.

    :meth:`stop` cancels what has not started, waits for what has, and ends the thread; a later
    :meth:`submit` starts a new one. A model released after a run (``offload_state.release()``) or
    removed leaves no thread of ours behind, and can still be called again.
    """

    def __init__(self, name: str) -> None:
        self.name = THREAD_PREFIX + name
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
            return self._executor.submit(fn, *args)

    @property
    def running(self) -> bool:
        return self._executor is not None

    def stop(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
