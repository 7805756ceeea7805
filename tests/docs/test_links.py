"""Every relative link and image of README.md and docs/ resolves in the repository, as a reader of the Markdown there
follows it: to a file the repository holds (not one made only when the site is built) and, with ``#anchor``, to a
heading of that page under both GitHub's and the site's anchor rules. The site's copies of repository files are
reached through docs/scripts/repo_links.py; the strict site build (test_site.py) checks the site's side."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests import ROOT

markdown = pytest.importorskip("markdown", reason="the docs extra is not installed (pip install -e '.[docs]')")

#: the site's Markdown extensions that change what is a link or a heading (mkdocs.yml)
EXTENSIONS = ["tables", "attr_list", "admonition", "toc", "pymdownx.details", "pymdownx.superfences"]


def pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


@lru_cache(maxsize=1)
def repository_files() -> frozenset[str]:
    """The files a clone holds (tracked, or new and not ignored), relative to the root, with their folders."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    found = set(listed)
    for name in listed:
        parts = name.split("/")
        found.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(found)


class _Page(HTMLParser):
    """The links (``a href``, ``img src``) and the headings (id and text) of a rendered page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.headings: list[tuple[str, str]] = []
        self._heading: list | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        if tag == "a" and attributes.get("href"):
            self.links.append(attributes["href"])
        if tag == "img" and attributes.get("src"):
            self.links.append(attributes["src"])
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = [attributes.get("id", ""), ""]

    def handle_data(self, data: str) -> None:
        if self._heading is not None:
            self._heading[1] += data

    def handle_endtag(self, tag: str) -> None:
        if re.fullmatch(r"h[1-6]", tag) and self._heading is not None:
            self.headings.append(tuple(self._heading))
            self._heading = None


def render(text: str) -> _Page:
    page = _Page()
    page.feed(markdown.markdown(text, extensions=EXTENSIONS))
    return page


@lru_cache(maxsize=None)
def parsed(path: Path) -> _Page:
    return render(path.read_text(encoding="utf-8"))


def github_anchor(text: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(GitHub's anchors, the site's) of the page ``path``."""
    return page_anchors(parsed(path))


def page_anchors(page: _Page) -> tuple[frozenset[str], frozenset[str]]:
    """(GitHub's anchors, the site's) of a rendered page; a repeated heading gets ``-1``, ``-2``… on GitHub."""
    seen: dict[str, int] = {}
    github = set()
    for _, text in page.headings:
        anchor = github_anchor(text)
        github.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return frozenset(github), frozenset(ident for ident, _ in page.headings if ident)


def broken(page: Path, text: str | None = None) -> list[str]:
    """What is wrong with each relative link of ``page`` (its ``text``, when given, in place of the file's)."""
    problems = []
    rendered = parsed(page) if text is None else render(text)
    for link in rendered.links:
        parts = urlsplit(link)
        if parts.scheme or parts.netloc:
            continue
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        try:
            name = target.relative_to(ROOT).as_posix()
        except ValueError:
            problems.append(f"{link}: outside the repository")
            continue
        if parts.path and name not in repository_files():
            problems.append(f"{link}: no such file in the repository ({name})")
            continue
        if parts.fragment and target.suffix == ".md":
            github, site = page_anchors(rendered) if target == page else anchors(target)
            for rule, known in (("GitHub's", github), ("the site's", site)):
                if parts.fragment not in known:
                    problems.append(f"{link}: no heading of {name} has the anchor #{parts.fragment} by {rule} rule")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_in_the_repository(page):
    problems = broken(page)
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_the_check_finds_a_missing_file_and_a_missing_anchor():
    text = (
        "# Title\n\n## Two `words`, here\n\n[a](#two-words-here) [b](#three) [c](recipes/none.md) [d](quickstart.md)\n"
    )
    text += (
        "[e](quickstart.md#no-such-heading) [f](../bench/results/moe-large.md) [g](benchmarks/results/moe-large.md)\n"
    )
    problems = broken(ROOT / "docs" / "new-page.md", text)
    assert [p.split(":")[0] for p in problems] == [
        "#three",
        "#three",
        "recipes/none.md",
        "quickstart.md#no-such-heading",
        "quickstart.md#no-such-heading",
        "benchmarks/results/moe-large.md",
    ]


def test_the_site_copies_every_repository_file_a_page_links_outside_docs():
    """A link out of docs/ reads right in the repository; the strict site build needs it to be one the hook maps to
    a page the site has (a copy gen_pages.py makes)."""
    sys.path.insert(0, str(ROOT / "docs" / "scripts"))
    try:
        from repo_links import rewrite, site_copy
    finally:
        sys.path.remove(str(ROOT / "docs" / "scripts"))
    unmapped = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.parent.name == "reference" and page.stem in ("configuration", "errors"):
            continue  # placeholders the generated pages replace on the site
        for link in parsed(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            name = (page.parent / unquote(parts.path)).resolve().relative_to(ROOT).as_posix()
            if not name.startswith("docs/") and site_copy(name) is None:
                unmapped.append(f"{page.relative_to(ROOT)}: {link}")
    assert not unmapped, "links out of docs/ that the site has no page for:\n" + "\n".join(unmapped)
    assert rewrite("[r](../../bench/results/moe-large.md#x)", "recipes/moe.md") == (
        "[r](../benchmarks/results/moe-large.md#x)"
    )
