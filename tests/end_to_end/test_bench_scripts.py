"""The benchmark scripts still run: ``bench/soak.py`` imports only what offload_core has (a few calls, one policy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import ROOT


def test_soak_runs_a_few_calls(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
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
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["policy"] for run in runs] == ["prefetch"] and runs[0]["calls"] == 3


def test_predict_sweep_writes_its_report(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
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
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = (tmp_path / "predict-sweep-t.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",ok," in row for row in rows[1:])  # a header, the first and the second run
    report = (tmp_path / "predict-sweep-t.md").read_text()
    assert (
        "run 2 step: median |error|" in report and "| synthetic:tiny | 0.5 | 1 | safetensors align_per_call |" in report
    )
    assert (tmp_path / "predict-sweep-t.png").stat().st_size > 1000
