"""The documentation site builds with `mkdocs build --strict`: every page in the nav, every link and anchor
found, the generated pages (configuration reference, error messages, benchmark reports) built from the code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import ROOT

pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")


@pytest.mark.slow
def test_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reference = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    for key in ("max_memory", "page_cache", "hook.depth", "storage.verify", "model.preset"):
        assert key in reference
    errors = (tmp_path / "site" / "reference" / "errors" / "index.html").read_text()
    assert "is not a size" in errors
    assert (tmp_path / "site" / "benchmarks" / "results" / "compare-1.1b.png").is_file()
    home = (tmp_path / "site" / "index.html").read_text()  # the README, built as the home page
    assert "Two commands" in home and 'href="recipes/choosing/"' in home
