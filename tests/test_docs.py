"""README.md and docs/: links that lead somewhere, pages short enough to read, user pages
without the project's journal (issue numbers, paths outside the repository)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_finds_its_file_and_heading(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s): and mailto: are not checked offline
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        assert ROOT in linked.parents or linked == ROOT, f"{page.name}: {target} leaves the repo"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.name}: no heading #{anchor} in {path}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_name_no_issue_numbers_and_no_files_outside_the_repository(page):
    text = page.read_text()
    assert not re.findall(r"\bissues? #?\d+", text, flags=re.IGNORECASE), page.name
    assert "../shared" not in text, page.name


def test_pages_are_short_enough_to_read():
    lengths = {page.name: len(page.read_text().splitlines()) for page in PAGES}
    assert lengths.pop("README.md") <= 150
    assert max(lengths.values()) <= 400, lengths


def test_the_readme_has_no_table_cell_over_200_characters_and_no_dates():
    text = (ROOT / "README.md").read_text()
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    assert max(len(c) for c in cells) <= 200
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
