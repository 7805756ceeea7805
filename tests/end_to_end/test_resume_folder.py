"""``resume=<run folder>`` as users run it: the resumed run writes into that folder and makes no new, empty run folder
of its own; the folder keeps the record of the run that made it; a folder that is not there is one line and nothing is
made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env

ARGS = ["model=synthetic", "prompts=prompts.txt", "batch_size=2", "max_new_tokens=2", "progress=false"]


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return preloaded.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=cwd,
        timeout=300,
    )


def test_a_resumed_run_goes_on_in_its_folder_and_makes_no_other(tmp_path):
    (tmp_path / "prompts.txt").write_text("What is the capital of France?\nName three colours.\nA haiku on disks.\n")
    first = _run(tmp_path, *ARGS, "hydra.run.dir=runs/a")
    assert first.returncode == 0, first.stderr
    run = tmp_path / "runs" / "a"
    record = (run / ".hydra" / "overrides.yaml").read_text()
    lines = (run / "generations.jsonl").read_text().splitlines()
    (run / "generations.jsonl").write_text(lines[0] + "\n")  # as if it stopped in the first batch
    resumed = _run(tmp_path, *ARGS, "resume=runs/a")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt", "runs"]  # no outputs/<date>/<time>/
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["a"]
    assert (run / "generations.jsonl").read_text().splitlines() == lines
    assert (run / ".hydra" / "overrides.yaml").read_text() == record  # the record of the run that made it
    assert "resume=runs/a" in json.loads((run / "metrics.json").read_text())["overrides"]

    missing = _run(tmp_path, *ARGS, "resume=runs/b")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "offload_core: error: resume=runs/b is not a folder: give the folder of the run to go on with "
        "(e.g. resume=outputs/2026-01-31/12-00-00)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt", "runs"]
