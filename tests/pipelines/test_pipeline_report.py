"""What a pipeline run prints: its plan's predicted bytes per denoising step and per image (never per generated
token), what it measured beside them, and whether its images equal diffusers' in-memory ones."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import ROOT, preloaded
from tests.pipelines.test_pipeline_run import _cfg

from offload_core.runner.job import run


def test_the_plan_predicts_per_denoising_step_and_per_image(pipeline_dir, tmp_path, capsys):
    cfg = _cfg(
        [f"model.path={pipeline_dir}", "model=local", "max_memory.cpu=500KiB", "hook=prefetch", "plan_only=true"]
    )
    run(cfg, output_dir=tmp_path, plot=False)
    out = capsys.readouterr().out
    assert "per generated token" not in out and "KV cache" not in out
    assert "held back from the budget of the device that computes, for the activations of the pipeline's call" in out
    assert "predicted bytes moved per denoising step: " in out
    assert "predicted bytes moved per image (20 denoising steps): " in out
    assert "disk" in json.loads((tmp_path / "device_map.json").read_text()).values()


@pytest.mark.slow
def test_a_run_says_whether_it_matched_in_memory_and_moves_what_it_predicted(pipeline_dir, tmp_path):
    """The diffusion recipe's command at 450 KiB: chained, the tiny pipeline's 442 KiB offloaded in part, the
    denoiser's offloaded part in two units (at the recipe's 500 KiB one, which stays loaded from step to step)."""
    command = [sys.executable, str(ROOT / "run.py"), "model=local", f"model.path={pipeline_dir}", "prompt=a red cube"]
    command += ["pipeline.num_inference_steps=2", "max_memory.cpu=450KiB", "hook=chained", "compare_in_memory=true"]
    command += ["progress=false", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = preloaded.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "same images as in memory (bit for bit): True" in lines
    assert not any("per generated token" in line for line in lines)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["matches_in_memory"] is True
    assert metrics["bytes_moved_per_step"] > 0 and metrics["predicted_bytes_moved_per_step"] > 0
    # the first step's window opens with the call: it also counts the offloaded text encoder's move
    assert metrics["bytes_moved_by_step"][1:] == [metrics["predicted_bytes_moved_per_step"]]
    assert metrics["bytes_moved_per_image"] == metrics["predicted_bytes_moved_per_image"] == metrics["bytes_moved"]
