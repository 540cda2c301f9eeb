"""Documents through beamplugin-serve for real (a server process on 127.0.0.1 with the tests'
toy model): a text cut into sentences comes back as the translations of its sentences, each
sent alone, put together with the text's own blanks and breaks; HTML comes back with the same
tag tree and its text translated; bad input gets a clear 400 or loses nothing, and the decoder
goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from html_tools import tag_tree, text_of
from server_tools import LINES, Server, model_options, shared_toy_model

from beamplugin.serving.documents.sentences import segments

# Capitals: sentencex starts a sentence after a full stop only before one.
S = [line[0].upper() + line[1:] for line in LINES]
POSITIONS = 256  # the model's source positions here: a 10,000-character sentence is cut


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return shared_toy_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(toy):
    server = Server(model_options(toy) + ["--batch-size", "8", "--max-source-positions",
                                          str(POSITIONS)])  # fmt: skip
    yield server
    assert server.stop() == 0


def post(url: str, bodies: list[dict], path: str = "/translate") -> list[tuple[int, dict]]:
    """Every body POSTed at once, each from a client of its own."""

    async def one(body: dict) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, json=body) as response:
                return response.status, await response.json()

    async def every() -> list[tuple[int, dict]]:
        return await asyncio.gather(*(one(body) for body in bodies))

    return asyncio.run(asyncio.wait_for(every(), 120))


def alone(url: str, sentences: list[str], alternatives: int = 0) -> dict:
    """The translations of ``sentences``, each as one sentence."""
    body = {"q": sentences, "source": "de", "target": "en", "split_sentences": False,
            "alternatives": alternatives}  # fmt: skip
    [(status, answer)] = post(url, [body])
    assert status == 200, answer
    return answer


def test_a_text_comes_back_as_its_sentences_translated_alone_in_its_own_shape(server):
    first = f"  {S[0]}. {S[1]}!  {S[2]}?\n{S[3]}\n\n\t{S[4]}.\n 12.\n"
    second = f"{S[5]}.\r\n{S[6]}... {S[7]}."
    sentences = [f"{S[0]}.", f"{S[1]}!", f"{S[2]}?", S[3], f"{S[4]}.", f"{S[5]}.",
                 f"{S[6]}...", f"{S[7]}."]  # fmt: skip
    body = {"q": [first, second], "source": "de", "target": "en", "alternatives": 1}
    [(status, answer), (one_status, one)] = post(server.url, [body, {**body, "q": first}])
    reference = alone(server.url, sentences, alternatives=1)

    def shaped(t: list[str]) -> list[str]:
        return [f"  {t[0]} {t[1]}  {t[2]}\n{t[3]}\n\n\t{t[4]}\n 12.\n", f"{t[5]}\r\n{t[6]} {t[7]}"]

    assert status == one_status == 200, (answer, one)
    assert answer["translatedText"] == shaped(reference["translatedText"])
    assert answer["alternatives"] == [[text] for text in shaped(
        [alternatives[0] for alternatives in reference["alternatives"]]
    )]  # fmt: skip
    assert one["translatedText"] == answer["translatedText"][0]


def test_a_document_counts_as_one_text_however_many_sentences_it_has(server):
    """--max-request-sentences (64 here) counts the texts of a request, not their sentences:
    a document of 70 sentences comes back as they are translated alone (its sentences go to
    the engine in windows); 65 texts are refused."""
    sentences = [f"{S[i % len(S)]}." for i in range(70)]
    pair = {"source": "de", "target": "en"}
    [(status, answer), too_many] = post(server.url, [{"q": " ".join(sentences), **pair},
                                                     {"q": [S[0]] * 65, **pair}])  # fmt: skip
    reference = [text for half in (sentences[:35], sentences[35:])
                 for text in alone(server.url, half)["translatedText"]]  # fmt: skip
    assert (status, answer) == (200, {"translatedText": " ".join(reference)})
    assert too_many == (400, {"error": "65 texts: a request has 1 to 64"})


def test_split_sentences_false_sends_a_text_as_one_sentence(server):
    text = f"{S[8]}. {S[9]}."
    [(status, answer)] = post(server.url, [{"q": text, "source": "de", "target": "en",
                                            "split_sentences": False}])  # fmt: skip
    [(v1_status, v1)] = post(server.url, [{"sentences": [text]}], path="/v1/translate")
    assert status == v1_status == 200
    assert answer["translatedText"] == v1["translations"][0]["hypotheses"][0]["text"]


HTML = (
    "<!DOCTYPE html>\n<html lang=de><head><title>{0}</title>"
    "<style>p > b {{ color: red }}</style></head>\n<body>\n"
    '<p class="lead">{1} <b>{2}</b> &amp; <a href="/a?x=1&amp;y=2" title="Titel">{3}</a>.'
    " {4}!</p>\n<!-- ein Kommentar -->\n<ul>\n  <li>{5}.</li>\n  <li><i>{6}</i></li>\n</ul>\n"
    '<p>{7} <code>ls -l &lt;dir&gt;</code> {8}.<br>{9}</p>\n<div translate="no"><p>{10}.</p></div>'
    "\n<script>var s = '<b>{11}.</b>';</script>\n</body></html>\n"
)


def test_html_keeps_its_tag_tree_and_gets_its_text_translated(server):
    words = [line.split()[0] for line in S[:12]]
    page = HTML.format(*words)
    [(status, answer)] = post(server.url, [{"q": page, "source": "de", "target": "en",
                                            "format": "html"}])  # fmt: skip
    assert status == 200, answer
    translated = answer["translatedText"]
    assert tag_tree(translated) == tag_tree(page)
    for kept in ("<!-- ein Kommentar -->", "<code>ls -l &lt;dir&gt;</code>",
                 f'<div translate="no"><p>{words[10]}.</p></div>', '<a href="/a?x=1&amp;y=2"',
                 f"<script>var s = '<b>{words[11]}.</b>';</script>"):  # fmt: skip
        assert kept in translated
    blocks = [words[0], f"{words[1]} {words[2]} & {words[3]}.", f"{words[4]}!",
              f"{words[5]}.", words[6], f"{words[7]} {words[8]}.", words[9]]  # fmt: skip
    t = alone(server.url, blocks)["translatedText"]
    body = translated.split("<body>")[1].split("<div")[0].replace("<br>", " <br>")
    assert text_of(body) == text_of(
        f"{t[1]} {t[2]} {t[3]} {t[4]} {t[5]} ls -l &lt;dir&gt; {t[6]}"
    ), translated  # the text around <code>, <b> and <a> translated as one sentence
    assert f"<title>{t[0]}</title>" in translated


def test_bad_input_gets_a_clear_400_or_loses_nothing(server, toy):
    import sentencepiece

    pieces = sentencepiece.SentencePieceProcessor(model_file=str(toy["spm"]))

    def fits(text: str) -> bool:  # as the server counts: sentencepiece's pieces, then EOS
        return len(pieces.encode(text.strip(), out_type=str)) + 1 <= POSITIONS

    long = " ".join(LINES * 40)[:10_000].rsplit(" ", 1)[0]  # 10,000 characters, no full stop
    assert not fits(long)
    broken = f"<p>{S[0]} <b>{LINES[1]}"
    pair = {"source": "de", "target": "en"}
    answers = post(server.url, [
        {"q": long, **pair}, {"q": broken, "format": "html", **pair},
        {"q": "", **pair}, {"q": [S[0], " \n "], **pair}, {"q": "", "format": "html", **pair},
        {"q": S[0], "format": "pdf", **pair}, {"q": S[0], "split_sentences": "maybe", **pair},
        {"q": [S[0], "Ein \ud800 Satz."], **pair},
    ])  # fmt: skip
    cut = [long[s.core_start : s.core_end] for s in segments(long, "de", fits, True)]
    assert len(cut) > 1 and all(fits(piece) for piece in cut) and " ".join(cut) == long
    assert answers[0] == (200, {"translatedText": " ".join(alone(server.url, cut)[
        "translatedText"])})  # fmt: skip
    assert answers[1][0] == 200 and tag_tree(answers[1][1]["translatedText"]) == tag_tree(broken)
    assert answers[2] == (400, {"error": "'q' is empty: there is nothing to translate"})
    assert answers[3] == (400, {"error": "'q' item 1 is empty: there is nothing to translate"})
    assert answers[4][0] == 400
    assert answers[5] == (400, {"error": "'format' must be 'text' or 'html'"})
    assert answers[6] == (400, {"error": "'split_sentences' must be true or false"})
    assert answers[7] == (400, {"error": "'q' item 1 is not valid UTF-8: the lone surrogate "
                                         "U+D800 at character 4"})  # fmt: skip
    # and the decoder goes on
    assert alone(server.url, [S[0]])["translatedText"][0]


def test_detect_and_auto_answer_the_one_source_language_with_the_detectors_confidence(server):
    german, english = "Das Wetter ist heute schön.", "The weather is nice today."
    answers = post(server.url, [{"q": german}, {"q": english}], path="/detect")
    [(status, html_answer)] = post(server.url, [{
        "q": f"<p>{german} <b>{S[0]}</b></p>", "source": "auto", "target": "en",
        "format": "html",
    }])  # fmt: skip
    (_, [de_in_german]), (_, [de_in_english]) = answers
    assert de_in_german["language"] == de_in_english["language"] == "de"
    assert de_in_german["confidence"] > 90 > 10 > de_in_english["confidence"]
    assert status == 200 and html_answer["detectedLanguage"]["language"] == "de"
    assert html_answer["detectedLanguage"]["confidence"] > 90  # its text's, not its tags
