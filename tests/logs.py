"""A logger's records, captured on the logger itself: whatever an earlier test did to logging (an in-process Hydra run
disabling existing loggers, a handler on a closed stream, a parent that stops propagating), the records come."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def records_of(name: str, level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages logged to logger ``name`` at ``level`` or above while the block runs."""
    logger = logging.getLogger(name)
    said: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: said.append(record.getMessage())
    saved = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.disabled, logger.level = saved
