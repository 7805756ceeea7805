"""How a request picks its tokens (greedy at temperature 0, else transformers' temperature and top-p warpers and a
seeded generator of its own) and how its tokens become text: streamed in pieces, cut at a stop string."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Params:
    """What a request asked for: at most ``max_tokens`` new tokens, picked at ``temperature`` (0: greedy) within
    ``top_p``, from ``seed`` (None: a random one), ending before any of ``stop``; ``logprobs``: each token's
    log-probability comes with that many alternatives (None: none asked)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Picker:
    """Picks a request's next token from its logits, each request with its own random generator."""

    def __init__(self, params: Params, device: torch.device) -> None:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        self.params = params
        self.generator: torch.Generator | None = None
        self.warpers = LogitsProcessorList()
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)
            self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_p < 1:
                self.warpers.append(TopPLogitsWarper(params.top_p))

    def pick(self, logits: torch.Tensor) -> int:
        """The next token after ``logits`` (one row of the last position, float32)."""
        if self.params.greedy:
            return int(torch.argmax(logits, dim=-1))
        scores = self.warpers(None, logits[None, :])
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])


@dataclass
class Detokenizer:
    """A request's tokens as text: ``feed`` gives the text that may be sent now (held back while it could still be the
    start of a stop string, or ends in a split character), and says when a stop string ended it."""

    tokenizer: Any
    stop: tuple[str, ...] = ()
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text already given out
    text: str = ""
    stopped: bool = False

    def _decode(self) -> str:
        from offload_core.runner.inputs import decode

        return decode(self.tokenizer, self.tokens)

    def feed(self, token: int, last: bool = False) -> str:
        """Add ``token`` and return the text to send now; ``last``: nothing follows, send everything left."""
        self.tokens.append(token)
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped, text, last = True, text[:cut], True
        self.text = text
        ready = len(text)
        if not last:
            if text.endswith("\ufffd"):  # a character split across tokens: wait for its end
                ready = len(text) - 1
            hold = max((len(s) - 1 for s in self.stop), default=0)
            ready = min(ready, len(text) - hold)
        piece = text[self.sent : max(ready, self.sent)]
        self.sent = max(ready, self.sent)
        return piece

    def rest(self) -> str:
        """The text held back so far, to send when the request ends (by its end-of-sequence token)."""
        piece = self.text[self.sent :]
        self.sent = len(self.text)
        return piece

    def _stop_at(self, text: str) -> int | None:
        found = [text.find(s, max(self.sent - len(s), 0)) for s in self.stop if s]
        found = [i for i in found if i >= 0]
        return min(found) if found else None
