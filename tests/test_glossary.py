"""Glossaries on /translate: a server started with --constraints puts the target term of every
source term found in a sentence in its translation, as fairseq-interactive --constraints does
with that target after a tab; sentences without terms are translated as without a glossary; bad
glossaries get 400."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
from fairseq_tools import run_tool
from openapi_spec_validator import validate
from server_tools import (
    Server,
    check_against_spec,
    model_options,
    shared_toy_model,
    status_and_json,
)

from beamplugin.serving.cli import parse_args
from beamplugin.serving.glossary import Glossary, Term, constraints_of, read_glossary
from beamplugin.serving.requests import Served, glossary_field
from beamplugin.serving.responses import Refused

# toy sentences (fairseq_tools.TOY_WORDS): "hund" in the first two, no term in the third
DOG, DOG_HERE, NO_TERM = "der hund schläft", "die rote katze und der hund", "die frau lacht oft"
HUND_CAT = {"source": "hund", "target": "cat"}


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return shared_toy_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(toy, tmp_path_factory):
    animals = tmp_path_factory.mktemp("glossaries") / "animals.tsv"
    animals.write_text("hund\tcat\n\nmann\twoman\n")
    server = Server(model_options(toy) + ["--constraints", "unordered", "--glossary-max-terms",
                                          "3", "--glossary", str(animals)])  # fmt: skip
    yield server
    assert server.stop() == 0


def interactive_hypotheses(toy, order: str, lines: list[str]) -> dict[str, list[tuple[float, str]]]:
    """fairseq-interactive --constraints ``order``'s hypotheses of each line (constraints after
    tabs), best first: (base-2 score, D- text)."""
    out = run_tool(
        "fairseq-interactive", "--user-dir", "beamplugin", "--task", "beam_translation",
        *model_options(toy), "--constraints", order, stdin="\n".join(lines) + "\n",
    ).stdout  # fmt: skip
    hypotheses: dict[str, list[tuple[float, str]]] = {}
    for line in out.splitlines():
        kind, _, rest = line.partition("\t")
        if kind.startswith("D-"):
            score, text = rest.split("\t")
            hypotheses.setdefault(lines[int(kind[2:])], []).append((float(score), text))
    return hypotheses


@pytest.fixture(scope="module")
def unordered(toy) -> dict[str, list[tuple[float, str]]]:
    return interactive_hypotheses(toy, "unordered", [f"{DOG}\tcat", f"{DOG_HERE}\tcat", NO_TERM,
                                                     DOG])  # fmt: skip


@pytest.fixture(scope="module")
def interactive(unordered) -> dict[str, str]:
    """fairseq-interactive --constraints unordered's best translation of each line."""
    return {line: hypotheses[0][1] for line, hypotheses in unordered.items()}


def translate(
    server: Server, bodies: list[dict], path: str = "/translate"
) -> list[tuple[int, dict]]:
    """Each body's answer to ``path``, every one of them as the server's /spec (valid OpenAPI)
    declares it."""

    async def scenario() -> tuple[dict, list[tuple[int, dict]]]:
        async with aiohttp.ClientSession() as session:
            spec = await status_and_json(session.get(server.url + "/spec"))
            return spec[1], [
                await status_and_json(session.post(server.url + path, json=body))
                for body in bodies
            ]

    spec, answers = asyncio.run(asyncio.wait_for(scenario(), 60))
    validate(spec)
    for status, answer in answers:
        check_against_spec(spec, "post", path, (status, "application/json", answer))
    return answers


def test_terms_found_put_their_targets_in_and_are_named(server, interactive):
    plain = {"source": "de", "target": "en", "split_sentences": False}
    bodies = [
        {**plain, "q": DOG, "glossary": [HUND_CAT]},
        {**plain, "q": DOG},
        # a request mixing sentences with and without terms
        {**plain, "q": [DOG_HERE, NO_TERM], "glossary": [HUND_CAT, {"source": "mann",
                                                                    "target": "woman"}]},
        # the glossary loaded with --glossary, by name
        {**plain, "q": [DOG_HERE, NO_TERM], "glossary": "animals"},
        # case as the glossary writes it: "Hund" is not "hund"
        {**plain, "q": DOG, "glossary": [{"source": "Hund", "target": "cat"}]},
        # a text document, cut into sentences (at line breaks): each one's terms in its
        # translation, the document's named once each
        {"source": "de", "target": "en", "q": f"{DOG}\n{DOG_HERE}", "glossary": [HUND_CAT]},
    ]
    answers = translate(server, bodies)
    assert [status for status, _ in answers] == [200] * len(bodies), answers
    with_term, without, mixed, named, other_case, document = (answer for _, answer in answers)
    applied = [{"source": "hund", "target": "cat"}]
    assert with_term == {"translatedText": interactive[f"{DOG}\tcat"], "glossaryApplied": applied}
    assert "cat" in with_term["translatedText"]
    assert without == {"translatedText": interactive[DOG]}
    assert interactive[DOG] != interactive[f"{DOG}\tcat"]  # the term changed something
    assert mixed == {
        "translatedText": [interactive[f"{DOG_HERE}\tcat"], interactive[NO_TERM]],
        "glossaryApplied": [applied, []],
    }
    assert named == mixed
    assert other_case == {"translatedText": interactive[DOG], "glossaryApplied": []}
    assert document["glossaryApplied"] == applied
    both = [interactive[f"{DOG}\tcat"], interactive[f"{DOG_HERE}\tcat"]]
    assert document == {"translatedText": "\n".join(both), "glossaryApplied": applied}


