"""The benchmark scripts still run: ``bench/soak.py`` imports only what offload_core has (a few calls, one policy);
``bench/diffusion.py --device cpu`` checks its GPU harness on the host."""

from __future__ import annotations

import json
import os
import sys

from tests import ROOT, preloaded


def test_soak_runs_a_few_calls(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = preloaded.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--calls",
            "3",
            "--warmup",
            "1",
            "--policies",
            "prefetch",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        nested=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["policy"] for run in runs] == ["prefetch"] and runs[0]["calls"] == 3


def test_predict_sweep_writes_its_report(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = preloaded.run(
        [
            sys.executable,
            str(ROOT / "bench" / "predict_sweep.py"),
            "--tag",
            "t",
            "--models",
            "synthetic:tiny",
            "--policies",
            "align_per_call",
            "--stores",
            "safetensors",
            "--budgets",
            "0.5",
            "--batches",
            "1",
            "--tokens",
            "2",
            "--timeout",
            "200",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        nested=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = (tmp_path / "predict-sweep-t.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",ok," in row for row in rows[1:])  # a header, the first and the second run
    report = (tmp_path / "predict-sweep-t.md").read_text()
    assert (
        "run 2 step: median |error|" in report and "| synthetic:tiny | 0.5 | 1 | safetensors align_per_call |" in report
    )
    assert (tmp_path / "predict-sweep-t.png").stat().st_size > 1000


def test_diffusion_device_harness_runs_on_the_cpu(tmp_path):
    """``bench/diffusion.py --device cpu``: ours on the host against the in-memory image; diffusers' offload modes,
    which need a GPU, are skipped with a note in the report."""
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench" / "diffusion.py"), "--device", "cpu", "--width", "64", "--steps", "1"]
    command += ["--size", "16", "--images", "1", "--folder", str(tmp_path / "pipe"), "--out", str(out)]
    command += ["--systems", "in-memory", "ours-auto", "diffusers-group-block"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = preloaded.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, nested=True)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "diffusion-cpu.json").read_text())
    rows = {row["system"]: row for row in report["rows"]}
    assert set(rows) == {"in-memory", "ours-auto"}
    assert rows["ours-auto"]["same_image"] is True and rows["ours-auto"]["bytes_moved_per_image"] > 0
    assert any("diffusers-group-block" in note and "skipped" in note for note in report["meta"]["notes"])
    assert "| ours-auto (prefetch) |" in (out / "diffusion-cpu.md").read_text()
