"""Render the results tables of README.md and docs/*.md from benchmarks/results/*.jsonl.

Each table in a page lies between `<!-- results:TABLE -->` and `<!-- /results -->`, TABLE being
a record's "table" ("cpu-avx512", "cpu-avx2", "gpu", "gpu-h200");
`<!-- results:TABLE ROW ROW ... -->` keeps only the records of those "row" ids (the README's
short tables). What lies between is rewritten from the records, so that no figure is typed by
hand twice.

    python benchmarks/render_tables.py           # rewrite every block (make tables)
    python benchmarks/render_tables.py --check   # exit 1 naming each block out of date

A record is one measurement of one system, one JSON object a line (fields: README.md's
"Results" and docs/performance.md). A table row gathers the records of one comparison, each
system in a column of its own: the GPU's by model, batch and precision, as its benchmark writes
them; the CPUs' by their "row" id, since one model, batch and precision there carries several
comparisons (speed, memory, shortlists).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
PAGES = ("README.md", "docs/*.md")
BLOCK = re.compile(
    r"(<!-- results:([\w-]+)((?: [\w.-]+)*) -->\n)(.*?)(<!-- /results -->)", re.DOTALL
)
REFERENCE = "fairseq"  # ratios not recorded are computed against it, in its column first
# a GPU's records ("gpu": the H100s the goals were set on; "gpu-CARD": another card, a table of
# its own) are grouped by what they measured; the CPUs' by their row id
GPU_COLUMNS = ("model", "batch", "precision")
ROW_ID = ("row",)


def _gpu(table: str) -> bool:
    return table == "gpu" or table.startswith("gpu-")

Record = dict[str, Any]


def load_records(root: Path) -> list[Record]:
    """Every record of every results file, in file-name then line order."""
    records = []
    for path in sorted((root / RESULTS).glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise SystemExit(f"{path}:{number}: {error}") from error
    return records


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


SPEEDS = ("ms_per_step", "tokens_per_s", "sentences_per_s")  # the first both records have


def _ratio(record: Record, reference: Record | None) -> str | None:
    if record.get("ratio"):
        return f"x{record['ratio']['value']:.2f} {record['ratio']['against']}"
    if reference is None or reference is record:
        return None
    for field in SPEEDS:
        if record.get(field) and reference.get(field):
            ours, theirs = record[field], reference[field]
            value = theirs / ours if field == "ms_per_step" else ours / theirs
            return f"x{value:.2f} {REFERENCE}"
    return None


def cell(record: Record, reference: Record | None) -> str:
    """One system's figures: absolute ones first, then its ratio and its agreement. A GPU row
    shows one speed (at batch 1 a step's time, else tokens/s: the goals' terms)."""
    parts = []
    units = (
        ("ms_per_step", "ms/step"), ("tokens_per_s", "tok/s"), ("sentences_per_s", "sent/s"),
        ("us_per_call", "us"),
    )  # fmt: skip
    if _gpu(record["table"]):
        preferred = units if record.get("batch") == 1 else units[1:]
        units = tuple(u for u in preferred if record.get(u[0]) is not None)[:1]
    for field, unit in units:
        if record.get(field) is not None:
            value = record[field]
            shown = f"{value:.2f}" if field == "ms_per_step" else _number(value)
            parts.append(f"{shown} {unit}")
    if record.get("bleu") is not None:
        parts.append(f"BLEU {record['bleu']:.2f}")
    if record.get("terms_present") is not None:  # a glossary's terms in the output
        parts.append(f"terms {record['terms_present']:.1%} (as whole words "
                     f"{record['terms_whole_words']:.1%})")  # fmt: skip
    if record.get("peak_mib") is not None:
        parts.append(f"{record['peak_mib']:,.0f} MiB peak")
    if record.get("share_of_peak") is not None:
        parts.append(f"{record['share_of_peak']:.0%} of a core's peak")
    ratio = _ratio(record, reference)
    if ratio:
        parts.append(ratio)
    if record.get("same_as_reference"):
        parts.append(f"{record['same_as_reference']} as {REFERENCE}")
    if record.get("same_as_float32"):  # best hypotheses equal to our float32's
        parts.append(f"{record['same_as_float32']} best as float32")
    return "; ".join(parts)


def _group_key(record: Record) -> tuple[Any, ...]:
    return tuple(record.get(field) for field in (GPU_COLUMNS if _gpu(record["table"]) else ROW_ID))


def _run(record: Record) -> str:
    """The command and the machine and commit it ran on: what a row's reference number names."""
    machine = record["device"]
    if record.get("host_cpu"):
        machine += f", host {record['host_cpu']}"
    if record.get("kernels"):
        machine += f", kernels {record['kernels']}"
    commit = f", at {record['commit']}" if record.get("commit") else ""
    return f"`{record['command']}` ({machine}{commit})"