def test_nbest_endpoint_takes_the_glossary_as_translate_does(server, unordered):
    """/v1/translate: each sentence's hypotheses (texts and base-2 scores) are
    fairseq-interactive --constraints's, with the terms found named per sentence."""
    sentences = [DOG, DOG_HERE, NO_TERM]
    bodies = [
        {"sentences": sentences, "nbest": 2, "glossary": [HUND_CAT]},
        {"sentences": [DOG_HERE], "glossary": "animals"},
        {"sentences": [DOG], "nbest": 2},
        {"sentences": [DOG], "glossary": [HUND_CAT] * 2},
    ]
    answers = translate(server, bodies, "/v1/translate")
    assert [status for status, _ in answers] == [200, 200, 200, 400], answers
    (_, terms), (_, named), (_, plain), (_, bad) = answers
    applied = [{"source": "hund", "target": "cat"}]
    wanted = [unordered[f"{DOG}\tcat"], unordered[f"{DOG_HERE}\tcat"], unordered[NO_TERM]]
    for translation, expected, found in zip(terms["translations"], wanted,
                                            [applied, applied, []], strict=True):  # fmt: skip
        assert translation["glossaryApplied"] == found
        hypotheses = translation["hypotheses"]
        assert [h["text"] for h in hypotheses] == [text for _, text in expected]
        assert [h["score"] for h in hypotheses] == pytest.approx([s for s, _ in expected],
                                                                 rel=1e-6)  # fmt: skip
    assert named["translations"][0]["hypotheses"][0] == terms["translations"][1]["hypotheses"][0]
    assert named["translations"][0]["glossaryApplied"] == applied
    (translation,) = plain["translations"]
    assert "glossaryApplied" not in translation
    assert [h["text"] for h in translation["hypotheses"]] == [t for _, t in unordered[DOG]]
    assert bad == {"error": "'glossary' item 1: the source term 'hund' is there twice"}


def test_ordered_constraints_follow_the_sentence_not_the_glossary(toy):
    """With --constraints ordered, the target terms go in as the source terms stand in the
    sentence (whatever the glossary's order), as fairseq-interactive --constraints ordered
    with those targets after tabs in that order."""
    line = "die frau lacht oft"
    reference = interactive_hypotheses(toy, "ordered", [f"{line}\tdog\tsings"])
    server = Server(model_options(toy) + ["--constraints", "ordered"])
    try:
        glossary = [{"source": "lacht", "target": "sings"}, {"source": "frau", "target": "dog"}]
        plain = {"source": "de", "target": "en", "split_sentences": False, "q": line}
        (status, answer), (nbest_status, nbest) = [
            translate(server, [{**plain, "glossary": glossary}])[0],
            translate(server, [{"sentences": [line], "nbest": 2, "glossary": glossary}],
                      "/v1/translate")[0],
        ]  # fmt: skip
    finally:
        assert server.stop() == 0
    expected = reference[f"{line}\tdog\tsings"]
    assert status == nbest_status == 200
    assert answer == {"translatedText": expected[0][1],
                      "glossaryApplied": [glossary[1], glossary[0]]}  # fmt: skip
    hypotheses = nbest["translations"][0]["hypotheses"]
    assert [h["text"] for h in hypotheses] == [text for _, text in expected]
    words = expected[0][1].split()
    assert words.index("dog") < words.index("sings")


