"""``storage=pinned_cpu storage.codec=exponent`` from the command line: the plan says what is packed and predicts
fewer bytes moved per token (the two plans' command lines run in this process), the run gives the in-memory model's
tokens and moves what was predicted, and a codec that does not exist is one error line."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from offload_core.runner.cli import hydra_main
from tests import ROOT, preloaded
from tests.end_to_end.helpers import assert_one_line, cli

pytestmark = pytest.mark.slow

#: everything on disk, held packed in memory by the store (over the 1 KiB budget, warned)
RUN = [
    "model=synthetic",
    "storage=pinned_cpu",
    "hook=prefetch",
    "dtype=bfloat16",
    "max_memory.cpu=1KiB",
    "headroom=0",
    "over_budget=warn",
]


def _run(tmp_path, *args: str) -> str:
    done = preloaded.run(
        [sys.executable, "run.py", *RUN, "progress=false", f"hydra.run.dir={tmp_path}", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _plan(tmp_path, capsys, *args: str) -> str:
    """What ``run.py`` prints for the plan of ``args``, run in this process."""
    capsys.readouterr()
    old, sys.argv = sys.argv, ["run.py", *RUN, "progress=false", f"hydra.run.dir={tmp_path}", "plan_only=true", *args]
    try:
        hydra_main()
    finally:
        sys.argv = old
    return capsys.readouterr().out


def _mib(text: str, pattern: str) -> float:
    return float(re.search(pattern + r" ([0-9.]+) MiB", text).group(1))


def test_plan_and_run_with_the_codec(tmp_path, capsys):
    raw = _plan(tmp_path / "raw", capsys)
    planned = _plan(tmp_path / "plan", capsys, "storage.codec=exponent")
    assert re.search(r"packed: \d+ offloaded tensors held losslessly in .* \(0\.7\d\d\)", planned)
    per_token = "predicted bytes moved per generated token:"
    assert 0.7 < _mib(planned, per_token) / _mib(raw, per_token) < 0.85
    ran = _run(tmp_path / "run", "storage.codec=exponent", "compare_in_memory=true", "max_new_tokens=3")
    assert "same tokens as in memory: True" in ran
    # in bytes: a borrowed tensor of a few KiB leaves the printed MiB as they were (1.24 < 1.24 failed, loaded machine)
    moved = json.loads((tmp_path / "run" / "metrics.json").read_text())["bytes_moved_per_token"]
    predicted = json.loads((tmp_path / "plan" / "metrics.json").read_text())["predicted_bytes_per_token"]
    assert predicted / 2**20 == pytest.approx(_mib(planned, per_token), abs=0.005)  # what the plan printed
    if int(re.search(r"borrowed (\d+)", ran).group(1)):
        # a tied tensor read ahead while the block that brought it in still held it is borrowed from that block's
        # buffer: no bytes move for it (how often depends on the reader's timing)
        assert moved < predicted
    else:
        assert moved == pytest.approx(predicted, rel=0.01)


def test_an_unknown_codec_is_one_line(tmp_path, capsys):
    code, err = cli(["model=synthetic", "storage=pinned_cpu", "storage.codec=zstd"], tmp_path, capsys)
    assert code == 2
    assert_one_line(err, "storage.codec=zstd", "none, exponent")
