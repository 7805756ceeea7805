"""Loading that says nothing the user did not ask for: transformers' and diffusers' own progress bars hidden while a
block runs (a run's ``progress=false``), the arguments each library reads without a deprecation warning, no notice
about an image processor the run never uses, and no import-time noise (nor cost: torchao) from optional libraries."""

from __future__ import annotations

import importlib
import logging
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch

from offload_core.loading.torchao_later import import_torchao_later

#: (logger, start of the message) of warnings optional libraries log when transformers imports them (it imports each one
#: installed) that say nothing about a run: torchao (the quant extra) not loading its CUDA kernels under a CPU torch,
#: nor finding triton, and the enums it registers with torch's pytree, which torch now deprecates; bitsandbytes not
#: finding the optional package of its CPU kernels
IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torchao.kernel.intmm", "Warning: Detected no triton"),
    ("torch.utils._pytree", "<enum "),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)


class _DropNoise(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.start)


def quiet_import_noise() -> None:
    """Drop :data:`IMPORT_NOISE`'s warnings (only those: every other record of those loggers is kept)."""
    for name, start in IMPORT_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) and f.start == start for f in logger.filters):
            logger.addFilter(_DropNoise(start))


quiet_import_noise()  # on import: offload_core imports this module first
import_torchao_later()


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


#: what transformers says (a logged warning, once per class) when diffusers imports an image processor and torchvision
#: is not installed: the import falls back to the PIL processor, which pipelines run with anyway
TORCHVISION_FALLBACK = "requires torchvision (not installed); falling back to"


def _not_torchvision_fallback(record: logging.LogRecord) -> bool:
    return TORCHVISION_FALLBACK not in record.getMessage()


def without_image_processor_notices() -> None:
    """From now on, transformers' notices that an image processor falls back to its PIL form without torchvision are
    not logged: importing diffusers' pipelines imports two (CLIP's, SigLIP's), so every pipeline run printed two
    lines the user cannot act on (and, with ``CI`` set, transformers passes them to the root logger too, where a
    run's log shows them as ``[WARNING]`` lines). Other messages of that logger are kept."""
    logger = logging.getLogger("transformers.utils.import_utils")
    if _not_torchvision_fallback not in logger.filters:
        logger.addFilter(_not_torchvision_fallback)
