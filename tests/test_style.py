"""The tree keeps the linter's and the formatter's rules (``[tool.ruff]`` in pyproject.toml): ``ruff check`` and
``ruff format --check`` from the repository root report nothing. Skipped only where ruff is not installed (it is in
the ``test`` extra)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT


def _ruff() -> list[str]:
    beside = Path(sys.executable).parent / "ruff"
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [found]


def test_ruff_check_passes():
    done = subprocess.run([*_ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_leaves_the_tree_as_it_is():
    done = subprocess.run(
        [*_ruff(), "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, "run `ruff format .`: " + done.stdout + done.stderr


def test_nothing_below_the_runners_edge_reads_the_raw_config():
    package = ROOT / "offload_core"
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("plan", "jobs")
        for path in sorted((package / folder).glob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bcfg\b", line)
    ]
    assert not found, f"read typed values from Settings (offload_core/runner/settings.py) instead: {found}"
