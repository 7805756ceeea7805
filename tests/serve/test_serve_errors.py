"""What ``mode=serve`` refuses before it serves, each as one line: an unknown mode, a batch the budget cannot hold, a
draft model's speculation, a port already taken, a task that does not generate."""

from __future__ import annotations

import socket
import sys

import pytest

from offload_core.errors import ConfigError
from offload_core.runner.job import run
from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env
from tests.serve.tiny import save_tiny_chat_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


def serve(compose_run, tiny, tmp_path, *overrides: str):
    cfg = compose_run(["mode=serve", "model=local", f"model.path={tiny}", "progress=false", *overrides])
    return run(cfg, output_dir=tmp_path)


def test_an_unknown_mode_is_refused(compose_run, tiny, tmp_path):
    with pytest.raises(ConfigError, match="mode=talk is not a mode"):
        run(compose_run(["mode=talk", "model=local", f"model.path={tiny}"]), output_dir=tmp_path)


def test_a_batch_the_budget_cannot_hold_names_what_to_do(compose_run, tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"serve.max_batch=16 requests of serve.context=128 tokens do not fit"):
        serve(compose_run, tiny, tmp_path, "max_memory.cpu=700KiB", "serve.max_batch=16", "serve.context=4096")


@pytest.mark.slow  # whole runs (the quick subset stays under a minute)
def test_auto_admits_what_the_budget_holds(compose_run, tiny, tmp_path):
    from offload_core.serve.options import read_options, serving_settings, slots_of
    from offload_core.plan.model import open_model
    from offload_core.runner.settings import read_settings

    def slots(budget: str) -> int:
        cfg = compose_run(["mode=serve", "model=local", f"model.path={tiny}", f"max_memory.cpu={budget}"])
        settings = serving_settings(read_settings(cfg, tmp_path))
        run_model = open_model(settings.model, settings.dtype)
        return slots_of(settings, read_options(settings.sections["serve"]))(run_model).rows

    print({budget: slots(budget) for budget in ("700KiB", "1MiB", "3MiB")})
    assert 1 <= slots("700KiB") < slots("1MiB") < slots("3MiB") == 16
    with pytest.raises(ConfigError, match="one request of serve.context=128 tokens needs more memory"):
        slots("100KiB")


def test_a_draft_models_speculation_is_refused(compose_run, tiny, tmp_path):
    with pytest.raises(ConfigError, match="does not run speculative=self yet: use speculative=prompt_lookup"):
        serve(compose_run, tiny, tmp_path, "speculative=self")


def test_a_taken_port_is_one_line(compose_run, tiny, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve(compose_run, tiny, tmp_path, f"serve.port={port}")


@pytest.mark.slow
def test_the_command_line_says_one_line(tiny, tmp_path):
    done = preloaded.run(
        [
            sys.executable,
            "-m",
            "offload_core",
            "serve",
            "model=local",
            f"model.path={tiny}",
            "serve.max_queue=-1",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "offload_core: error: serve.max_queue=-1 must be 0 or more"


def test_an_empty_host_is_refused_not_every_interface(compose_run, tiny, tmp_path):
    for host in ("serve.host=", "serve.host=' '"):  # '' would listen on every interface
        with pytest.raises(ConfigError, match="serve.host is empty: give the address to listen on"):
            serve(compose_run, tiny, tmp_path, host)
