"""Every benchmark script answers ``--help`` with its usage and a description that ends a sentence (the first
paragraph of its docstring, not its first line cut mid-sentence)."""

from __future__ import annotations

import json
import os
import sys

from tests import ROOT, preloaded

SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if "ArgumentParser(" in p.read_text(encoding="utf-8"))

#: runs each script given as ``python <script> --help`` would, in one process (they share their imports), and prints
#: {script: (exit code, what it printed)} as JSON
HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
answers = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code or 0
    answers[script] = (code, out.getvalue())
print(json.dumps(answers))
"""


def test_help_describes_every_script_in_whole_sentences():
    assert {"moe.py", "compare.py", "diffusion.py"} <= {p.name for p in SCRIPTS}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", HELP_OF_EACH, *map(str, SCRIPTS)]
    done = preloaded.run(command, cwd=ROOT / "bench", env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout.splitlines()[-1])
    for script in SCRIPTS:
        code, text = answers[str(script)]
        paragraphs = text.split("\n\n")
        assert code == 0 and paragraphs[0].startswith("usage: ") and len(paragraphs) >= 3, f"{script.name}: {text}"
        description = " ".join(paragraphs[1].split())
        assert description.endswith("."), f"{script.name} --help stops mid-sentence: ...{description[-80:]!r}"
