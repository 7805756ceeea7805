"""The base every strategy (placement, storage, module-hook policy) shares: it is built from its config dataclass."""

from __future__ import annotations

from abc import ABC
from typing import Any


class StrategyBase(ABC):
    """A strategy keeps the config dataclass it was built from as ``self.config``."""

    #: the strategy takes part in ``auto=true``'s search (a storage or a module-hook policy): it declares what the
    #: time prediction reads (a storage's ``reads_from`` and ``pinned``; a policy's ``granularity``,
    #: ``predict_moved`` and ``overlaps_io``) and runs on the dispatched probe (two blocks of the model's shape, in a
    #: fresh store). Off by default: a strategy that does not say so is never picked for the user.
    auto: bool = False

    @classmethod
    def auto_variants(cls) -> list[dict[str, Any]]:
        """The option sets ``auto=true`` tries for this strategy, each laid over its config's defaults (one: the
        defaults)."""
        return [{}]

    def __init__(self, config: Any) -> None:
        self.config = config
