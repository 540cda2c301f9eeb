"""``beamplugin-vocabulary-map``: a vocabulary map for ``--vocabulary-map`` (CTranslate2's
``vmap`` format) from a parallel corpus, tokenized as the model's training data was (the text
fairseq-preprocess read).

Each source token lists the ``--per-token`` target tokens most often in the same sentence pair
relative to its own count (p(target | source) over sentence co-occurrence); the ``--frequent``
most frequent target tokens go on the line every sentence takes. No word alignment is needed;
a lexical table from an aligner gives tighter lists (docs/fairseq.md, "Vocabulary shortlists").
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path


def sentence_pairs(source: Path, target: Path, limit: int | None) -> Iterator[tuple[set, set]]:
    """The token types of each sentence pair of two line-aligned files (at most ``limit``)."""
    with open(source, encoding="utf-8") as src, open(target, encoding="utf-8") as tgt:
        for number, (s, t) in enumerate(zip(src, tgt, strict=True)):
            if limit is not None and number >= limit:
                return
            yield set(s.split()), set(t.split())


def build(pairs: Iterable[tuple[set, set]], per_token: int, frequent: int, min_count: int) -> dict:
    """The map's rules: ``{source token: [target tokens]}`` and ``""`` for every sentence's."""
    target_counts: Counter[str] = Counter()
    together: dict[str, Counter[str]] = {}
    for source, target in pairs:
        target_counts.update(target)
        for token in source:
            together.setdefault(token, Counter()).update(target)
    # ties go to the first token in sorted order: the same map whatever the hash seed
    ranked = sorted(target_counts.items(), key=lambda item: (-item[1], item[0]))
    rules = {"": [token for token, _ in ranked[:frequent]]}
    always = set(rules[""])
    for token, counts in together.items():
        kept = [(-c, t) for t, c in counts.items() if c >= min_count and t not in always]
        best = heapq.nsmallest(per_token, kept)  # p(t | s) ranks as c(s, t): c(s) is common
        if best:
            rules[token] = [t for _, t in best]
    return rules


def write(rules: dict, out: Path) -> None:
    with open(out, "w", encoding="utf-8") as f:
        for key, targets in sorted(rules.items()):  # "" first; the same file every run
            f.write(f"{key}\t{' '.join(targets)}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="beamplugin-vocabulary-map", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True,
                        help="tokenized source sentences, one a line (e.g. train.de)")
    parser.add_argument("--target", type=Path, required=True,
                        help="their tokenized translations, line by line (e.g. train.en)")
    parser.add_argument("--output", type=Path, required=True, help="the map file to write")
    parser.add_argument("--per-token", type=int, default=50,
                        help="target tokens each source token lists (default 50)")
    parser.add_argument("--frequent", type=int, default=500,
                        help="most frequent target tokens every sentence may take (default 500)")
    parser.add_argument("--min-count", type=int, default=2,
                        help="sentence pairs a source and a target token must share (default 2)")
    parser.add_argument("--max-lines", type=int, default=None,
                        help="read at most this many sentence pairs")
    args = parser.parse_args(argv)
    for name in ("per_token", "frequent", "min_count"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0")
    return args


def cli_main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        pairs = sentence_pairs(args.source, args.target, args.max_lines)
        rules = build(pairs, args.per_token, args.frequent, args.min_count)
    except UnicodeDecodeError as error:
        print(f"beamplugin-vocabulary-map: not UTF-8 text: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # zip(strict=True): the files differ in length
        print(f"beamplugin-vocabulary-map: {args.source} and {args.target} must have as many "
              f"lines ({error})", file=sys.stderr)  # fmt: skip
        return 2
    except OSError as error:
        print(f"beamplugin-vocabulary-map: {error}", file=sys.stderr)
        return 2
    write(rules, args.output)
    print(f"{len(rules) - 1} source tokens, {len(rules[''])} always: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
