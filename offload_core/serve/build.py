"""What one server is made of once its model is loaded: how chats and texts become token ids, the engine, its metrics
and the ASGI app answering the OpenAI routes (for ``mode=serve`` in this process, and for each Ray Serve replica),
and the figures a server reports when it stops."""

from __future__ import annotations

import time
from typing import Any

from offload_core.errors import ConfigError
from offload_core.runner.inputs import byte_ids
from offload_core.serve.options import ServeOptions, serve_context, served_name
from offload_core.plan.prepare import Prepared


def encoders(job: Prepared) -> tuple[Any, Any]:
    """How a chat and a text become token ids: the tokenizer (its chat template for a chat), or for a model without
    either one id per byte of ``role: content`` lines."""
    tokenizer, vocab = job.run_model.tokenizer, job.run_model.model.config.vocab_size
    templated = tokenizer is not None and job.settings.chat_template

    def encode_text(text: str) -> list[int]:
        return tokenizer(text)["input_ids"] if tokenizer is not None else byte_ids(text, vocab)

    def encode_chat(messages: list[dict]) -> list[int]:
        if not templated:
            return encode_text("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; send the text to /v1/completions instead")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return ids[0] if ids and isinstance(ids[0], list) else ids

    return encode_chat, encode_text


def open_server(job: Prepared, run: Any, options: ServeOptions) -> tuple[Any, Any, Any]:
    """The loaded model's engine (not started), its metrics and the ASGI app answering the OpenAI routes."""
    # the serve extra's web stack (checked before loading): imported where a server is built
    from offload_core.serve.app import Served, build_app
    from offload_core.serve.engine import Engine
    from offload_core.serve.metrics import ServeMetrics

    settings, slots = job.settings, job.batches.rows
    context = serve_context(options, job.run_model.model.config)
    metrics = ServeMetrics(moved=lambda: run.state.stats.snapshot()["bytes"], slots=slots)
    model = job.run_model.model
    try:
        engine = Engine(
            model,
            job.run_model.tokenizer,
            settings.execution_device,
            slots,
            context,
            options.max_queue,
            options.exact,
            metrics,
            settings.speculative,
        )
    except TypeError as error:
        if settings.speculative.active:
            raise ConfigError(f"{error}: speculative=prompt_lookup cannot drop rejected drafts from them") from None
        raise ConfigError(f"{error}: give serve.exact=true (each request computes alone)") from None
    encode_chat, encode_text = encoders(job)
    name = served_name(options, settings.model)
    served = Served(name, encode_chat, encode_text, context, options.max_tokens, options.api_key, int(time.time()))
    return engine, metrics, build_app(engine, served)


def serve_figures(metrics: Any, run: Any) -> dict[str, Any]:
    moved = run.state.stats.snapshot()
    tokens = metrics.generated_count
    answered = sum(
        sample.value
        for family in metrics.requests.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("route", "").startswith("/v1/")
    )
    return {
        "mode": "serve",
        "requests": int(answered),
        "prompt_tokens": metrics.prompt_count,
        "generated_tokens": tokens,
        "forward_passes": metrics.passes_count,
        "tokens_per_pass": tokens / metrics.passes_count if metrics.passes_count else 0.0,
        "drafted_tokens": metrics.drafted_count,
        "accepted_tokens": metrics.accepted_count,
        "bytes_moved_per_token": moved["bytes"] / tokens if tokens else 0.0,
        "offloaded_bytes": run.state.offloaded_bytes(),
        "load_s": run.load_s,
    }
