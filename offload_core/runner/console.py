"""Lines the run says to its user on stderr, apart from the results it prints."""

from __future__ import annotations

import sys


def print_line(text: str) -> None:
    """Print one line to stderr, starting a line of its own: every progress bar still open is closed first."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    sys.stdout.flush()
    print(f"offload_core: {text}", file=sys.stderr, flush=True)
