"""Documents through beamplugin-serve, measured against the goals of sentence splitting:

    python -m benchmarks.documents --data DATA-BIN --path CKPT.pt --spm SPM.model \\
        --source TEST.de --reference TEST.en [--results benchmarks/results/cpu-avx512.jsonl]

(a) the test set's first 50 sentences joined five a paragraph: the paragraphs sent as texts
    (split into sentences by the server) against the same sentences sent alone and joined:
    the share of paragraphs identical (goal 100%), and BLEU against the references joined the
    same way for both and for the paragraphs unsplit (``split_sentences: false``: each a
    single "sentence", the server's behaviour before documents);
(b) a document of ``--paragraphs`` paragraphs (``--per-paragraph`` test sentences each, a blank
    line between) in one ``/translate`` request against the same sentences as a list (one
    request, ``split_sentences: false``), in alternating rounds: sentences per CPU-second of
    the server's processes (the wall clock beside it: on a shared CPU it mostly measures how
    much of it the server got) and the ratio (goal >= 0.9), and how many paragraphs are their
    lines' translations joined (of those the segmenter cuts into their lines);
(c) 100 HTML snippets from a generator of its own (seed 2027; shapes the tests do not use:
    headings, tables, quotes, abbreviations, nested spans, character references, inline and
    block ``translate="no"``), filled with test sentences: how many keep the input's tag tree
    (read by lxml), keep what is not to be translated byte for byte, and have their text
    translated.

The server runs on 127.0.0.1 as a subprocess (benchmarks.server's, stopped at the end) on the
threads given. With ``--results``, one JSON line a figure is appended (benchmarks.common's
records, which benchmarks/render_tables.py renders).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import lxml.html
import sacrebleu
import torch

from beamplugin.serving.documents.sentences import segments
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
from benchmarks.server import ServerProcess

DEMO = ROOT / "data" / "work"  # make demo's
MOST_QUEUED = 1024  # benchmarks.server's --max-queued
KEPT = re.compile(r'<(script|style|code)\b.*?</\1>|<(\w+) translate="no">.*?</\2>|<!--.*?-->', re.S)


async def _post(url: str, body: dict[str, Any]) -> Any:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/translate", json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {answer}")
            return answer["translatedText"]


def translate(url: str, q: str | list[str], **fields: Any) -> Any:
    return asyncio.run(_post(url, {"q": q, "source": "de", "target": "en", **fields}))


def paragraphs_against_sentences(url: str, source: list[str], reference: list[str]) -> dict:
    """(a): 50 sentences, five a paragraph."""
    sentences, refs = source[:50], reference[:50]
    groups = [range(start, start + 5) for start in range(0, 50, 5)]
    paragraphs = [" ".join(sentences[i] for i in group) for group in groups]
    alone = translate(url, sentences, split_sentences=False)
    joined = [" ".join(alone[i] for i in group) for group in groups]
    split = translate(url, paragraphs)
    unsplit = translate(url, paragraphs, split_sentences=False)
    references = [[" ".join(refs[i] for i in group) for group in groups]]
    return {
        "identical": sum(a == b for a, b in zip(split, joined, strict=True)),
        "paragraphs": len(paragraphs),
        "bleu_alone": sacrebleu.corpus_bleu(joined, references).score,
        "bleu_split": sacrebleu.corpus_bleu(split, references).score,
        "bleu_unsplit": sacrebleu.corpus_bleu(unsplit, references).score,
    }


def document_against_list(
    server: ServerProcess, source: list[str], paragraphs: int, per_paragraph: int, rounds: int
) -> dict:
    """(b): one document of ``paragraphs`` paragraphs against its sentences as a list, in
    alternating rounds (a warm-up first); the ratio of sentences per CPU-second of the server,
    the median of the rounds' (wall-clock rates printed beside it)."""
    url = server.url
    needed = paragraphs * per_paragraph
    sentences = (source * (needed // len(source) + 1))[:needed]
    document = "\n\n".join(" ".join(sentences[p * per_paragraph : (p + 1) * per_paragraph])
                           for p in range(paragraphs))  # fmt: skip
    translate(url, sentences[:100], split_sentences=False)  # warm-up: kernels' trials, caches
    wall: dict[str, list[float]] = {"document": [], "list": []}
    cpu: dict[str, list[float]] = {"document": [], "list": []}
    answers: dict[str, Any] = {}
    for _ in range(rounds):
        calls = (("document", lambda: translate(url, document)),
                 ("list", lambda: translate(url, sentences, split_sentences=False)))
        for system, call in calls:
            started, cpu_before = time.perf_counter(), server.cpu_seconds()
            answers[system] = call()
            wall[system].append(time.perf_counter() - started)
            cpu[system].append(server.cpu_seconds() - cpu_before)
    # A paragraph the segmenter cuts into its lines is its lines' translations joined; not one
    # with two sentences on a line of the test set, or two lines it reads as one sentence.
    comparable = identical = 0
    for p, (translated, paragraph) in enumerate(zip(answers["document"].split("\n\n"),
                                                    document.split("\n\n"), strict=True)):
        cut = segments(paragraph, "de", lambda _: True, True)
        lines = sentences[p * per_paragraph : (p + 1) * per_paragraph]
        if [paragraph[s.core_start : s.core_end] for s in cut] == lines:
            comparable += 1
            identical += translated == " ".join(
                answers["list"][p * per_paragraph : (p + 1) * per_paragraph])
    return {
        "sentences": needed,
        "document_per_s": needed / statistics.median(wall["document"]),
        "list_per_s": needed / statistics.median(wall["list"]),
        "document_per_cpu_s": needed / statistics.median(cpu["document"]),
        "list_per_cpu_s": needed / statistics.median(cpu["list"]),
        "ratio": statistics.median(c_list / c_doc for c_doc, c_list in zip(
            cpu["document"], cpu["list"], strict=True)),  # fmt: skip
        "wall_ratio": statistics.median(w_list / w_doc for w_doc, w_list in zip(
            wall["document"], wall["list"], strict=True)),  # fmt: skip
        "identical": identical,
        "comparable": comparable,
    }


def snippet(rng: random.Random, sentences: list[str]) -> str:
    """An HTML snippet of shapes the tests' generator does not make."""

    def inline(text: str, depth: int) -> str:
        words = text.split()
        if depth > 2 or len(words) < 3:
            return " ".join(words)
        cut = sorted(rng.sample(range(1, len(words)), 2))
        head, middle, tail = words[: cut[0]], words[cut[0] : cut[1]], words[cut[1] :]
        inner = inline(" ".join(middle), depth + 1)
        wrapped = rng.choice([
            f'<a href="https://example.org/s?q={depth}&amp;l=de" rel="nofollow">{inner}</a>',
            f"<em>{inner}</em>", f"<mark>{inner}</mark>", f'<abbr title="Abkürzung">{inner}</abbr>',
            f"<q>{inner}</q>", f'<span class="k{depth}" data-id="{rng.randint(1, 99)}"><small>'
            f"{inner}</small></span>", f'<span translate="no" lang="de">{inner}</span>',
        ])  # fmt: skip
        extra = rng.choice(["", " &mdash;", " &#x2014;", " &auml;&szlig;", " &copy; 2027",
                            " &quot;x&quot;", " <!-- Hinweis -->", " <wbr>"])  # fmt: skip
        return " ".join([*head, wrapped + extra, *tail])

    def text() -> str:
        return " ".join(inline(rng.choice(sentences), 0) for _ in range(rng.randint(1, 2)))

    blocks = []
    for _ in range(rng.randint(1, 3)):
        blocks.append(rng.choice([
            f'<h2 id="h{rng.randint(1, 9)}">{text()}</h2>',
            f"<blockquote cite=\"https://example.org\"><p>{text()}</p></blockquote>",
            f"<table><tr><th>{text()}</th><td class=n>{text()}</td></tr></table>",
            f'<section translate="no"><p>{text()}</p></section>',
            f"<p>{text()}<br/>{text()}</p>",
            f"<dl><dt>{text()}</dt><dd>{text()}</dd></dl>",
        ]))  # fmt: skip
    return "\n".join(blocks)


def tag_tree(markup: str) -> list:
    """Tags, attributes and comments of ``markup`` as lxml reads it, the text of elements with
    translate="no" included."""

    def shape(element: Any) -> list:
        if not isinstance(element.tag, str):
            return ["comment", element.text]
        kept = element.get("translate") == "no"
        return [element.tag, sorted(element.attrib.items()),
                element.text_content() if kept else None, [shape(c) for c in element]]  # fmt: skip

    return shape(lxml.html.fragment_fromstring(markup, create_parent="div"))


def html_snippets(url: str, source: list[str], count: int) -> dict:
    """(c): ``count`` snippets in one request."""
    rng = random.Random(2027)
    snippets = [snippet(rng, source[50:]) for _ in range(count)]
    translated = translate(url, snippets, format="html")

    def outside_kept(markup: str) -> str:
        body = lxml.html.fragment_fromstring(KEPT.sub("", markup), create_parent="div")
        return " ".join(body.text_content().split())

    pairs = list(zip(snippets, translated, strict=True))
    # a snippet whose every block is translate="no" has nothing to translate
    translatable = [(s, t) for s, t in pairs if outside_kept(s)]
    return {
        "snippets": count,
        "same_tree": sum(tag_tree(t) == tag_tree(s) for s, t in pairs),
        "kept": sum(KEPT.findall(t) == KEPT.findall(s) for s, t in pairs),
        "translatable": len(translatable),
        "translated": sum(outside_kept(t) != outside_kept(s) for s, t in translatable),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEMO / "bin")
    parser.add_argument("--path", type=Path, default=DEMO / "checkpoints" / "checkpoint_best.pt")
    parser.add_argument("--spm", type=Path, default=DEMO / "spm" / "spm.model")
    parser.add_argument("--source", type=Path, default=DEMO / "split" / "test.de")
    parser.add_argument("--reference", type=Path, default=DEMO / "split" / "test.en")
    parser.add_argument("--paragraphs", type=int, default=200)
    parser.add_argument("--per-paragraph", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--snippets", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--beam", type=int, default=5)
    add_results_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = args.source.read_text().splitlines()
    reference = args.reference.read_text().splitlines()
    most = max(args.paragraphs * args.per_paragraph, args.snippets, 50)
    if most > MOST_QUEUED:
        parser.error(f"at most {MOST_QUEUED} sentences a request (the server's queue)")
    server = ServerProcess([
        str(args.data), "--path", str(args.path), "--beam", str(args.beam), "--bpe",
        "sentencepiece", "--sentencepiece-model", str(args.spm), "-s", "de", "-t", "en",
        "--cpu", "--max-request-sentences", str(most),
        "--max-body-bytes", str(16 << 20),
    ], args.threads)  # fmt: skip
    try:
        split = paragraphs_against_sentences(server.url, source, reference)
        throughput = document_against_list(server, source, args.paragraphs,
                                           args.per_paragraph, args.rounds)  # fmt: skip
        snippets = html_snippets(server.url, source, args.snippets)
    finally:
        server.stop()
    print(cpu_description())
    print(f"(a) paragraphs split = sentences alone, joined: {split['identical']} of "
          f"{split['paragraphs']}; BLEU sentences alone {split['bleu_alone']:.2f}, paragraphs "
          f"split {split['bleu_split']:.2f}, unsplit {split['bleu_unsplit']:.2f}")
    print(f"(b) {args.paragraphs} paragraphs ({throughput['sentences']} sentences), medians of "
          f"{args.rounds} rounds: document {throughput['document_per_cpu_s']:.1f} sentences per "
          f"CPU-second of the server, list {throughput['list_per_cpu_s']:.1f}, ratio "
          f"{throughput['ratio']:.2f}; wall clock: document {throughput['document_per_s']:.1f} "
          f"sent/s, list {throughput['list_per_s']:.1f}, ratio {throughput['wall_ratio']:.2f}; "
          f"paragraphs identical to the list's translations "
          f"joined: {throughput['identical']} of the {throughput['comparable']} cut into their "
          "lines")
    print(f"(c) {snippets['snippets']} HTML snippets: tag tree identical {snippets['same_tree']}, "
          f"untranslated parts kept {snippets['kept']}, text translated in "
          f"{snippets['translated']} of the {snippets['translatable']} with text to translate")
    append_records(args.results, records(args, split, throughput, snippets))


def records(args: argparse.Namespace, split: dict, throughput: dict, snippets: dict) -> list:
    """The figures as records (benchmarks.common's), one a row of the results table."""
    base = {
        "table": table_name(), "system": "ours", "model": "convs2s demo",
        "precision": "float32", "batch_label": "one request", "command": command_line(),
        **machine(threads=args.threads),
    }  # fmt: skip
    share = split["identical"] / split["paragraphs"]
    rows = [
        {"row": "documents-alone", "what": "50 test sentences translated alone, joined 5 a "
         "paragraph (BLEU of the paragraphs)", "bleu": split["bleu_alone"]},
        {"row": "documents-split", "what": "the same 10 paragraphs sent as texts, split into "
         "sentences (share identical to the sentences alone, joined)", "bleu": split["bleu_split"],
         "ratio": {"against": "share identical", "value": share}},
        {"row": "documents-unsplit", "what": "the same 10 paragraphs unsplit (split_sentences: "
         "false)", "bleu": split["bleu_unsplit"]},
        {"row": "documents-throughput", "what": f"a {args.paragraphs}-paragraph document "
         f"({throughput['sentences']} sentences) in one /translate, against its sentences as "
         "a list (sentences per CPU-second of the server)",
         "sentences_per_s": throughput["document_per_cpu_s"],
         "ratio": {"against": "the list", "value": throughput["ratio"]}},
        {"row": "documents-html", "what": f"{snippets['snippets']} HTML snippets (seed 2027): "
         "share with the input's tag tree", "ratio": {
             "against": "share with the same tag tree",
             "value": snippets["same_tree"] / snippets["snippets"]}},
    ]  # fmt: skip
    return [record(**base, **row) for row in rows]


if __name__ == "__main__":
    main()
