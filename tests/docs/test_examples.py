"""No code block of docs/ or README.md escapes the example run (conftest.py at the root): each is a ```bash or
```python block that runs, or carries a not-run marker with its reason; other fences are data, never commands."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import ROOT

#: fence languages that are shown, never run (data, configs, diagrams, plain output)
SHOWN = {"toml", "yaml", "json", "text", "mermaid", "csv"}
FENCE = re.compile(r"^[ \t]*(?:[-*+]|\d+[.)])?[ \t]*(`{3,}|~{3,})[ \t]*([^\s`{]*)", re.MULTILINE)
MARKER = re.compile(r"^[ \t]*<!--\s*not-run\b(.*?)-->[ \t]*$", re.MULTILINE)


def pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def fences(text: str) -> list[tuple[int, str]]:
    """(line, language) of every opening fence."""
    found, open_fence = [], None
    for match in FENCE.finditer(text):
        fence, language = match.group(1), match.group(2)
        if open_fence is None:
            found.append((text.count("\n", 0, match.start()) + 1, language))
            open_fence = fence
        elif fence.startswith(open_fence) and not language:
            open_fence = None
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_or_is_data(page):
    bad = [
        f"line {line}: ```{language or '(no language)'}"
        for line, language in fences(page.read_text())
        if language not in {"bash", "python"} | SHOWN
    ]
    assert not bad, f"{page.name}: write ```bash or ```python (they run), or one of {sorted(SHOWN)} for data: {bad}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_not_run_marker_gives_a_reason(page):
    text = page.read_text()
    for match in MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        assert re.match(r":\s*\S.{8,}", match.group(1)), (
            f"{page.name}:{line}: write <!-- not-run: the reason it cannot run -->"
        )
        after = text[match.end() :].lstrip(" \t\n")
        assert after.startswith(("```bash", "```python")), (
            f"{page.name}:{line}: a not-run marker goes right before a ```bash or ```python block"
        )


def test_the_pages_run_many_examples_and_mark_few():
    """A guard against a page's blocks silently dropping out of the run (say, a parser that stops matching)."""
    from conftest import DOCS, README

    run = marked = 0
    for sybil, paths in ((DOCS, sorted((ROOT / "docs").rglob("*.md"))), (README, [ROOT / "README.md"])):
        for path in paths:
            for example in sybil.parse(path).examples():
                from conftest import not_run_reason

                marked += not_run_reason(example) is not None
                run += not_run_reason(example) is None
    blocks = sum(lang in ("bash", "python") for p in pages() for _, lang in fences(p.read_text()))
    assert run + marked == blocks
    assert run >= 15


def sybil_run(tmp_path: Path, page: str) -> subprocess.CompletedProcess:
    """Run the example machinery of conftest.py on one page in a scratch copy of its layout."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(textwrap.dedent(page))
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    for name in ("run.py", "bench", "examples", "conf"):
        (tmp_path / name).symlink_to(ROOT / name)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs", "docs/page.md"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # a pytest process
def test_an_unmarked_block_that_fails_fails_the_run_and_a_marked_one_is_skipped(tmp_path):
    done = sybil_run(
        tmp_path,
        """\
        # A page

        ```bash
        test -f run.py && echo ok
        ```

        <!-- not-run: needs a cluster -->
        ```bash
        exit 3
        ```

        ```python
        assert 1 + 1 == 2
        ```

        ```bash
        exit 4
        ```
        """,
    )
    assert "1 failed, 2 passed, 1 skipped" in done.stdout, done.stdout + done.stderr
    assert "exited with 4" in done.stdout and "not run: needs a cluster" in done.stdout
