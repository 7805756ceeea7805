"""Every measured figure of README.md and docs/ has a committed result behind it: a number with a unit of speed, time,
size or ratio, in prose or a table (not in code, not a setting in backticks), must appear, at the precision written,
in a report under bench/results/ that its section links to. A section whose figures are settings rather than results
(the plan's fixed allowances, say) says so with ``<!-- figures: settings -->``, and then holds no result figure."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

from tests import ROOT

#: a figure: a number (or a range) followed by a unit of what was measured
FIGURE = re.compile(
    r"(?<![\w.=/+-])(\d+(?:\.\d+)?)(?:\s*(?:–|-|to)\s*(\d+(?:\.\d+)?))?\s*"
    r"(×|x(?=[\s,.;:)])|tok/s|tokens/s|tokens per second|s/token|s a token|GB/s|GB|MB|GiB|MiB|ms|%|s(?=[\s,.;:)]))"
)
LINK = re.compile(r"\]\(([^)\s]*?bench/results/[^)\s#]+)")
SETTINGS = "<!-- figures: settings -->"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, prose) of each section, without code blocks, inline code, comments other than the settings
    marker, and link targets."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--(?! figures: settings).*?-->", "", text, flags=re.S)
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.M)
    found = [("(top)", parts[0])]
    found += [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]
    return found


def figures(prose: str) -> list[str]:
    """The numbers of the figures in ``prose`` (both ends of a range)."""
    prose = re.sub(r"`[^`]*`", "", prose)
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets (file names hold numbers)
    prose = re.sub(r"!\[[^\]]*\]", "", prose)
    numbers: list[str] = []
    for low, high, _unit in FIGURE.findall(prose):
        numbers += [n for n in (low, high) if n]
    return numbers


@lru_cache(maxsize=None)
def report_numbers(path: Path) -> tuple[float, ...]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        text = json.dumps(json.loads(text))
    return tuple(float(n) for n in re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?", text))


def backed(number: str, reports: list[Path]) -> bool:
    """Some number in ``reports`` rounds to ``number`` at the precision it is written with."""
    places = len(number.split(".")[1]) if "." in number else 0
    want = float(number)
    for report in reports:
        for found in report_numbers(report):
            # the same figure in another unit: a share quoted as %, MB quoted as GB
            if any(round(found * scale, places) == want for scale in (1, 100, 1e-3, 1e3)):
                return True
    return False


def linked_reports(page: Path, prose: str) -> list[Path]:
    reports = []
    for target in LINK.findall(prose):
        path = (page.parent / target).resolve()
        reports.append(path)
        for sibling in (path.with_suffix(".json"), path.with_suffix(".md")):
            if sibling.exists():
                reports.append(sibling)
    return [p for p in reports if p.exists()]


def unbacked() -> list[str]:
    problems = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for heading, prose in sections(text):
            numbers = figures(prose)
            if not numbers or SETTINGS in prose:
                continue
            reports = linked_reports(page, prose)
            where = f"{page.relative_to(ROOT)} § {heading}"
            if not reports:
                problems.append(f"{where}: figures {numbers[:6]} and no report of bench/results/ linked")
                continue
            missing = [n for n in numbers if not backed(n, reports)]
            if missing:
                names = [r.name for r in reports if r.suffix == ".md"]
                problems.append(f"{where}: {missing[:8]} in none of {names}")
    return problems


def test_every_documented_figure_is_in_a_report_its_section_links():
    problems = unbacked()
    assert not problems, "figures without a result behind them:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "prose, ok",
    [
        ("decoded at 14.01 tokens/s, 3.52× accelerate [r](bench/results/x.md)", True),
        ("decoded at 14.0 tokens/s [r](bench/results/x.md)", True),  # rounded at the precision written
        ("decoded at 14.2 tokens/s [r](bench/results/x.md)", False),
        ("about 2× faster, always", False),  # no report linked
        ("with `max_memory.0=1GB` and hook=prefetch [r](bench/results/x.md)", True),  # settings in code
        ("3.5–3.7× accelerate [r](bench/results/x.md)", False),  # 3.7 is in no report
    ],
)
def test_the_rule_itself(tmp_path, monkeypatch, prose, ok):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "x.md").write_text("| system | tok/s | × accelerate |\n| ours | 14.01 | 3.52 |\n| acc | 3.98 | 1.00 |")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# Title\n\n{prose}\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert (unbacked() == []) is ok
