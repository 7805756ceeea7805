"""The ``serve`` keys read once into typed options, and the number of concurrent requests the plan holds memory for
(the KV cache of ``serve.context`` tokens per request, planned with the run's budgets, never guessed)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from offload_core.errors import ConfigError
from offload_core.plan.batches import Batches
from offload_core.plan.run_memory import context_length, plan_run_memory
from offload_core.runner.settings import Settings

#: the environment variable holding the API key when ``serve.api_key`` is not given
API_KEY_ENV = "OFFLOAD_CORE_API_KEY"
#: the most concurrent requests ``serve.max_batch=auto`` plans for
AUTO_MAX_BATCH = 16


@dataclass(frozen=True)
class ServeOptions:
    """The server's keys, checked: where it listens, who may call it, what each request may hold and how many wait."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    context: int = 1024
    max_batch: int | None = None  # None: auto
    max_queue: int = 64
    max_tokens: int = 256
    exact: bool = False
    shutdown_timeout: float = 30.0
    replicas: int = 1
    ray_address: str | None = None
    replica_cpus: float = 1.0

    @property
    def replicated(self) -> bool:
        """Served by Ray Serve replicas rather than one server in this process."""
        return self.replicas > 1 or self.ray_address is not None


def read_options(section: dict) -> ServeOptions:
    """The ``serve`` section as :class:`ServeOptions`; a value that cannot be used is a :class:`ConfigError`."""
    raw = {f.name: section[f.name] for f in dataclasses.fields(ServeOptions) if section.get(f.name) is not None}
    max_batch = str(raw.pop("max_batch", "auto"))
    options = ServeOptions(**raw)
    if max_batch != "auto":
        if not max_batch.isdigit() or int(max_batch) < 1:
            raise ConfigError(f"serve.max_batch={max_batch} must be auto or a number of requests of at least 1")
        options = dataclasses.replace(options, max_batch=int(max_batch))
    if not options.host.strip():  # an empty address listens on every interface: never by accident
        raise ConfigError(
            "serve.host is empty: give the address to listen on (127.0.0.1: this machine only; 0.0.0.0: every "
            "interface)"
        )
    if not 0 <= options.port <= 65535:
        raise ConfigError(f"serve.port={options.port} is not a port: give 0 (any free port) to 65535")
    for key in ("context", "max_tokens"):
        if getattr(options, key) < 1:
            raise ConfigError(f"serve.{key}={getattr(options, key)} must be at least 1")
    if options.max_queue < 0:
        raise ConfigError(f"serve.max_queue={options.max_queue} must be 0 or more")
    if options.replicas < 1:
        raise ConfigError(f"serve.replicas={options.replicas} must be at least 1")
    if not (math.isfinite(options.replica_cpus) and options.replica_cpus >= 0):
        raise ConfigError(f"serve.replica_cpus={options.replica_cpus} must be 0 or more cores")
    if not (math.isfinite(options.shutdown_timeout) and options.shutdown_timeout >= 0):
        raise ConfigError(f"serve.shutdown_timeout={options.shutdown_timeout} must be 0 or more seconds")
    if options.api_key is None and os.environ.get(API_KEY_ENV):
        options = dataclasses.replace(options, api_key=os.environ[API_KEY_ENV])
    return options


def served_name(options: ServeOptions, model_section: dict) -> str:
    """The name clients give as ``model``: ``serve.model_name``, else the model folder's name, else ``model.name``."""
    if options.model_name:
        return options.model_name
    if model_section.get("path"):
        return Path(str(model_section["path"])).expanduser().resolve().name
    return str(model_section.get("name") or "model")


def serve_context(options: ServeOptions, config: Any) -> int:
    """Tokens one request may hold: ``serve.context``, at most the model's own context."""
    model = context_length(config)
    return min(options.context, model) if model else options.context


def serving_settings(settings: Settings) -> Settings:
    """``settings`` as the plan reads a server's: one new token after a prompt of the whole context (see
    :func:`slots_of`), and no prompt of its own to check."""
    sampling = dataclasses.replace(settings.sampling, max_new_tokens=1)
    return dataclasses.replace(settings, sampling=sampling, prompts_file=None)


def slots_of(settings: Settings, options: ServeOptions) -> Callable[[Any], Batches]:
    """``batches_of`` for :func:`offload_core.plan.prepare.prepare`: ``max_batch`` requests of the whole
    context, KV cache for each and the activations of one prefill at a time held back from the budget. With
    ``serve.max_batch=auto``, the most requests (up to :data:`AUTO_MAX_BATCH`) whose memory fits."""

    def batches(run_model: Any) -> Batches:
        context = serve_context(options, run_model.model.config)
        if context < 2:
            raise ConfigError(f"serve.context={context} leaves no room for a prompt and a token: give 2 or more")

        def rows(count: int) -> Batches:
            return Batches([""] * count, [[0] * (context - 1)] * count, count, prefill_rows=1)

        def fits(count: int) -> bool:
            try:
                plan_run_memory(settings, run_model, count, context - 1, prefill_rows=1)
            except ConfigError:
                return False
            return True

        if options.max_batch is not None:
            if not fits(options.max_batch):
                raise ConfigError(
                    f"serve.max_batch={options.max_batch} requests of serve.context={context} tokens do not fit the "
                    f"budget beside the weights; give serve.max_batch=auto (the most that fit), a smaller "
                    "serve.context, or raise max_memory"
                )
            return rows(options.max_batch)
        low, high = 0, AUTO_MAX_BATCH
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        if low == 0:
            raise ConfigError(
                f"one request of serve.context={context} tokens needs more memory for its KV cache and activations "
                "than the budget leaves beside the weights; give a smaller serve.context or raise max_memory"
            )
        return rows(low)

    return batches
