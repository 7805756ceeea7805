"""Whether a prompt-lookup draft pays, on this machine and now: a pass that checks drafted tokens costs more than a
pass of one token, and wins only the tokens accepted.

How much more depends on where the pass spends its time. Waiting for the disk (a cold page cache), a pass of 21
tokens costs about what a pass of one does; computing on a CPU (in memory, or warm), SmolLM2's passes of 2, 5 and
21 tokens took 1.7, 1.6 and 2.3 times a pass of one: a draft that is rejected costs most of a pass. So nothing is
assumed: every pass is timed by the tokens it runs, and a draft is checked only where the tokens recent checks won
pay for its pass. A draft that would not pay is skipped (the pass decodes one token); after 1, 2, 4, ... skipped
drafts one is checked anyway, so that a text that starts copying is noticed.

Decided by time, the drafts checked differ from run to run; the decisions are kept (``decisions``: ``c`` checked,
``s`` skipped) and a run given them (``replay``) makes the same ones: the in-memory model running the same
speculation, pass for pass.
"""

from __future__ import annotations

#: weight of the newest observation in the running figures (pass times, tokens won per check)
NEWEST = 0.5
#: the most drafts skipped in a row before one is checked again
MOST_SKIPPED = 16


class DraftValue:
    """Running figures of one generation: seconds per pass by the tokens it runs, and tokens won per check.

    ``prior``: the tokens a check is expected to win before any was made (the first draft is always checked);
    ``replay``: another run's :attr:`decisions`, made again in order (then every draft is checked)."""

    def __init__(self, prior: float = 1.0, replay: str | None = None) -> None:
        self.seconds: dict[int, float] = {}
        self.won = float(prior)
        self.patience = 1  # drafts skipped before the next is checked anyway
        self.skipped_in_row = 0
        self.decisions = ""  # one letter a draft: c checked, s skipped
        self._replay = replay

    def timed(self, tokens: int, seconds: float) -> None:
        """A pass of ``tokens`` tokens took ``seconds``."""
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else NEWEST * seconds + (1 - NEWEST) * old

    def checked(self, accepted: int) -> None:
        """A check of drafted tokens accepted ``accepted`` of them."""
        self.won = NEWEST * accepted + (1 - NEWEST) * self.won
        if accepted:
            self.patience = 1

    def pays(self, drafted: int) -> bool:
        """Whether to check ``drafted`` tokens in the next pass: the tokens it is expected to yield (one, and those
        recent checks won) take no longer than as many passes of one token would; else skipped, but after
        ``patience`` skipped in a row, checked anyway (patience then doubles, up to :data:`MOST_SKIPPED`)."""
        if self._replay is not None:
            replayed = self._replay[len(self.decisions) : len(self.decisions) + 1] != "s"
            return self._decided(replayed)
        return self._decided(self._pays(drafted))

    @property
    def skipped(self) -> int:
        """Drafts skipped in all."""
        return self.decisions.count("s")

    def _decided(self, checked: bool) -> bool:
        self.decisions += "c" if checked else "s"
        return checked

    def _pays(self, drafted: int) -> bool:
        one, check = self.seconds.get(1), self._cost(drafted + 1)
        if one is None or check is None or (1 + min(self.won, drafted)) * one >= check:
            self.skipped_in_row = 0
            return True
        if self.skipped_in_row < self.patience:
            self.skipped_in_row += 1
            return False
        self.skipped_in_row, self.patience = 0, min(2 * self.patience, MOST_SKIPPED)
        return True

    def _cost(self, tokens: int) -> float | None:
        """Seconds of a pass of ``tokens`` tokens: as timed, else as the nearest size of check timed (None: none)."""
        checks = [n for n in self.seconds if n > 1]
        if not checks:
            return None
        return self.seconds[min(checks, key=lambda n: (abs(n - tokens), n))]
