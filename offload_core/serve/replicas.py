"""``serve.replicas`` / ``serve.ray_address``: copies of the server behind Ray Serve's HTTP proxy. Each replica is a
Ray Serve deployment replica that plans and loads its own offloaded model and answers the same OpenAI routes; one
command starts a local Ray (or joins a cluster), deploys them on ``serve.host``:``serve.port``, and on SIGTERM or
Ctrl-C shuts them down (each finishes or cancels its requests and writes its figures) and exits 0."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from offload_core.errors import ConfigError
from offload_core.jobs.context import loaded
from offload_core.jobs.results import RunResult, write_outputs
from offload_core.serve.build import open_server, serve_figures
from offload_core.serve.options import ServeOptions, served_name, slots_of
from offload_core.plan.prepare import Prepared, prepare
from offload_core.runner.settings import build_strategies

#: the name of the Ray Serve application and deployment
APP = "offload_core"
#: the figures each replica writes and the command sums
SUMMED = ("requests", "prompt_tokens", "generated_tokens", "forward_passes", "drafted_tokens", "accepted_tokens")


class Replica:
    """One server in a replica's process: the plan prepared and the model loaded as the command planned them, the
    engine started; its figures go to ``replica-<id>/metrics.json`` in the run's output folder when it stops."""

    def __init__(self, settings: Any, options: ServeOptions) -> None:
        from ray import serve  # the ray extra: imported where a replica runs

        self.closed = True  # until it serves: nothing to close (Ray may drop a replica whose start failed)
        context = serve.get_replica_context()
        tag = str(getattr(getattr(context, "replica_id", None), "unique_id", None) or context.replica_tag)
        out = Path(settings.output_dir) / f"replica-{tag}"
        out.mkdir(parents=True, exist_ok=True)
        self.settings, self.options = dataclasses.replace(settings, output_dir=out), options
        self.stack = contextlib.ExitStack()
        strategies = build_strategies(self.settings)
        self.job = self.stack.enter_context(
            prepare(self.settings, strategies, batches_of=slots_of(settings, options), predict=False)
        )
        self.run = self.stack.enter_context(loaded(self.job))
        self.engine, self.metrics, self.routes = open_server(self.job, self.run, options)
        self.engine.start()
        self.closed = False

    def __serve_build_asgi_app__(self) -> Any:
        return self.routes

    def close(self) -> None:
        """No new request; those generating get ``serve.shutdown_timeout`` seconds; then the figures are written."""
        if self.closed:
            return
        self.closed = True
        self.engine.drain()
        deadline = time.monotonic() + self.options.shutdown_timeout
        while self.engine.active and time.monotonic() < deadline:
            time.sleep(0.05)
        self.engine.stop()
        figures = serve_figures(self.metrics, self.run)
        write_outputs(RunResult.of_plan(self.job.plan, self.settings.output_dir, figures), None, {})
        self.stack.close()

    def __del__(self) -> None:  # Ray Serve's replica shutdown
        if not getattr(self, "closed", True):
            self.close()


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now (``serve.port=0``: Ray Serve's proxy needs a number)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_ray(options: ServeOptions) -> Any:
    """Ray and Ray Serve, or one line saying how to install them; a cluster that cannot be reached is one line."""
    if options.ray_address is None and not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(os.environ):
        # A local cluster of this command's own, with token authentication: its token lives in this process's
        # environment (set before Ray is imported, and inherited by Ray's processes), not in ~/.ray/auth_token, where
        # Ray would write one that this user's other Ray clusters then read.
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    try:  # the ray extra
        import ray
        from ray import serve
    except ImportError as error:
        raise ConfigError(
            f"serve.replicas needs Ray Serve ({error.name} is missing): pip install 'offload_core[ray]'"
        ) from None
    try:
        ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as error:
        first = (str(error).strip().splitlines() or [""])[0]
        raise ConfigError(f"cannot join the Ray cluster at {options.ray_address} ({first}): check serve.ray_address")
    return serve


def wait_for_signal() -> None:
    """Block until SIGTERM or Ctrl-C."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_replicas(job: Prepared, options: ServeOptions, labels: dict) -> RunResult:
    """Deploy ``serve.replicas`` replicas behind Ray Serve's proxy, serve until stopped, then sum their figures."""
    settings = job.settings
    serve = start_ray(options)
    import ray  # installed: start_ray imported it

    port = options.port or free_port(options.host)
    started = time.time()
    actor: dict[str, float] = {"num_cpus": options.replica_cpus}
    if settings.execution_device.type != "cpu":
        actor["num_gpus"] = 1  # one GPU of its own: Ray makes it the replica's cuda:0
        settings = dataclasses.replace(settings, execution_device=torch.device("cuda", 0))
    try:
        serve.start(http_options={"host": options.host, "port": port})
        deployment = serve.deployment(
            serve.ingress()(Replica),
            name=APP,
            num_replicas=options.replicas,
            ray_actor_options=actor,
            graceful_shutdown_timeout_s=options.shutdown_timeout + 10,
        )
        try:
            serve.run(deployment.bind(settings, options), name=APP, route_prefix="/")
        except RuntimeError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise ConfigError(
                f"the replicas did not start ({lines[-1] if lines else error}); the replicas' log lines above say why"
            ) from None
        where = f"[{options.host}]" if ":" in options.host else options.host
        print(
            f"serving {served_name(options, settings.model)!r} on http://{where}:{port}/v1: {options.replicas} "
            f"replicas behind Ray Serve, each {job.batches.rows} requests at once",
            flush=True,
        )
        wait_for_signal()
        print("stopping: the replicas finish or cancel their requests", flush=True)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    figures = replica_figures(settings.output_dir, since=started)
    result = RunResult.of_plan(job.plan, settings.output_dir, figures)
    write_outputs(result, None, labels)
    print(
        f"served {figures['requests']} requests over {figures['replicas']} replicas: {figures['generated_tokens']} "
        f"tokens in {figures['forward_passes']} passes",
        flush=True,
    )
    return result


def replica_figures(output_dir: Path, since: float = 0.0) -> dict[str, Any]:
    """The figures of the replicas that stopped after ``since`` (a time) summed: each wrote
    ``replica-*/metrics.json`` in ``output_dir`` (on a cluster, those that ran on this machine); an earlier run's, an
    unreadable one or a folder without one is skipped."""
    figures: dict[str, Any] = {"mode": "serve", "replicas": 0, **{key: 0 for key in SUMMED}}
    for path in sorted(Path(output_dir).glob("replica-*/metrics.json")):
        try:
            if path.stat().st_mtime < since:
                continue
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        data = data.get("figures", data)
        figures["replicas"] += 1
        for key in SUMMED:
            figures[key] += int(data.get(key) or 0)
    figures["per_replica_requests"] = figures["replicas"] and figures["requests"] / figures["replicas"]
    return figures