def render(table: str, records: Iterable[Record], rows: Sequence[str] = ()) -> str:
    """The markdown of one table (only the records of `rows`, if any): a row per comparison, a
    column per system, then the runs that made them, numbered. Results files only grow, so where
    a system was measured again in a row, its last record is the one shown."""
    chosen = [r for r in records if r["table"] == table and (not rows or r["row"] in rows)]
    if not chosen:
        return f"(no results recorded for {table})\n"
    groups: dict[tuple[Any, ...], dict[str, Record]] = {}
    for record in chosen:
        groups.setdefault(_group_key(record), {})[record["system"]] = record
    shown = [r for group in groups.values() for r in group.values()]
    systems = sorted(dict.fromkeys(r["system"] for r in shown), key=lambda s: s != REFERENCE)
    runs: list[str] = []
    lead = ["model", "precision", "batch"] if _gpu(table) else ["what", "batch"]
    lines = [
        "| " + " | ".join(lead + systems + ["command"]) + " |",
        "| " + " | ".join(["---"] * (len(lead) + len(systems) + 1)) + " |",
    ]
    for by_system in groups.values():
        reference = by_system.get(REFERENCE)
        first = next(iter(by_system.values()))
        # a run without a fixed batch (fairseq-generate's --max-tokens) says what it used instead
        head = [str(first.get(f"{field}_label") or first.get(field, "")) for field in lead]
        cells = [cell(by_system[s], reference) if s in by_system else "" for s in systems]
        numbers = []
        for record in by_system.values():
            if _run(record) not in runs:
                runs.append(_run(record))
            numbers.append(runs.index(_run(record)) + 1)
        refs = ", ".join(f"({n})" for n in sorted(set(numbers)))
        lines.append("| " + " | ".join(head + cells + [refs]) + " |")
    lines.append("")
    lines.extend(f"{number}. {run}" for number, run in enumerate(runs, 1))
    return "\n".join(lines) + "\n"


def pages(root: Path) -> list[Path]:
    return sorted(path for pattern in PAGES for path in root.glob(pattern))


def rendered(text: str, records: Sequence[Record]) -> str:
    """The page with every results block rewritten from the records."""
    return BLOCK.sub(lambda m: m[1] + render(m[2], records, m[3].split()) + m[5], text)


def out_of_date(root: Path) -> list[str]:
    """'page: table' for each block whose text differs from what the records render."""
    records = load_records(root)
    stale = []
    for page in pages(root):
        text = page.read_text()
        for match in BLOCK.finditer(text):
            if match[4] != render(match[2], records, match[3].split()):
                stale.append(f"{page.relative_to(root)}: {match[2]}")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which blocks differ")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: ours)")
    args = parser.parse_args(argv)
    if args.check:
        stale = out_of_date(args.root)
        for block in stale:
            print(f"out of date: {block} (make tables)", file=sys.stderr)
        return 1 if stale else 0
    records = load_records(args.root)
    for page in pages(args.root):
        text = page.read_text()
        new = rendered(text, records)
        if new != text:
            page.write_text(new)
            print(f"rendered {page.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
