"""Loading that says nothing the user did not ask for: transformers' and diffusers' own progress bars hidden while a
block runs (a run's ``progress=false``), and the arguments each library reads without a deprecation warning."""

from __future__ import annotations

import importlib
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch


@contextmanager
def _hidden(library: str) -> Iterator[None]:
    logging = importlib.import_module(f"{library}.utils.logging")
    shown = logging.is_progress_bar_enabled()
    if shown:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


@contextmanager
def library_bars(shown: bool, *libraries: str) -> Iterator[None]:
    """While the block runs, the progress bars of ``libraries`` (``"transformers"``, ``"diffusers"``) appear only when
    ``shown``; as they were after it."""
    with ExitStack() as stack:
        if not shown:
            for library in libraries:
                stack.enter_context(_hidden(library))
        yield


def diffusers_dtype(dtype: torch.dtype | None) -> dict[str, Any]:
    """``dtype`` as diffusers' ``from_pretrained`` takes it: ``dtype=`` where diffusers reads it (its ``torch_dtype``
    is then deprecated, with a FutureWarning), ``torch_dtype=`` in the releases before."""
    from diffusers.utils import deprecation_utils

    return {"dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype": dtype}
