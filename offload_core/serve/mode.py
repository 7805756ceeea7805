"""``python run.py mode=serve``: the prepared model loaded as planned, the engine started, the HTTP server on
``serve.host``:``serve.port`` until SIGTERM or Ctrl-C (then no new request, those in flight finish or are cancelled
after ``serve.shutdown_timeout``), and the server's figures written to ``metrics.json``; exits 0."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from typing import Any, Iterator

from offload_core.errors import ConfigError
from offload_core.runner.inputs import byte_ids
from offload_core.jobs.context import loaded
from offload_core.jobs.results import RunResult, write_outputs
from offload_core.serve.options import ServeOptions, read_options, serve_context, served_name
from offload_core.plan.prepare import Prepared
from offload_core.values import format_size


def check_servable(job: Prepared) -> None:
    """A server generates with a decoder-only model and plain decoding; anything else is one line before loading."""
    if job.run_model.task != "causal_lm":
        raise ConfigError(f"mode=serve serves causal_lm models; this one is {job.run_model.task}: use mode=run")
    if job.settings.speculative.name not in ("none", "prompt_lookup"):
        raise ConfigError(
            f"mode=serve does not run speculative={job.settings.speculative.name} yet: use speculative=prompt_lookup "
            "or leave speculative out"
        )


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


def bind(options: ServeOptions) -> socket.socket:
    """A listening socket on ``serve.host``:``serve.port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((options.host, options.port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise ConfigError(
            f"cannot listen on {options.host}:{options.port} ({error.strerror}); give another serve.port "
            "(0 picks a free one) or serve.host"
        ) from None
    return sock


def server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server whose SIGTERM or Ctrl-C first stops the engine admitting requests, and is not raised
        again once the server has stopped (the run ends with exit code 0)."""

        engine: Any = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
                return
            self.engine.drain()
            print(
                f"stopping: no new requests; {self.engine.active} generating finish within "
                f"{self.config.timeout_graceful_shutdown:g} s or are cancelled",
                flush=True,
            )
            self.should_exit = True

    return Server


def run_serve(job: Prepared, labels: dict) -> RunResult:
    """Load, serve until stopped, then write and print what was served."""
    try:
        import uvicorn

        from offload_core.serve.app import Served, build_app
        from offload_core.serve.engine import Engine
        from offload_core.serve.metrics import ServeMetrics
    except ImportError as error:
        raise ConfigError(
            f"mode=serve needs the serve extra ({error.name} is missing): pip install 'offload_core[serve]'"
        ) from None
    check_servable(job)
    settings = job.settings
    options = read_options(settings.sections["serve"])
    context = serve_context(options, job.run_model.model.config)
    slots = job.batches.rows
    sock = bind(options)
    with sock, loaded(job) as run:
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
        config = uvicorn.Config(
            build_app(engine, served),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=options.shutdown_timeout,
        )
        server = server_class()(config)
        server.engine = engine
        host, port = sock.getsockname()[:2]
        where = f"[{host}]" if ":" in host else host
        print(
            f"serving {name!r} on http://{where}:{port}/v1: {slots} requests at once of {context} tokens each "
            f"(serve.exact={str(options.exact).lower()}), {options.max_queue} more may wait",
            flush=True,
        )
        engine.start()
        try:
            server.run(sockets=[sock])
        finally:
            engine.stop()
        figures = serve_figures(metrics, run)
    result = RunResult.of_plan(job.plan, settings.output_dir, figures)
    write_outputs(result, None, labels)
    print(
        f"served {figures['requests']} requests: {figures['generated_tokens']} tokens in {figures['forward_passes']} "
        f"passes ({figures['tokens_per_pass']:.2f} per pass), moved "
        f"{format_size(int(figures['bytes_moved_per_token']))}/token"
        + (
            f", {figures['accepted_tokens']} of {figures['drafted_tokens']} drafted tokens accepted"
            if settings.speculative.active
            else ""
        ),
        flush=True,
    )
    return result


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
