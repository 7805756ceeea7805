"""A process's memory peak as the kernel measures it, not as a sampling thread happens to see it."""

from __future__ import annotations

from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


class KernelPeak:
    """The rise of this process's resident set over a block, from the kernel's high-water mark (``VmHWM``, reset
    at entry by writing 5 to ``/proc/self/clear_refs``): every page that was ever resident at once counts, however
    briefly, so a spike between two samples cannot be missed.

    ``VmHWM`` counts all resident pages, anonymous and file-backed alike, so ``rise`` bounds the anonymous rise
    from above (file pages mapped at entry stay mapped: nothing here unmaps the interpreter's libraries); a test
    that asserts an anonymous budget with it adds the file pages the block may map (offloaded weights read through
    their mapping)."""

    def __enter__(self) -> "KernelPeak":
        Path("/proc/self/clear_refs").write_text("5")
        self.start = _status("VmRSS")
        self.rise = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.rise = _status("VmHWM") - self.start
