"""The base every strategy (placement, storage, module-hook policy) shares: it is built from its config dataclass."""

from __future__ import annotations

from abc import ABC
from typing import Any


class StrategyBase(ABC):
    """A strategy keeps the config dataclass it was built from as ``self.config``."""

    def __init__(self, config: Any) -> None:
        self.config = config
