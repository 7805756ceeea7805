"""auto=true through the real command line: plan_only prints the ranked table and exits 0 having loaded nothing; a
run with auto=true runs the table's first row and records predicted against measured."""

from __future__ import annotations

import json
import sys

import pytest

from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env

TINY = ["model=synthetic", "progress=false", "max_new_tokens=3", "max_memory.cpu=1MiB", "headroom=0"]


def test_plan_only_auto_prints_the_ranked_table_and_exits_0(tmp_path):
    proc = preloaded.run(
        [
            sys.executable,
            "run.py",
            *TINY,
            "plan_only=true",
            "auto=true",
            "storage=safetensors",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    table = json.loads((tmp_path / "auto.json").read_text())
    assert "kept as given: storage" in proc.stdout and "fastest first" in proc.stdout
    assert all(row["configuration"].startswith("storage=safetensors ") for row in table)
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert table[0]["configuration"] in lines[0] and table[1]["configuration"] in lines[1]
    assert (tmp_path / "auto.csv").exists() and not (tmp_path / "generations.jsonl").exists()
    assert "Traceback" not in proc.stderr


def test_auto_runs_the_first_row_and_records_its_prediction(tmp_path):
    proc = preloaded.run(
        [sys.executable, "run.py", *TINY, "auto=true", "hook=chained", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    table = json.loads((tmp_path / "auto.json").read_text())
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["auto"] == table[0]["configuration"] and metrics["choices"]["hook"] == "chained"
    assert table[0]["configuration"].startswith(f"storage={metrics['choices']['storage']} hook=chained")
    assert metrics["predicted_step_s"] == metrics["prediction"]["step"]["predicted"]
    assert metrics["predicted_step_s"] == pytest.approx(table[0]["predicted_step_s"])  # the row that ran
    assert "predicted vs measured:" in proc.stdout
