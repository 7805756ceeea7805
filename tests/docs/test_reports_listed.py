"""The benchmarks page lists every report committed under bench/results/ (its "Every report" section)."""

from __future__ import annotations

import re

from tests import ROOT


def test_the_benchmarks_page_lists_every_report():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    section = page.split("## Every report", 1)[1]
    listed = set(re.findall(r"\(\.\./bench/results/([^)]+\.md)\)", section))
    reports = {path.name for path in (ROOT / "bench" / "results").glob("*.md")}
    assert reports - listed == set(), f"list these in docs/benchmarks.md's Every report: {sorted(reports - listed)}"
