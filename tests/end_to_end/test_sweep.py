"""Sweeps: every combination runs, a failed one is a row (not a crashed sweep), and the summary is the same whichever
launcher ran it."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from offload_core.runner.sweep import COLUMNS, summarize

from tests import ROOT, preloaded

BASE = [
    "model=synthetic",
    "model.preset=tiny",
    "compare_in_memory=true",
    "progress=false",
    "max_new_tokens=4",
    "headroom=0",
]
#: columns that do not depend on timing or on the machine's memory
STABLE = [
    "job",
    "placement",
    "storage",
    "hook",
    "model",
    "overrides",
    "status",
    "matches_in_memory",
    "bytes_moved_per_token",
    "error",
]


def _sweep(tmp_path: Path, *overrides: str, launcher: str | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    sweep_dir = tmp_path / "sweep"
    args = [sys.executable, str(ROOT / "run.py"), "-m", *BASE, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    if launcher:
        args.append(f"hydra/launcher={launcher}")
    proc = preloaded.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    return proc, sweep_dir


def _csv(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory):
    return _sweep(
        tmp_path_factory.mktemp("basic"),
        "storage=memmap,safetensors",
        "hook=align_per_call,chained",
        "max_memory.cpu=1MiB,abc",
        "headroom=0",
    )


def test_every_combination_is_a_row(basic_sweep):
    proc, sweep_dir = basic_sweep
    assert proc.returncode == 1, proc.stderr  # four of the eight jobs failed (max_memory.cpu=abc)
    rows = _csv(sweep_dir)
    assert [r["job"] for r in rows] == [str(i) for i in range(8)]
    combos = {(r["storage"], r["hook"], r["overrides"].split()[-1]) for r in rows}
    assert len(combos) == 8
    assert list(rows[0]) == COLUMNS


def test_successful_rows_carry_figures_and_match_in_memory(basic_sweep):
    _, sweep_dir = basic_sweep
    ok = [r for r in _csv(sweep_dir) if "max_memory.cpu=1MiB" in r["overrides"]]
    assert len(ok) == 4
    for row in ok:
        assert row["status"] == "ok" and row["error"] == ""
        assert row["matches_in_memory"] == "True"
        assert int(row["bytes_moved_per_token"]) > 0  # half the model is on disk
        for key in ("load_s", "time_to_first_token_s", "decode_tokens_per_s", "peak_anon_rss_mib", "peak_file_rss_mib"):
            float(row[key])


def test_a_failed_combination_is_a_row_with_its_one_line_error(basic_sweep):
    proc, sweep_dir = basic_sweep
    failed = [r for r in _csv(sweep_dir) if r["status"] == "failed"]
    assert len(failed) == 4 and all("max_memory.cpu=abc" in r["overrides"] for r in failed)
    jobs = ", ".join(f"job {r['job']} (" for r in failed)
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("sweep summary: "))
    assert summary.startswith("sweep summary: 8 jobs ran, 4 failed: job ") and "max_memory.cpu=abc)" in summary
    assert all(f"job {r['job']} (" in summary for r in failed), (jobs, summary)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("offload_core: error: ")]
    assert len(errors) == 1 and errors[0].startswith("offload_core: error: 4 of 8 jobs of the sweep failed; job ")
    for row in failed:
        assert "max_memory.cpu='abc' is not a size" in row["error"] and "\n" not in row["error"]
        assert row["load_s"] == "" and row["matches_in_memory"] == ""


def test_markdown_table_and_plot(basic_sweep):
    _, sweep_dir = basic_sweep
    lines = (sweep_dir / "summary.md").read_text().splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(lines) == 2 + 8
    assert (sweep_dir / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_a_job_that_wrote_no_metrics_is_a_failed_row(tmp_path):
    job = tmp_path / "0" / ".hydra"
    job.mkdir(parents=True)
    (job / "overrides.yaml").write_text("- storage=memmap\n")
    (job / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      storage: memmap\n")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "metrics.json").write_text(
        json.dumps({"choices": {"storage": "safetensors"}, "load_s": 0.5, "matches_in_memory": None})
    )
    rows = summarize(tmp_path)
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert rows[0]["storage"] == "memmap" and rows[0]["overrides"] == "storage=memmap"
    assert "no metrics.json" in rows[0]["error"]
    assert rows[1]["matches_in_memory"] == ""


def _launcher_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher,module",
    [("joblib", "hydra_plugins.hydra_joblib_launcher"), ("submitit_local", "hydra_plugins.hydra_submitit_launcher")],
)
def test_hydra_launchers_give_the_same_summary(launcher, module, basic_sweep, tmp_path):
    if not _launcher_installed(module):
        pytest.skip(f"{module} is not installed (pip install -e '.[sweep]')")
    proc, sweep_dir = _sweep(
        tmp_path, "storage=safetensors", "hook=chained", "max_memory.cpu=1MiB,abc", "headroom=0", launcher=launcher
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # the max_memory.cpu=abc job failed
    rows = _csv(sweep_dir)
    assert list(rows[0]) == COLUMNS
    # The same combinations run in-process by the basic launcher give the same stable columns.
    _, basic_dir = basic_sweep
    stable = [c for c in STABLE if c != "job"]
    got = sorted(tuple(r[c] for c in stable) for r in rows)
    want = sorted(
        tuple(r[c] for c in stable) for r in _csv(basic_dir) if r["hook"] == "chained" and r["storage"] == "safetensors"
    )
    assert got == want and len(got) == 2
