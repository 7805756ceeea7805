"""The recorded order in which units run, and the units it predicts next."""

from __future__ import annotations


class Trace:
    """The recorded order of unit calls; predicts the units that come after a position (cyclically)."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.complete = False
        self.position = -1
        self.invalidations = 0

    def observe(self, unit: int) -> bool:
        """Record a call; returns True when it was the predicted one (the trace is usable)."""
        if not self.complete:
            if self.order and unit == self.order[0]:
                self.complete = True
                self.position = 0
                return True
            if unit in self.order:  # a repeat before the cycle closed: start again from here
                self.order = [unit]
                return False
            self.order.append(unit)
            self.position = len(self.order) - 1
            return False
        expected = self.order[(self.position + 1) % len(self.order)]
        if unit == expected:
            self.position = (self.position + 1) % len(self.order)
            return True
        self.invalidations += 1
        self.order = [unit]
        self.complete = False
        self.position = 0
        return False

    def upcoming(self, depth: int) -> list[int]:
        if not self.complete:
            return []
        n = len(self.order)
        return [self.order[(self.position + i) % n] for i in range(1, min(depth, n - 1) + 1)]
