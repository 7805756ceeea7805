"""Every benchmark script answers ``--help`` with its usage and a description that ends a sentence (the first
paragraph of its docstring, not its first line cut mid-sentence)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import ROOT

SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if "ArgumentParser(" in p.read_text(encoding="utf-8"))


def test_the_scripts_with_options_are_found():
    assert {"moe.py", "compare.py", "diffusion.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_describes_the_script_in_whole_sentences(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    paragraphs = done.stdout.split("\n\n")
    assert paragraphs[0].startswith("usage: ") and len(paragraphs) >= 3, done.stdout
    description = " ".join(paragraphs[1].split())
    assert description.endswith("."), f"{script.name} --help stops mid-sentence: ...{description[-80:]!r}"
