"""The server's figures in Prometheus' text format (``GET /metrics``): requests by route and status, the queue, the
tokens, the passes over the weights and how many tokens each made, the bytes moved per generated token."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "offload_core_serve"


class ServeMetrics:
    """The server's Prometheus metrics, in a registry of their own; ``moved()`` gives the bytes streamed so far."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, moved: Callable[[], int] = lambda: 0, slots: int = 1) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.waiting = Gauge(f"{PREFIX}_queue_waiting", "requests waiting for a slot", registry=r)
        self.active = Gauge(f"{PREFIX}_requests_active", "requests generating", registry=r)
        Gauge(f"{PREFIX}_slots", "requests the plan holds KV cache for", registry=r).set(slots)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated = Counter(f"{PREFIX}_generated_tokens", "tokens generated", registry=r)
        self.passes = Counter(
            f"{PREFIX}_forward_passes", "forwards over the model (passes over its weights)", registry=r
        )
        self.tokens_per_pass = Histogram(
            f"{PREFIX}_tokens_per_pass", "tokens one pass made", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.drafted = Counter(f"{PREFIX}_drafted_tokens", "tokens drafted by speculation and checked", registry=r)
        self.accepted = Counter(f"{PREFIX}_accepted_tokens", "drafted tokens the model accepted", registry=r)
        self.drafted_count = self.accepted_count = 0
        self.first_token = Histogram(f"{PREFIX}_time_to_first_token_seconds", "time to first token", registry=r)
        self.moved = moved
        self.generated_count = 0
        self.passes_count = 0
        self.prompt_count = 0
        self.bytes_moved = Gauge(f"{PREFIX}_bytes_moved", "bytes of offloaded weights moved since loading", registry=r)
        self.bytes_per_token = Gauge(
            f"{PREFIX}_bytes_moved_per_token", "bytes moved per generated token since loading", registry=r
        )

    def on_pass(self, tokens: int, prompt_tokens: int = 0) -> None:
        """One forward made ``tokens`` tokens (after ``prompt_tokens`` prefilled)."""
        self.passes.inc()
        self.tokens_per_pass.observe(tokens)
        self.generated.inc(tokens)
        self.generated_count += tokens
        self.passes_count += 1
        self.prompt_count += prompt_tokens
        self.prompt_tokens.inc(prompt_tokens)

    def on_drafts(self, drafted: int, accepted: int) -> None:
        """One forward checked ``drafted`` drafted tokens, of which ``accepted`` were kept."""
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.drafted_count += drafted
        self.accepted_count += accepted

    def text(self) -> bytes:
        """Every metric in Prometheus' text format, the bytes moved read now."""
        moved = self.moved()
        self.bytes_moved.set(moved)
        count = self.generated_count
        self.bytes_per_token.set(moved / count if count else 0)
        return generate_latest(self.registry)
