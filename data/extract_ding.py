"""Aligned German-English sentence pairs from the Ding dictionary (Debian's ``trans-de-en``).

Each dictionary line reads ``German :: English``. Both sides hold the same number of sub-entries
separated by `` | `` (headword, inflections, then example phrases and sentences), and each
sub-entry lists alternatives separated by ``; ``. Annotations ride along: ``{f}``, ``[Br.]``,
``(Sache)``, ``<keyword>``, ``/SIDU/``. Only the example *sentences* are useful for translation,
so we keep sub-entry pairs whose both sides look like a sentence once annotations are stripped.

Usage: python data/extract_ding.py DICT_FILE OUT_PREFIX  (writes OUT_PREFIX.de and OUT_PREFIX.en)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

# Innermost bracket pair first, repeated until none is left, so nested notes go too.
_ANNOTATION = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|\([^()]*\)|<[^<>]*>")
_ABBREVIATION_TAG = re.compile(r"/[A-Z0-9]{2,}/")  # e.g. "/SIDU/" after "Sorry, I don't ..."
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([.,!?;:])")
_SENTENCE_START = re.compile(r"^[\"'„“‚‘«»]?[A-ZÄÖÜ0-9]")
_SENTENCE_END = re.compile(r"[.!?][\"'“”‘’«»]?$")
# Dictionary placeholders ("sth.", "jdm.", ...) and choices ("queue/line") mark templates,
# ellipses mark fragments: none of them is a sentence a translation model should learn.
_NOT_A_SENTENCE = re.compile(
    r"\b(?:sth|sb|sb's|etw|jd[mnrs]?)\.|…|\.\.\.|/|[{}\[\]()<>]|\s::\s|~"
)
MIN_WORDS = 2


def strip_annotations(text: str) -> str:
    """Drop every bracketed note and abbreviation tag; tidy the spaces they leave behind."""
    previous = None
    while previous != text:
        previous, text = text, _ANNOTATION.sub(" ", text)
    text = _ABBREVIATION_TAG.sub(" ", text)
    text = " ".join(text.split())
    return _SPACE_BEFORE_PUNCT.sub(r"\1", text)


def is_sentence(text: str) -> bool:
    """A capitalised run of at least MIN_WORDS words ending in ., ! or ?, with no placeholder."""
    return (
        len(text.split()) >= MIN_WORDS
        and bool(_SENTENCE_START.search(text))
        and bool(_SENTENCE_END.search(text))
        and not _NOT_A_SENTENCE.search(text)
    )


def _alternatives(sub_entry: str) -> list[str]:
    return [alt.strip() for alt in strip_annotations(sub_entry).split(";") if alt.strip()]


def line_pairs(line: str) -> Iterator[tuple[str, str]]:
    """The sentence pairs of one dictionary line (none for comments or misaligned lines)."""
    if line.startswith("#") or line.count(" :: ") != 1:
        return
    german, english = line.rstrip("\n").split(" :: ")
    de_subs, en_subs = german.split(" | "), english.split(" | ")
    if len(de_subs) != len(en_subs):
        return
    for de_sub, en_sub in zip(de_subs, en_subs, strict=True):
        de_alts, en_alts = _alternatives(de_sub), _alternatives(en_sub)
        if not de_alts or not en_alts:
            continue
        # Alternatives line up only when both sides list as many; otherwise the first ones
        # are the canonical translations of each other.
        pairs = zip(de_alts, en_alts, strict=True) if len(de_alts) == len(en_alts) else [
            (de_alts[0], en_alts[0])
        ]
        for de, en in pairs:
            if is_sentence(de) and is_sentence(en):
                yield de, en


def extract_pairs(lines: Iterable[str]) -> list[tuple[str, str]]:
    """All sentence pairs of a dictionary, first occurrence kept, in dictionary order."""
    seen: set[tuple[str, str]] = set()
    pairs = []
    for line in lines:
        for pair in line_pairs(line):
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
    return pairs


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: extract_ding.py DICT_FILE OUT_PREFIX")
    source, prefix = Path(argv[0]), argv[1]
    if not source.is_file():
        sys.exit(f"extract_ding: no dictionary at {source} (apt-get install trans-de-en)")
    with source.open(encoding="utf-8") as f:
        pairs = extract_pairs(f)
    if not pairs:
        sys.exit(f"extract_ding: no sentence pairs found in {source}; is it a Ding dictionary?")
    for index, lang in enumerate(("de", "en")):
        Path(f"{prefix}.{lang}").write_text(
            "".join(pair[index] + "\n" for pair in pairs), encoding="utf-8"
        )
    print(f"extract_ding: {len(pairs)} sentence pairs from {source}")


if __name__ == "__main__":
    main(sys.argv[1:])
