"""What a run says before its long steps, as users see it: a first run calibrating this machine says so before the plan
(and a later one does not), and a busy machine is said once, with the one-thread hint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from offload_core.plan.calibrate import MEASURING
from tests import ROOT
from tests.end_to_end.helpers import child_env


def _run(tmp_path: Path, name: str, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "run.py", "model=synthetic", "progress=false", f"hydra.run.dir={tmp_path / name}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


def test_a_fresh_machine_says_it_calibrates_before_the_plan_and_a_busy_one_says_so_once(tmp_path):
    env = {**child_env(), "OFFLOAD_CORE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2"}
    env.pop("OFFLOAD_CORE_CALIBRATION")  # beside that fresh cache, as a user's is
    lines = _run(tmp_path, "first", env, "plan_only=true").splitlines()
    assert lines.count(MEASURING) == 1
    assert lines.index(MEASURING) < next(i for i, line in enumerate(lines) if line.startswith("placement="))
    assert not any("machine is busy" in line for line in lines)

    busy = {**env, "OFFLOAD_CORE_BUSY_LOAD": "-1"}  # busy whatever the load
    lines = _run(tmp_path, "busy", busy, "max_new_tokens=2").splitlines()
    assert MEASURING not in lines  # calibrated by the first run (with as many threads: the key holds them)
    said = [line for line in lines if line.startswith("offload_core: the machine is busy")]
    assert len(said) == 1 and lines.index(said[0]) < next(i for i, x in enumerate(lines) if x.startswith("placement="))
    assert "torch computes with 2 threads" in said[0] and "OMP_NUM_THREADS=1 python run.py" in said[0]
    assert any(line.endswith("not learned from: the machine is busy)") for line in lines)
