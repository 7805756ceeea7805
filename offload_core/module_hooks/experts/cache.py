"""The expert cache: a few experts per MoE layer kept in host memory, chosen by use frequency with recency to break
ties (LFRU)."""

from __future__ import annotations

from typing import Any


class ExpertCache:
    """At most ``slots`` experts of one MoE layer, each a ``{store key: row tensor}``.

    Every request counts towards an expert's frequency (resident or not). A new expert takes a free
    slot, or replaces the resident expert with the lowest (frequency, last use) when it has been asked
    for at least as often; otherwise it is not admitted (a one-off expert does not push out a regular).
    """

    def __init__(self, slots: int) -> None:
        self.slots = max(int(slots), 0)
        self.resident: dict[int, dict[str, Any]] = {}
        self.frequency: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        self.clock = 0
        self.evictions = 0  # experts evicted for another

    def request(self, experts: list[int]) -> None:
        """Count one call that routed to ``experts``."""
        self.clock += 1
        for expert in experts:
            self.frequency[expert] = self.frequency.get(expert, 0) + 1
            self.last_use[expert] = self.clock

    def get(self, expert: int) -> dict[str, Any] | None:
        return self.resident.get(expert)

    def _rank(self, expert: int) -> tuple[int, int]:
        return self.frequency.get(expert, 0), self.last_use.get(expert, 0)

    def wants(self, expert: int) -> bool:
        """Whether :meth:`admit` would keep ``expert`` now."""
        if self.slots == 0 or expert in self.resident:
            return False
        if len(self.resident) < self.slots:
            return True
        victim = min(self.resident, key=self._rank)
        return self._rank(expert) >= self._rank(victim)

    def spare(self) -> dict[str, Any] | None:
        """When the cache is full, evict the lowest-ranked expert and hand back its rows, so the expert
        about to be admitted is read into that memory instead of a new allocation; None otherwise."""
        if self.slots == 0 or len(self.resident) < self.slots:
            return None
        self.evictions += 1
        return self.resident.pop(min(self.resident, key=self._rank))

    def admit(self, expert: int, rows: dict[str, Any]) -> bool:
        """Keep ``rows`` for ``expert`` if it ranks high enough (evicting the lowest); True when kept."""
        if not self.wants(expert):
            return False
        if len(self.resident) >= self.slots:
            del self.resident[min(self.resident, key=self._rank)]
            self.evictions += 1
        self.resident[expert] = rows
        return True
