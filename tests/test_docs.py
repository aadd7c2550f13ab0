"""The README and docs/ link to each other: every relative link names a file of
the repository and, after `#`, a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchor of each heading outside code blocks: lower case, spaces
    to `-`, punctuation other than `-` and `_` dropped."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.is_file() or (anchor and anchor not in anchors(linked)):
            broken.append(target)
    return broken


def test_every_relative_link_resolves():
    links = sum(len(LINK.findall(page.read_text())) for page in PAGES)
    assert links > 30  # the front page's index and the cross-references
    assert {page.relative_to(REPO).as_posix(): broken_links(page) for page in PAGES} == {
        page.relative_to(REPO).as_posix(): [] for page in PAGES
    }


def test_every_page_of_docs_is_linked_from_the_front_page():
    front = (REPO / "README.md").read_text()
    assert [page.name for page in PAGES[1:] if f"(docs/{page.name})" not in front] == []
