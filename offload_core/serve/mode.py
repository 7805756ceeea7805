"""``python run.py mode=serve``: the prepared model loaded as planned, the engine started, the HTTP server on
``serve.host``:``serve.port`` until SIGTERM or Ctrl-C (then no new request, those in flight finish or are cancelled
after ``serve.shutdown_timeout``), and the server's figures written to ``metrics.json``; exits 0."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from typing import Any, Iterator

from offload_core.errors import ConfigError
from offload_core.jobs.context import loaded
from offload_core.jobs.results import RunResult, write_outputs
from offload_core.plan.prepare import Prepared
from offload_core.serve.build import open_server, serve_figures
from offload_core.serve.options import ServeOptions, read_options, serve_context, served_name
from offload_core.serve.replicas import run_replicas
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


def check_serve_extra() -> None:
    """The web stack of the serve extra is installed, or one line says how to install it."""
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"mode=serve needs the serve extra ({error.name} is missing): pip install 'offload_core[serve]'"
        ) from None


def run_serve(job: Prepared, labels: dict) -> RunResult:
    """Load, serve until stopped, then write and print what was served."""
    check_serve_extra()
    import uvicorn

    check_servable(job)
    settings = job.settings
    options = read_options(settings.sections["serve"])
    if options.replicated:
        return run_replicas(job, options, labels)
    context = serve_context(options, job.run_model.model.config)
    slots = job.batches.rows
    name = served_name(options, settings.model)
    sock = bind(options)
    with sock, loaded(job) as run:
        engine, metrics, app = open_server(job, run, options)
        config = uvicorn.Config(
            app,
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
