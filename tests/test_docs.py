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


def layout_names() -> set[str]:
    """The names in backticks of the README's Layout section."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([^`]+)`", section))


def test_the_layout_names_existing_files():
    """Each file the README's map names is there: in the repository, a rules file
    in workflow/rules/, or a module or folder under src/ortflow/ (at the path
    given, or by name in one of its folders)."""
    package = REPO / "src" / "ortflow"
    named = {name for name in layout_names() if re.fullmatch(r"[\w/]+(\.py|\.smk|\.yaml|/)", name)}
    assert len(named) > 30
    missing = [name for name in named
               if not (REPO / name).exists() and not (REPO / "workflow" / "rules" / name).is_file()
               and not (package / name).exists() and not list(package.rglob(name))]
    assert missing == []


def test_the_layout_names_every_module():
    """A module added to src/ortflow/ gets its line in the README's map."""
    names = layout_names()
    modules = [path.relative_to(REPO / "src" / "ortflow").as_posix()
               for path in sorted((REPO / "src" / "ortflow").rglob("*.py")) if path.name != "__init__.py"]
    unnamed = [module for module in modules
               if not {module, Path(module).name, Path(module).stem} & names]
    assert unnamed == []
