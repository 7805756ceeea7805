"""The main job end to end: SmolLM2 with part of it on disk answers like the in-memory model, in this process and as
`python run.py`."""

from __future__ import annotations

import json
import sys

import pytest

from offload_core.runner.job import run
from offload_core.planning.headroom import RUNTIME_SLACK, runtime_slack
from tests import ROOT, preloaded


@pytest.fixture(scope="module")
def main_job(tmp_path_factory, compose_run):
    out = tmp_path_factory.mktemp("main_job")
    cfg = compose_run(["compare_in_memory=true", "progress=false", "max_new_tokens=12"])
    return run(cfg, output_dir=out), out


def test_main_job_answers_paris_with_weights_on_disk(main_job):
    result, out = main_job
    assert "Paris" in result.text
    assert result.matches_in_memory is True
    devices = result.summary["devices"]
    assert devices["disk"]["bytes"] > 0 and devices["cpu"]["bytes"] > 0
    assert result.figures["bytes_moved_per_token"] > 0


def test_main_job_writes_its_files(main_job):
    result, out = main_job
    device_map = json.loads((out / "device_map.json").read_text())
    assert device_map == result.device_map
    metrics = json.loads((out / "metrics.json").read_text())
    for key in (
        "prompt",
        "text",
        "token_ids",
        "load_s",
        "time_to_first_token_s",
        "decode_tokens_per_s",
        "peak_anon_rss_bytes",
        "peak_file_rss_bytes",
        "bytes_moved_per_token",
    ):
        assert key in metrics, key
    assert metrics["token_ids"] == result.token_ids
    assert metrics["text"] == result.text


def test_budget_is_used_and_reported(main_job):
    result, _ = main_job
    cpu = result.summary["devices"]["cpu"]
    # 200 MiB budget less the planned KV cache and activations and the runtime's slack, no reservation needed for a
    # zero-copy mapped read on CPU.
    slack = runtime_slack(200 * 2**20)  # a quarter of this budget: less than RUNTIME_SLACK
    planned = result.figures["planned_kv_cache_bytes"] + result.figures["planned_activation_bytes"] + slack
    assert slack == 50 * 2**20 < RUNTIME_SLACK
    assert result.plan["headroom"] == planned < 64 * 2**20
    assert cpu["bytes"] <= 200 * 2**20 - planned
    assert cpu["bytes"] > 0.6 * 200 * 2**20
    assert result.plan["reserve"] == {"cpu": 0}


def test_run_py_main_job_subprocess(tmp_path):
    """`python run.py` as a user runs it: exit 0, the answer printed, files in Hydra's run folder."""
    proc = preloaded.run(
        [sys.executable, str(ROOT / "run.py"), f"hydra.run.dir={tmp_path}", "progress=false", "max_new_tokens=10"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert "disk:" in proc.stdout
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "device_map.json").exists()


@pytest.mark.parametrize("hook", ["prefetch", "experts"])
def test_run_py_with_reader_threads_exits(hook, tmp_path):
    """A run whose module hooks start reader threads exits once it is done (Python joins non-daemon threads at
    exit: a reader left waiting hangs the process, which the timeout turns into a failure)."""
    proc = preloaded.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "model=synthetic",
            f"hook={hook}",
            "max_memory.cpu=1KiB",
            "headroom=0",
            "page_cache=0",
            "max_new_tokens=3",
            "progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    counters = metrics[hook]  # the policy's counters, under its name
    assert counters["streamed_blocks"] > 0 and counters["hits"] > 0
