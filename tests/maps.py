"""What this process maps from a file, read from ``/proc/self/maps``."""

from __future__ import annotations

from os import PathLike


def file_backed(address: int, length: int, path: str | PathLike[str]) -> int:
    """Bytes of ``[address, address + length)`` that this process maps from ``path``."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if len(fields) == 6 and fields[5].strip() == str(path):
                total += max(0, min(end, address + length) - max(start, address))
    return total
