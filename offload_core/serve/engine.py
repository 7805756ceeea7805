"""Continuous batching: one thread runs the model, each step one forward that makes the next token of every request
generating (one pass over the streamed weights for all of them); requests join after a prefill of their own and leave
between steps, at most as many at once as the plan holds KV cache for, the rest waiting in a bounded queue."""

from __future__ import annotations

import collections
import inspect
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from offload_core.jobs.batch import eos_ids, left_padded
from offload_core.jobs.generate import pad_token_id
from offload_core.runner.inputs import decode
from offload_core.serve.cache import BatchCache, check_mergeable, with_room
from offload_core.serve.logprobs import TokenLogprob, token_logprob
from offload_core.serve.metrics import ServeMetrics
from offload_core.serve.sampling import Detokenizer, Params, Picker
from offload_core.serve.speculate import Drafter, accept, draft_inputs, drafts, speculating

_ids = itertools.count(1)


class QueueFull(Exception):
    """Every slot is taken and the queue holds ``serve.max_queue`` requests."""


class Draining(Exception):
    """The server is shutting down and admits no request."""


@dataclass
class Event:
    """What a request made in a step: a piece of text, and at its end why it finished (or the error that ended it)."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the step's token, when its request asked

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Request:
    """A request as the engine runs it: its prompt ids, what it asked for and where its events go (``emit`` is called
    from the engine's thread)."""

    prompt: list[int]
    params: Params
    emit: Callable[[Event], None] = lambda event: None
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False
    finish_reason: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    picker: Picker | None = None
    text: Detokenizer | None = None
    lookup: int = 0  # prompt lookup: the tokens it drafts next (adapts)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled


@dataclass
class Group:
    """Requests that share one forward, row i of ``cache`` being ``rows[i]``."""

    rows: list[Request]
    cache: BatchCache


class Engine:
    """Runs ``model`` over the requests it is given: at most ``slots`` generate at once, each holding up to
    ``context`` tokens; ``max_queue`` more wait. ``exact``: each request computes in a forward of its own, so its
    tokens are those it gets alone (the pass over the weights is not shared). ``speculative``: prompt lookup, each
    request drafting from its own text and every request's drafts checked in the step's one forward."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        slots: int,
        context: int,
        max_queue: int = 64,
        exact: bool = False,
        metrics: ServeMetrics | None = None,
        speculative: Any = None,
    ) -> None:
        from transformers import DynamicCache

        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.slots, self.context, self.max_queue, self.exact = slots, context, max_queue, exact
        self.metrics = metrics or ServeMetrics(slots=slots)
        self.eos = eos_ids(model)
        pad = pad_token_id(model)
        self.pad = 0 if pad is None else int(pad)
        self.groups: list[Group] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.admitting = True
        self.stopping = False
        self.prefilled_last = False
        self.thread: threading.Thread | None = None
        self.finished: list[tuple[Request, Event]] = []  # a pass's last events, sent once its counters are in
        self.gather_quiet_s, self.gather_s = 0.005, 0.03  # see :meth:`gather`
        params = inspect.signature(model.forward).parameters
        self.cache_key = "cache" if "cache" in params else "past_key_values"
        self.keep_logits = "logits_to_keep" in params
        self.new_cache = lambda: with_room(DynamicCache(config=model.config), context)
        spec = speculating(speculative)
        self.drafter = Drafter(spec, self.eos, context) if spec is not None else None
        if not exact or spec is not None:  # speculation drops rejected columns row by row
            check_mergeable(self.new_cache())

    # -- the requests' side (any thread) --

    @property
    def active(self) -> int:
        return sum(len(g.rows) for g in self.groups)

    def submit(self, request: Request) -> None:
        """Queue ``request``; :class:`QueueFull` when the queue is full, :class:`Draining` when shutting down."""
        with self.lock:
            if not self.admitting:
                raise Draining()
            if len(self.waiting) >= self.max_queue + max(self.slots - self.active, 0):
                raise QueueFull()
            request.picker = Picker(request.params, self.device)
            request.text = Detokenizer(self.tokenizer, request.params.stop)
            self.waiting.append(request)
            self.metrics.waiting.set(len(self.waiting))
            self.lock.notify_all()

    def cancel(self, request: Request) -> None:
        """Stop generating for ``request`` (its client went away): its slot and KV cache are freed at the next step."""
        with self.lock:
            request.cancelled = True
            self.lock.notify_all()

    def idle(self) -> bool:
        with self.lock:
            return not self.waiting and not self.groups

    # -- the engine's thread --

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="offload_core-serve", daemon=True)
        self.thread.start()

    def drain(self) -> None:
        """Admit no new request; those queued and generating go on."""
        with self.lock:
            self.admitting = False

    def stop(self, error: str = "the server is shutting down: the request was cancelled") -> None:
        """Stop the loop after its current forward; every request left ends with ``error``."""
        with self.lock:
            self.admitting = False
            self.stopping = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join()
        for request in [*self.waiting, *(r for g in self.groups for r in g.rows)]:
            if not request.done:
                request.emit(Event(error=error))
        self.waiting.clear()
        self.groups.clear()

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self.lock:
                    if self.stopping:
                        return
                if not self.groups:
                    self.gather()
                try:
                    worked = self.step()
                except Exception as error:  # a fault outside a forward: those generating fail, the server goes on
                    self._fail([r for g in self.groups for r in g.rows], error)
                    self.groups.clear()
                    self.metrics.active.set(0)
                    continue
                if not worked:
                    with self.lock:
                        if not self.stopping and not self.waiting:
                            self.lock.wait(timeout=0.5)

    def gather(self) -> None:
        """Requests sent together arrive over a few milliseconds: when the engine is idle and one has come, wait until
        none more comes for ``gather_quiet_s`` (at most ``gather_s`` in all; not once they fill the free slots), so
        that they are prefilled in one forward, not the first alone and the others a pass later."""
        deadline = time.perf_counter() + self.gather_s
        with self.lock:
            seen = len(self.waiting)
            while seen and not self.stopping and seen < self.slots - self.active:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                self.lock.wait(timeout=min(self.gather_quiet_s, left))
                if len(self.waiting) == seen:
                    return
                seen = len(self.waiting)

    def step(self) -> bool:
        """One forward: the prefill of the requests admitted now, or the next token of every request generating
        (a prefill never follows a prefill while others wait for their token). False when there was nothing to do."""
        self._drop_cancelled()
        newcomers = self._admit() if not (self.prefilled_last and self.groups) else []
        if newcomers:
            self.prefilled_last = True
            if self.exact:
                for request in newcomers:
                    self._prefill([request])
            else:
                self._prefill(newcomers)
            return True
        self.prefilled_last = False
        if not self.groups:
            return False
        for group in list(self.groups):
            self._decode(group)
        return True

    def _drop_cancelled(self) -> None:
        with self.lock:
            kept = [r for r in self.waiting if not r.cancelled]
            self.waiting.clear()
            self.waiting.extend(kept)
            self.metrics.waiting.set(len(kept))
        for group in list(self.groups):
            self._keep_unfinished(group)

    def _admit(self) -> list[Request]:
        """The waiting requests that start now: as many as free slots, their padded prompts within one context."""
        taken: list[Request] = []
        with self.lock:
            free = self.slots - self.active
            while self.waiting and len(taken) < free:
                longest = max([len(r.prompt) for r in taken] + [len(self.waiting[0].prompt)])
                if taken and (len(taken) + 1) * longest > self.context:
                    break
                taken.append(self.waiting.popleft())
            self.metrics.waiting.set(len(self.waiting))
        return taken

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, keep: int = 1
    ) -> torch.Tensor:
        """The logits of each row's last position (rows x vocab), or of its last ``keep`` (rows x keep x vocab)."""
        kwargs = {self.cache_key: cache, "use_cache": True, "return_dict": True}
        if self.keep_logits:
            kwargs["logits_to_keep"] = keep
        device = self.device
        out = self.model(
            input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device), **kwargs
        )
        logits = out.logits[:, -1] if keep == 1 else out.logits[:, -keep:]
        return logits.to(copy=True, dtype=torch.float32)

    def _prefill(self, requests: list[Request]) -> None:
        ids, mask = left_padded([r.prompt for r in requests], self.pad)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = self.new_cache()
        group = Group(list(requests), BatchCache(cache, mask))
        try:
            logits = self._forward(ids, mask, positions, cache)
        except Exception as error:  # the forward failed: these requests fail, the others go on
            self._fail(requests, error)
            return
        self.metrics.on_pass(len(requests), sum(len(r.prompt) for r in requests))
        self._deliver(group, logits)
        if not self.exact and self.groups:
            main = self.groups[0]
            main.cache.join(group.cache)
            main.rows += group.rows
            self._keep_unfinished(main)
        else:
            self.groups.append(group)
            self._keep_unfinished(group)
        self.metrics.active.set(self.active)

    def _decode(self, group: Group) -> None:
        drafted = drafts(self, group)
        ids, positions, width = draft_inputs(self, group, drafted)
        mask = group.cache.grow(width)
        try:
            logits = self._forward(ids, mask, positions, group.cache.cache, keep=width)
        except Exception as error:
            self.groups.remove(group)
            self._fail(group.rows, error)
            return
        if width > 1:
            accept(self, group, logits, drafted)
        else:
            self.metrics.on_pass(len(group.rows))
            self._deliver(group, logits)
        self._keep_unfinished(group)
        self.metrics.active.set(self.active)

    def _deliver(self, group: Group, logits: torch.Tensor) -> None:
        for row, request in enumerate(group.rows):
            self.give(request, logits[row])
        self.send_finished()

    def give(self, request: Request, logits: torch.Tensor) -> int | None:
        """Pick ``request``'s next token from ``logits`` (vocab) and send it; the token, or None when the request
        had ended or fails here."""
        if request.done:
            return None
        try:
            token = request.picker.pick(logits)
            if request.first_token_s is None:
                request.first_token_s = time.perf_counter() - request.submitted
                self.metrics.first_token.observe(request.first_token_s)
            request.tokens.append(token)
            event = self._event(request, token)
            if request.params.logprobs is not None and token not in self.eos:
                top = request.params.logprobs
                event.logprobs.append(token_logprob(logits, token, top, self._token_text))
        except Exception as error:  # this request fails alone (its sampling, its text)
            request.finish_reason = "error"
            request.emit(Event(error=f"{type(error).__name__}: {error}"))
            return None
        request.finish_reason = event.finish_reason
        if event.finish_reason is None:
            request.emit(event)
        else:  # the response ends with it: sent by :meth:`send_finished`, after the pass's counters
            self.finished.append((request, event))
        return token

    def send_finished(self) -> None:
        """Send the requests that ended in this pass their last event (the metrics a client reads after its response
        count its tokens)."""
        finished, self.finished = self.finished, []
        for request, event in finished:
            request.emit(event)

    def _event(self, request: Request, token: int) -> Event:
        text = request.text
        if token in self.eos:
            return Event(text.rest(), "stop")
        last = len(request.tokens) >= request.params.max_tokens
        piece = text.feed(token, last)
        if text.stopped:
            return Event(piece, "stop")
        return Event(piece, "length" if last else None)

    def _token_text(self, token: int) -> str:
        return decode(self.tokenizer, [token], skip_special_tokens=False)

    def _keep_unfinished(self, group: Group) -> None:
        rows = [i for i, r in enumerate(group.rows) if not r.done]
        if len(rows) == len(group.rows):
            return
        if not rows:
            self.groups.remove(group)
            return
        group.cache.keep(rows)
        group.rows = [group.rows[i] for i in rows]

    def _fail(self, requests: list[Request], error: BaseException) -> None:
        for request in requests:
            if not request.done:
                request.finish_reason = "error"
                request.emit(Event(error=f"the model failed on this request: {type(error).__name__}: {error}"))
