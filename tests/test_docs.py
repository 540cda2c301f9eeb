"""README.md and docs/: links that lead somewhere, pages short enough to read, user pages
without the project's journal (issue numbers, paths outside the repository), and no measured
figure typed by hand outside the tables rendered from benchmarks/results."""

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


# A measured figure: a ratio (x1.5, 2.4x, 3 times), a time, a size, a rate or a share. Between
# `<!-- results:... -->` and `<!-- /results -->` the figures are rendered from the records.
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
MEASURED = re.compile(
    rf"(?<![\w.])x(?!86\b){_NUMBER}(?![\w-])|\b{_NUMBER}x\b|\b{_NUMBER} times\b"
    rf"|\b{_NUMBER} ?(?:ms|us|µs|ns|minutes?|min|hours?|seconds?)\b|\b{_NUMBER} [sh]\b"
    rf"|\b{_NUMBER} ?(?:[KMGT]i?B|kB|Gb|[GT]FLOP(?:S|/s)?)\b|\b{_NUMBER} ?%"
    rf"|\b{_NUMBER} ?(?:tok|tokens|sent|sentences|lines|blocks|requests)"
    r"(?:/s\b| a second\b| per second\b)"
)
# What the figures of the block after it are when they are not measurements (options' defaults,
# limits, sizes of a format, an estimate's arithmetic, a sample output): its reason is required.
NOT_MEASURED = re.compile(r"^<!-- not measured: \S.* -->$")


def typed_figures(text: str) -> list[str]:
    """'line: figure' for each measured figure outside the results blocks and the blocks (the
    lines up to a blank one, or a fenced block whole) that a `not measured` marker leads."""
    found, skipping, fenced = [], False, False
    lines = re.sub(
        r"<!-- results:.*?<!-- /results -->", lambda m: "\n" * m[0].count("\n"), text,
        flags=re.DOTALL,
    ).splitlines()  # fmt: skip
    for number, line in enumerate(lines, 1):
        if NOT_MEASURED.match(line):
            skipping = True
            continue
        closing = fenced and line.startswith("```")
        fenced = fenced != line.startswith("```")
        if not skipping:
            found.extend(f"{number}: {figure}" for figure in MEASURED.findall(line))
        if closing or not (line.strip() or fenced):
            skipping = False
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_measured_figure_is_typed_outside_a_results_block(page):
    figures = typed_figures(page.read_text())
    assert figures == [], (
        f"{page.name}: render measured figures from benchmarks/results (make tables) or say them"
        " in words; lead a block of defaults, limits or samples with <!-- not measured: why -->"
    )


def test_typed_figures_are_found_unless_a_marker_says_why_not():
    page = (
        "Ours ran at x1.5 fairseq, 12 us a call, 3.2 MiB, 880 sentences/s, 12% busy, 5 GFLOP/s.\n"
        "A 512 x 512 weight on x86-64.\n\n"
        "<!-- not measured: the option's default -->\n| `--timeout` | 600 s |\n\n"
        "<!-- not measured: a sample report -->\n```\ntook 12 min\n\nat 101%\n```\n"
        "after 2.5 s\n\n"
        "<!-- results:gpu -->\n| 0.88 ms/step |\n<!-- /results -->\n"
    )
    assert typed_figures(page) == [
        "1: x1.5", "1: 12 us", "1: 3.2 MiB", "1: 880 sentences/s", "1: 12%", "1: 5 GFLOP/s",
        "13: 2.5 s",
    ]  # fmt: skip
