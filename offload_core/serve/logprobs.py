"""Log-probabilities as OpenAI's clients read them: each generated token's log-probability under the model's own
distribution (its logits before temperature and top_p, as vLLM and transformers report them) and the ``k`` likeliest
tokens at that position, rendered in the chat (``{"content": [...]}``) or the text-completion shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

#: the most alternatives a request may ask for (OpenAI's limits: chat 20, completions 5)
CHAT_TOP = 20
COMPLETION_TOP = 5


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text, its log-probability, and the ``top`` likeliest (text, log-probability)."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, top: int, text: Callable[[int], str]) -> TokenLogprob:
    """``token``'s entry after ``logits`` (one row, any float dtype), with the ``top`` likeliest alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[str, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        best = tuple((text(int(i)), float(v)) for v, i in zip(values.tolist(), ids.tolist()))
    return TokenLogprob(text(token), float(logp[token]), best)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """The ``logprobs`` of a chat choice (or of one stream chunk's tokens)."""
    return {
        "content": [
            {
                "token": item.text,
                "logprob": item.logprob,
                "bytes": _utf8(item.text),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)} for t, lp in item.top],
            }
            for item in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The ``logprobs`` of a text completion: tokens, their log-probabilities, the top alternatives of each (a dict
    of text to log-probability) and where each token's text starts (``offset``: the characters before the first)."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.text)
    return {
        "tokens": [item.text for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [dict(item.top) for item in items],
        "text_offset": offsets,
    }
