"""Lines the run says to its user on stderr, apart from the results it prints."""

from __future__ import annotations

import sys


def _terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def print_line(text: str) -> None:
    """Print one line to stderr, starting a line of its own: every progress bar still open is closed first, and where
    a closed bar was cleared in place (its line ends in a carriage return, not a newline) on a stream that is not a
    terminal (a log file, a pipe), a newline ends its line first."""
    from tqdm import tqdm

    cleared = False
    for bar in list(getattr(tqdm, "_instances", ())):
        leaves = bar.leave if bar.leave is not None else abs(getattr(bar, "pos", 0)) == 0  # tqdm's own rule
        cleared |= not bar.disable and not leaves and not _terminal(bar.fp)
        bar.close()
    sys.stdout.flush()
    print(f"{chr(10) if cleared else ''}offload_core: {text}", file=sys.stderr, flush=True)
