"""A mkdocs hook: the pages link to files of the repository (``bench/results/…``, an example's README), so the
Markdown reads right in the repository; on the site such a link goes to the copy ``gen_pages.py`` makes of it."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

#: a repository file (relative to the root) -> its page on the site (relative to docs/), as gen_pages.py writes it
SITE_COPIES = {
    "bench/README.md": "benchmarks/results/README.md",
    "examples/interleaved_placement/README.md": "examples/interleaved_placement.md",
}
#: every report of bench/results/ is copied to benchmarks/results/ (gen_pages.py: the .md, .png and .log files)
RESULTS = ("bench/results/", "benchmarks/results/", (".md", ".png", ".log"))

LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?(?:\s+\"[^\"]*\")?\))")


def site_copy(repository_path: str) -> str | None:
    """The site page (relative to docs/) that holds the repository file ``repository_path``, or None."""
    if repository_path in SITE_COPIES:
        return SITE_COPIES[repository_path]
    source, copy, suffixes = RESULTS
    if (
        repository_path.startswith(source)
        and repository_path.endswith(suffixes)
        and "/" not in repository_path[len(source) :]
    ):
        return copy + repository_path[len(source) :]
    return None


def rewrite(markdown: str, page: str) -> str:
    """``markdown`` of the docs page ``page`` (relative to docs/) with its links to repository files outside docs/
    that the site copies pointed at those copies."""
    folder = posixpath.dirname(page)

    def swap(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        in_repository = posixpath.normpath(posixpath.join("docs", folder, target))
        copy = site_copy(in_repository)
        if copy is None:
            return match.group(0)
        return match.group(1) + posixpath.relpath(copy, folder or ".") + match.group(3)

    return LINK.sub(swap, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs' hook: rewrite the links of a page written in docs/ and of the home page (README.md, which
    gen_pages.py copies); other generated pages are left as they are."""
    source = Path(page.file.abs_src_path or "")
    if not source.is_relative_to(DOCS) and page.file.src_uri != "index.md":
        return markdown
    return rewrite(markdown, page.file.src_uri)
