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
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--calls", "3", "--warmup", "1",
                           "--policies", "prefetch", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["policy"] for run in runs] == ["prefetch"] and runs[0]["calls"] == 3