def test_bad_glossaries_get_400(server):
    base = {"source": "de", "target": "en", "q": DOG}
    too_many = [{"source": f"w{i}", "target": "cat"} for i in range(4)]
    bodies = [
        {**base, "glossary": [{"source": " ", "target": "cat"}]},
        {**base, "glossary": [{"source": "hund", "target": ""}]},
        {**base, "glossary": too_many},
        {**base, "glossary": {"hund": "cat"}},
        {**base, "glossary": [HUND_CAT, HUND_CAT]},
        {**base, "glossary": [{"source": "hund", "target": "ЖЖЖ"}]},
        {**base, "glossary": "plants"},
        # not UTF-8: refused as without a glossary, whether in a sentence or in a term
        {**base, "q": "der \ud800 hund", "glossary": [HUND_CAT], "split_sentences": False},
        {**base, "glossary": [{"source": "hund", "target": "c\ud800t"}]},
        # more target pieces than the maximum output length (--max-len-b 200)
        {**base, "glossary": [{"source": "hund", "target": "cat " * 201}]},
    ]
    answers = translate(server, [*bodies, {**base, "glossary": [HUND_CAT]}])
    # refused alone: the server goes on translating
    assert [status for status, _ in answers] == [400] * len(bodies) + [200], answers
    errors = [answer["error"] for _, answer in answers[:-1]]
    assert answers[-1][1]["glossaryApplied"] == [HUND_CAT]
    assert errors[0] == errors[1] == "'glossary' item 0 has an empty term"
    assert errors[2] == "'glossary' has 4 terms: at most 3 are taken"
    assert errors[3].startswith("'glossary' must be a glossary's name or a list of")
    assert errors[4] == "'glossary' item 1: the source term 'hund' is there twice"
    assert errors[5].startswith("'glossary': the target term 'ЖЖЖ' has pieces the model")
    assert errors[6] == "'glossary': no glossary is named 'plants' (the server's: animals)"
    assert errors[7] == "sentence 0: not valid UTF-8: U+D800 at character 5"
    assert re.fullmatch(r"the glossary cannot be met: constraints of \d+ tokens in all cannot "
                        r"fit in the maximum output length of 200 tokens", errors[9])
    assert errors[8].endswith("has a side with nothing to match or write (blank, or not valid "
                              "UTF-8)")  # fmt: skip


def test_glossary_needs_constraints_and_reads_forms():
    served = Served(None, 4, 1, False, None, constraints=None, glossary_terms=3)  # type: ignore[arg-type]
    with pytest.raises(Refused, match="without --constraints"):
        glossary_field({"glossary": [HUND_CAT]}, served)
    served = Served(None, 4, 1, False, None, constraints="ordered", glossary_terms=3)  # type: ignore[arg-type]
    assert glossary_field({"glossary": '[{"source": "hund", "target": "cat"}]'}, served) == [
        ("hund", "cat")
    ]
    assert glossary_field({}, served) is None


def test_glossary_files_are_read_strictly(toy, tmp_path, capsys):
    path = tmp_path / "terms.tsv"
    path.write_text("hund\tcat\n\n rote hund \tred dog\n")
    assert read_glossary(str(path)) == [("hund", "cat"), ("rote hund", "red dog")]
    for text, problem in [("hund cat\n", "not source<TAB>target"),
                          ("hund\tcat\thound\n", "not source<TAB>target"),
                          ("hund\t \n", "not source<TAB>target"),
                          ("hund\tcat\nhund\tdog\n", "the source term 'hund' is there twice")]:
        path.write_text(text)
        with pytest.raises(ValueError) as error:
            read_glossary(str(path))
        line = text.count("\n")
        assert str(error.value) == f"{path}:{line}: {problem}"
    with pytest.raises(SystemExit):  # a named glossary needs the constrained search
        parse_args(model_options(toy) + ["--glossary", str(path)])
    assert "--glossary needs --constraints" in capsys.readouterr().err


def test_leftmost_longest_matches_on_pieces():
    red_dog = Term("rote hund", "red dog", ("▁rote", "▁hund"), (7, 8))
    dog = Term("hund", "dog", ("▁hund",), (8,))
    hound = Term("Hund", "hound", ("▁H", "und"), (9,))
    glossary = Glossary([dog, red_dog, hound])
    pieces = ["▁der", "▁rote", "▁hund", "▁und", "▁der", "▁hund", "▁hund"]
    assert glossary.find(pieces) == [red_dog, dog]  # "hund" inside "rote hund" is not found
    assert glossary.find(["▁hund", "s"]) == [dog]  # pieces, not words: BPE decides
    assert constraints_of([red_dog, dog, Term("Hündin", "dog", ("▁Hündin",), (8,))]) == [
        [7, 8], [8]
    ]  # fmt: skip
