"""Prompt-lookup speculation inside the batch: each request drafts the tokens that followed an n-gram earlier in its
own prompt and output; one forward checks every request's drafts (rows padded to the longest); each request keeps
its drafts up to the first one its own pick disagrees with, plus the token picked there; its rows of the KV cache then
drop what was rejected."""

from __future__ import annotations

from typing import Any

import torch

from offload_core.speculative.config import SpeculativeConfig
from offload_core.speculative.counting import next_lookup_tokens


class Drafter:
    """Drafts for each request with transformers' prompt-lookup candidate generator: up to ``config.tokens`` tokens
    after the longest n-gram (at most ``config.ngram``) that ends its text and occurred before; the number each
    request drafts adapts to what it accepted (as ``mode=run``'s prompt lookup); never past its ``max_tokens`` or
    ``context``."""

    def __init__(self, config: SpeculativeConfig, eos: set[int], context: int) -> None:
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        self.config, self.context = config, context
        self.lookup = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(sorted(eos), dtype=torch.long) if eos else None,
            num_output_tokens=int(config.tokens),
            max_matching_ngram_size=int(config.ngram),
            max_length=context + int(config.tokens) + 2,  # never the limit: ``room`` below is
        )

    def draft(self, request: Any, most: int) -> list[int]:
        """The tokens (at most ``most``) ``request`` drafts now: none when nothing matches or it has no room left."""
        made = len(request.tokens)
        room = min(request.params.max_tokens - made - 1, self.context - len(request.prompt) - made - 1, most)
        if room < 1 or not request.tokens:
            return []
        if not request.lookup:
            request.lookup = int(self.config.tokens)
        self.lookup.num_output_tokens = min(request.lookup, room)
        ids = torch.tensor([request.prompt + request.tokens], dtype=torch.long)
        candidates, _ = self.lookup.get_candidates(ids)
        return candidates[0, ids.shape[1] :].tolist()

    def checked(self, request: Any, drafted: int, matched: int) -> None:
        """``request`` drafted ``drafted`` tokens of which ``matched`` were accepted: its next draft's length."""
        if self.config.adaptive:
            request.lookup = next_lookup_tokens(request.lookup, drafted, matched, int(self.config.tokens))


def drafts(engine: Any, group: Any) -> list[list[int]]:
    """Each row's drafts this step (none without speculation); a step checks at most ``context`` tokens in all, as
    the prefill the plan holds activations for."""
    if engine.drafter is None:
        return [[] for _ in group.rows]
    most = engine.context // len(group.rows) - 1
    return [engine.drafter.draft(r, most) for r in group.rows]


def draft_inputs(engine: Any, group: Any, drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ids and positions of a forward that gives each row its last token and its drafts, padded on the right to
    the longest, and that width (1 without drafts: a plain decoding step)."""
    width = max(map(len, drafts), default=0) + 1
    ids = [[r.tokens[-1], *d, *[engine.pad] * (width - 1 - len(d))] for r, d in zip(group.rows, drafts)]
    positions = group.cache.positions() + torch.arange(width)[None, :]
    return torch.tensor(ids, dtype=torch.long), positions, width


def accept(engine: Any, group: Any, logits: torch.Tensor, drafts: list[list[int]]) -> None:
    """Each row's tokens from ``logits`` (rows x width x vocab): picked at each position in turn (greedy or sampled,
    each token picked as without speculation), going on while the pick equals the row's draft there; then the rejected
    columns leave the row's KV cache."""
    width = logits.shape[1]
    kept, made, drafted, accepted = [], 0, 0, 0
    for row, (request, draft) in enumerate(zip(group.rows, drafts)):
        matched = 0
        for j in range(len(draft) + 1):
            token = engine.give(request, logits[row, j])
            if token is None:
                break
            made += 1
            if j == len(draft) or token != draft[j]:
                break
            matched += 1
            if request.done:
                break
        kept.append(1 + matched)
        if draft:
            drafted, accepted = drafted + len(draft), accepted + matched
            engine.drafter.checked(request, len(draft), matched)
    engine.metrics.on_pass(made)
    engine.metrics.on_drafts(drafted, accepted)
    engine.send_finished()
    group.cache.settle(kept, width)


def speculating(value: Any) -> SpeculativeConfig | None:
    """The speculation a server runs: prompt lookup, or None."""
    if value is None or value.name == "none":
        return None
    if value.name != "prompt_lookup":
        raise ValueError(f"speculative={value.name} is not run inside the batch")
    return value
