"""One target's speculation: the draft and generate's arguments, and what happened while it generated: the target's
forward passes (a forward pre-hook on the target), the tokens drafted and accepted (read from transformers' own
candidate generator), and the adaptive number of prompt-lookup tokens."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from offload_core.speculative.config import SpeculativeConfig, read_speculative
from offload_core.speculative.pays import DraftValue


class Speculation:
    """``config`` applied to ``target`` (with ``draft`` for the draft and self modes): ``kwargs`` go to
    ``target.generate``; generate inside :meth:`counting`, then read :meth:`figures`."""

    def __init__(
        self, config: SpeculativeConfig, target: nn.Module, draft: nn.Module | None = None, replay: str | None = None
    ) -> None:
        self.config, self.target, self.draft, self.replay = config, target, draft, replay
        self.passes = self.drafted = self.accepted = self.verifications = 0
        self.lookup_tokens = int(config.tokens)  # prompt lookup: tokens drafted next (adapts)
        self.stopped = False  # drafting stopped for this generation: acceptance below min_acceptance
        self.value = DraftValue()  # prompt lookup: whether a draft pays, from the passes timed
        self._started: tuple[int, float] | None = None

    @property
    def kwargs(self) -> dict[str, Any]:
        """Arguments of ``generate`` that run this speculation (none for ``none``)."""
        name = self.config.name
        if name == "prompt_lookup":
            return {
                "prompt_lookup_num_tokens": int(self.config.tokens),
                "max_matching_ngram_size": int(self.config.ngram),
            }
        if name in ("draft", "self"):
            return {"assistant_model": self.draft}
        return {}

    @contextmanager
    def counting(self) -> Iterator["Speculation"]:
        """Count the target's passes and the candidate generator's drafts while the block runs, from zero."""
        self.passes = self.drafted = self.accepted = self.verifications = 0
        self.lookup_tokens, self.stopped = int(self.config.tokens), False
        self.value = DraftValue(replay=self.replay)
        if self.draft is not None:  # transformers keeps the adapted count on the draft: each generate starts afresh
            self.draft.generation_config.num_assistant_tokens = int(self.config.tokens)
            self.draft.generation_config.num_assistant_tokens_schedule = (
                "heuristic" if self.config.adaptive else "constant"
            )
        handles = [
            self.target.register_forward_pre_hook(self._count_pass, with_kwargs=True),
            self.target.register_forward_hook(self._time_pass),
        ]
        # transformers builds its candidate generator per generate call; the instance attribute wraps the one it builds
        self.target._get_candidate_generator = self._candidate_generator
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            del self.target._get_candidate_generator

    def _count_pass(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.passes += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        # the first pass (the prompt) is not a decoding pass: left out of the times
        self._started = (ids.shape[-1], time.perf_counter()) if self.passes > 1 and ids is not None else None

    def _time_pass(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._started is not None:
            tokens, started = self._started
            self.value.timed(tokens, time.perf_counter() - started)
            self._started = None

    def _candidate_generator(self, *args: Any, **kwargs: Any) -> Any:
        generator = type(self.target)._get_candidate_generator(self.target, *args, **kwargs)
        get, update = generator.get_candidates, generator.update_candidate_strategy
        lookup = hasattr(generator, "num_output_tokens")
        last = [0]

        def get_candidates(input_ids: torch.Tensor, **kw: Any) -> Any:
            if self.stopped:  # no candidates: transformers checks none and decodes one token, as without speculation
                last[0] = 0
                return input_ids, None
            if lookup and self.config.adaptive:
                generator.num_output_tokens = self.lookup_tokens
            out = get(input_ids, **kw)
            last[0] = int(out[0].shape[-1] - input_ids.shape[-1])
            if lookup and self.config.adaptive and last[0] and not self.value.pays(last[0]):
                last[0] = 0  # this draft would cost its pass more than it is expected to win: one token decoded
                return input_ids, None
            self.drafted += last[0]
            return out

        def update_candidate_strategy(input_ids: torch.Tensor, scores: torch.Tensor, num_matches: Any) -> Any:
            if self.stopped:
                return None
            matched = int(num_matches)
            self.accepted += matched
            self.verifications += int(last[0] > 0)
            if lookup and last[0]:
                self.lookup_tokens = next_lookup_tokens(self.lookup_tokens, last[0], matched, int(self.config.tokens))
                self.value.checked(matched)
            low = self.accepted < float(self.config.min_acceptance) * self.drafted
            self.stopped = self.verifications >= int(self.config.probe) and low
            return update(input_ids, scores, num_matches)

        generator.get_candidates, generator.update_candidate_strategy = get_candidates, update_candidate_strategy
        return generator

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``target.generate`` with this speculation, counted (read :meth:`figures` after)."""
        with self.counting():
            return self.target.generate(input_ids, **self.kwargs, **kwargs)

    def figures(self, generated: int) -> dict[str, Any]:
        """The run's speculation figures for ``generated`` new tokens."""
        return {
            "speculative": self.config.name,
            "target_passes": self.passes,
            "tokens_per_pass": generated / self.passes if self.passes else math.nan,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else math.nan,
            "drafting_stopped": self.stopped,
            "drafts_skipped": self.value.skipped,
            "draft_decisions": self.value.decisions,
        }


def next_lookup_tokens(current: int, drafted: int, matched: int, most: int) -> int:
    """Prompt lookup's next draft length: 2 more when every drafted token was accepted, 1 fewer when one was not
    (transformers' "heuristic" schedule for a draft model), within [1, ``most``]."""
    return min(current + 2, most) if matched >= drafted else max(1, current - 1)


def prepare(
    value: Any,
    target: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    replay: str | None = None,
) -> Speculation:
    """The :class:`Speculation` ``value`` (see :func:`read_speculative`) asks of ``target``: for ``draft`` the
    checkpoint loaded on ``device`` (default: where the target runs), for ``self`` the target's first layers shared;
    ``replay``: another run's ``draft_decisions``, to check the drafts it checked."""
    from offload_core.speculative.drafts import load_draft, self_draft, self_layers

    config = read_speculative(value)
    if config.name == "self":
        return Speculation(config, target, self_draft(target, self_layers(target, config.layers)), replay)
    if config.name == "draft":
        dtype = dtype or next(target.parameters()).dtype
        device = torch.device(device) if device is not None else _run_device(target)
        return Speculation(config, target, load_draft(config.path, target, dtype, device), replay)
    return Speculation(config, target, replay=replay)


def _run_device(target: nn.Module) -> torch.device:
    state = getattr(target, "offload_state", None)
    return state.execution_device if state is not None else next(target.parameters()).device
