"""Glossary quality on the demo's model and test set: how many glossary terms the constrained
translations hold, and what the glossary does to BLEU, ours beside fairseq's own constrained
generator.

The glossary is built from the references, target terms only (a glossary's source side only
decides which sentences get which terms; here each sentence gets its own): for each test
sentence, the words of its reference (runs of letters, at least four, that the model's
sentencepiece model cuts into pieces of its target dictionary) that the unconstrained
translation misses, the first three in the reference's order; where it misses none, the
reference's longest such word. These are the hardest terms to put in: the model did not choose
them.

Three runs of fairseq-interactive on the same lines, beam and options (``make demo``'s
``--beam 5``): ours without constraints (which picks the terms, and is the BLEU to keep), ours
with ``--constraints unordered`` and each line's terms after tabs, and fairseq's own generator
(its ``translation`` task) with the same, less the sentences whose terms no hypothesis met
within the maximum length (ours refuses them alone; fairseq's generator fails its run there:
they are left out of every figure, and counted). Printed: terms present in each output, as the
constraints ask for them (pieces) and as whole words, BLEU (sacrebleu, detokenized, against the
raw references) of each, and how many constrained translations of ours equal fairseq's.
``--results FILE`` appends a record per run.

    python -m benchmarks.glossary_quality --work data/work --lines 1000 \\
        --results benchmarks/results/cpu-avx512.jsonl
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from sacrebleu.metrics import BLEU
from sentencepiece import SentencePieceProcessor

from benchmarks.common import (
    ROOT,
    add_results_option,
    append_records,
    command_line,
    cpu_description,
    machine,
    record,
    table_name,
)

WORD = re.compile(r"[^\W\d_]+")  # letters only: a term is a word, not a number
MIN_LETTERS = 4
MAX_TERMS = 3


def interactive(work: Path, checkpoint: Path, lines: list[str], task: str, threads: int,
                *extra: str) -> tuple[list[tuple[str, str]], float]:  # fmt: skip
    """fairseq-interactive's best translation of each of ``lines`` with ``task``, as pieces
    (its H- line) and text (its D- line), empty for a line it refuses; and the seconds it
    ran."""
    command = [
        str(Path(sys.executable).parent / "fairseq-interactive"), str(work / "bin"),
        "--user-dir", str(ROOT / "beamplugin"), "--task", task, "--path", str(checkpoint),
        "--bpe", "sentencepiece", "--sentencepiece-model", str(work / "spm" / "spm.model"),
        "-s", "de", "-t", "en", "--beam", "5", "--buffer-size", "100", "--batch-size", "100",
        "--cpu", *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command, input="".join(line + "\n" for line in lines), capture_output=True, text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 3):  # 3: our task refused some lines, and said which
        raise SystemExit(f"fairseq-interactive --task {task} failed:\n{done.stderr[-3000:]}")
    best: dict[tuple[str, int], str] = {}
    for found in re.finditer(r"^([HD])-(\d+)\t\S+\t(.*)$", done.stdout, flags=re.M):
        best.setdefault((found[1], int(found[2])), found[3])
    return [(best.get(("H", i), ""), best.get(("D", i), "")) for i in range(len(lines))], seconds


def glossary_terms(
    reference: str, translation: str, writable: set[str], spm: SentencePieceProcessor
) -> list[str]:
    """A sentence's terms by the rule above: words of ``reference`` that ``translation`` misses
    (the first three), else its longest word; only words whose pieces the target dictionary
    (``writable``) holds."""
    words = [
        word for word in dict.fromkeys(WORD.findall(reference))
        if len(word) >= MIN_LETTERS and all(p in writable for p in spm.encode(word, out_type=str))
    ]  # fmt: skip
    have = set(WORD.findall(translation))
    missed = [word for word in words if word not in have]
    if missed:
        return missed[:MAX_TERMS]
    return sorted(words, key=len, reverse=True)[:1]


def present(
    terms: list[list[str]], translations: list[tuple[str, str]], spm: SentencePieceProcessor
) -> tuple[int, int]:
    """Terms found in their sentence's translation: as the constraints ask for them (their
    pieces in a row among the translation's), and as whole words (which the translation may
    not keep: a term's last piece may go on with others, "lack" in "lacks")."""
    met = whole = 0
    for sentence_terms, (pieces, text) in zip(terms, translations, strict=True):
        padded = f" {pieces} "
        for term in sentence_terms:
            met += f" {' '.join(spm.encode(term, out_type=str))} " in padded
            whole += term in WORD.findall(text)
    return met, whole


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "data" / "work",
                        help="make demo's work directory (default data/work)")
    parser.add_argument("--checkpoint", type=Path,
                        help="default: WORK/checkpoints/checkpoint_best.pt")
    parser.add_argument("--lines", type=int, default=1000, help="test sentences (the first N)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_results_option(parser)
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint or args.work / "checkpoints" / "checkpoint_best.pt"
    sources = [line.replace("\t", " ")
               for line in (args.work / "split" / "test.de").read_text().splitlines()]
    references = (args.work / "split" / "test.en").read_text().splitlines()
    sources, references = sources[: args.lines], references[: args.lines]
    spm = SentencePieceProcessor(model_file=str(args.work / "spm" / "spm.model"))
    writable = {line.split(" ")[0] for line in (args.work / "bin" / "dict.en.txt").open()}
    print(cpu_description(), f"{args.threads} thread(s)")

    plain, plain_seconds = interactive(args.work, checkpoint, sources, "beam_translation",
                                       args.threads)  # fmt: skip
    terms = [glossary_terms(r, text, writable, spm)
             for r, (_, text) in zip(references, plain, strict=True)]  # fmt: skip
    constrained = ["\t".join([source, *sentence_terms])
                   for source, sentence_terms in zip(sources, terms, strict=True)]  # fmt: skip
    ours = interactive(args.work, checkpoint, constrained, "beam_translation", args.threads,
                       "--constraints", "unordered")  # fmt: skip
    # A sentence whose terms no hypothesis met within the maximum length: ours refuses it
    # alone, fairseq's generator fails its whole run; both are left out of the comparison.
    kept = [i for i, (pieces, _) in enumerate(ours[0]) if pieces]
    met_all, _ = present(terms, ours[0], spm)
    total_all = sum(map(len, terms))
    print(f"{len(sources)} test sentences, {sum(map(bool, terms))} with terms, {total_all} "
          f"terms (at most {MAX_TERMS} a sentence); {len(sources) - len(kept)} sentences whose "
          f"terms no hypothesis met within the maximum length (ours: refused, terms counted "
          f"missing: {met_all}/{total_all} met; fairseq: fails its run) are left out below")

    def only_kept(items: list) -> list:
        return [items[i] for i in kept]

    terms, references = only_kept(terms), only_kept(references)
    # (row, system): the run without the glossary is a row of its own (the tables' columns
    # are systems)
    runs = {("glossary-quality-without", "ours"): (only_kept(plain), plain_seconds),
            ("glossary-quality", "ours"): (only_kept(ours[0]), ours[1])}  # fmt: skip
    runs["glossary-quality", "fairseq"] = interactive(
        args.work, checkpoint, only_kept(constrained), "translation", args.threads,
        "--constraints", "unordered",
    )  # fmt: skip
    total = sum(map(len, terms))
    compared = zip(runs["glossary-quality", "ours"][0], runs["glossary-quality", "fairseq"][0],
                   strict=True)  # fmt: skip
    same = sum(a == b for a, b in compared)
    what = (f"demo ConvS2S de-en, {len(kept)} of the first {len(sources)} test sentences, a "
            f"glossary of 1 to {MAX_TERMS} reference words a sentence: terms in the output, "
            "BLEU")  # fmt: skip
    whats = {"glossary-quality": what,
             "glossary-quality-without": "the same sentences without the glossary"}
    records = []
    for (row, system), (translations, seconds) in runs.items():
        met, whole = present(terms, translations, spm)
        bleu = BLEU().corpus_score([text for _, text in translations], [references]).score
        label = system if row == "glossary-quality" else f"{system}, no glossary"
        print(f"{label:18s} terms present {met}/{total} ({met / total:.2%}; as whole words "
              f"{whole / total:.2%}), BLEU {bleu:.2f}, {seconds:.0f} s (process included)")
        records.append(record(
            table=table_name(), row=row, what=whats[row], system=system,
            model="demo ConvS2S", precision="float32", batch=None,
            batch_label="100 lines a buffer, beam 5", bleu=round(bleu, 2),
            terms_present=round(met / total, 4), terms_whole_words=round(whole / total, 4),
            same_as_reference=f"{same}/{len(kept)} translations"
            if (row, system) == ("glossary-quality", "ours") else None,
            command=command_line(), **machine(threads=args.threads),
        ))  # fmt: skip
    records.sort(key=lambda one: one["row"] != "glossary-quality")  # the tables' order
    print(f"ours constrained = fairseq constrained on {same}/{len(kept)} translations")
    append_records(args.results, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
