"""Files through beamplugin-serve for real (a server process on 127.0.0.1 with the tests' toy
model): ``POST /translate_file`` answers with a URL from which a file of the same format comes,
opened here by its own library (srt, lxml, python-docx, odfdo): a text file translated as
``/translate`` translates the text, an HTML file with the same tag tree, a subtitle file with the
same cues and timings, each cue translated as one sentence, a Word file with the same paragraphs and
runs (headers and footers translated too), an OpenDocument text with the same elements; a file too
large gets 413, one that is not a file to translate 400. And what is kept for download expires."""

from __future__ import annotations

import asyncio
import datetime
import io

import aiohttp
import docx
import odfdo
import pytest
import srt
from html_tools import tag_tree
from server_tools import LINES, Server, model_options, shared_toy_model

from beamplugin.serving.downloads import Downloads

S = [line[0].upper() + line[1:] for line in LINES]  # capitals: sentences start after "."
BODY_LIMIT = 100_000  # above an empty .docx's 36 kB
PAIR = {"source": "de", "target": "en"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    toy = shared_toy_model(tmp_path_factory)
    server = Server(model_options(toy) + ["--max-body-bytes", str(BODY_LIMIT)])
    yield server
    assert server.stop() == 0


async def _send(session: aiohttp.ClientSession, url: str, name: str, data: bytes,
                fields: dict) -> tuple[int, dict, bytes | None, str | None]:  # fmt: skip
    """POST ``data`` as the file ``name``: the status, the answer and, on 200, the file
    downloaded from its URL and the download's content type."""
    form = aiohttp.FormData(fields)
    form.add_field("file", data, filename=name)
    async with session.post(url + "/translate_file", data=form) as response:
        status, answer = response.status, await response.json()
    if status != 200:
        return status, answer, None, None
    async with session.get(answer["translatedFileUrl"]) as response:
        assert response.status == 200
        return status, answer, await response.read(), response.content_type


def send(url: str, files: list[tuple[str, bytes]], fields: dict = PAIR) -> list[tuple]:
    async def every() -> list[tuple]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_send(session, url, name, data, fields)
                                          for name, data in files))  # fmt: skip

    return asyncio.run(asyncio.wait_for(every(), 120))


def translate(url: str, body: dict) -> dict:
    async def one() -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/translate", json={**PAIR, **body}) as response:
                assert response.status == 200
                return await response.json()

    return asyncio.run(asyncio.wait_for(one(), 120))


def test_text_and_html_files_come_back_translated_as_translate_does(server):
    text = f"{S[0]}. {S[1]}!\n{S[2]}\n\n{S[3]}. {S[4]}?\n"
    page = (f'<!DOCTYPE html>\n<html><body><h1>{S[5]}</h1>\n<p class="x">{S[6]} <b>{S[7]}</b>.'
            f" {S[8]}.</p>\n<pre>{S[9]}</pre></body></html>\n")  # fmt: skip
    (t_status, t_answer, t_file, t_type), (h_status, _, h_file, h_type) = send(
        server.url, [("notes.txt", text.encode()), ("page.html", page.encode())]
    )
    assert t_status == h_status == 200
    assert t_answer["translatedFileUrl"].startswith(server.url + "/download_file/")
    assert t_answer["translatedFileUrl"].endswith("/notes.txt")
    assert (t_type, h_type) == ("text/plain", "text/html")
    assert t_file.decode() == translate(server.url, {"q": text})["translatedText"]
    translated_page = h_file.decode()
    assert translated_page == translate(server.url, {"q": page, "format": "html"})[
        "translatedText"]  # fmt: skip
    assert tag_tree(translated_page) == tag_tree(page)
    assert f"<pre>{S[9]}</pre>" in translated_page


def test_a_subtitle_file_keeps_its_cues_and_timings_and_has_each_cue_translated(server):
    cues = [
        srt.Subtitle(3, datetime.timedelta(seconds=1), datetime.timedelta(seconds=2.5), S[10]),
        srt.Subtitle(4, datetime.timedelta(seconds=3), datetime.timedelta(seconds=4),
                     f"{S[11]}\n{LINES[12]}."),  # one sentence on two lines
        srt.Subtitle(7, datetime.timedelta(minutes=1), datetime.timedelta(minutes=1, seconds=2),
                     "♪ 42 ♪"),  # nothing to translate: copied
    ]  # fmt: skip
    [(status, _, data, content_type)] = send(server.url, [("film.srt", srt.compose(
        cues, reindex=False).encode())])  # fmt: skip
    assert status == 200 and content_type == "application/x-subrip"
    back = list(srt.parse(data.decode()))
    assert [(c.index, c.start, c.end) for c in back] == [(c.index, c.start, c.end) for c in cues]
    alone = translate(server.url, {"q": [S[10], f"{S[11]} {LINES[12]}."],
                                   "split_sentences": False})["translatedText"]  # fmt: skip
    assert [c.content for c in back] == [*alone, "♪ 42 ♪"]


def test_a_word_file_keeps_its_runs_and_tables_and_has_each_paragraph_translated(server):
    document = docx.Document()
    document.sections[0].header.paragraphs[0].text = f"{S[2]}."
    document.sections[0].footer.paragraphs[0].text = f"{S[3]}!"
    document.add_heading(S[13], level=1)
    paragraph = document.add_paragraph(f"{S[14]} ")
    paragraph.add_run(LINES[15]).bold = True  # its own run, in the middle of a sentence
    paragraph.add_run(f". {S[16]}.")
    document.add_paragraph("42")  # nothing to translate: copied
    document.add_table(rows=1, cols=2).rows[0].cells[1].text = f"{S[17]}."
    sent = io.BytesIO()
    document.save(sent)
    [(status, _, data, content_type)] = send(server.url, [("brief.docx", sent.getvalue())])
    assert status == 200 and content_type.endswith("wordprocessingml.document")
    back = docx.Document(io.BytesIO(data))
    shape = [[(run.bold, run.style.name) for run in p.runs] for p in document.paragraphs]
    assert [[(run.bold, run.style.name) for run in p.runs] for p in back.paragraphs] == shape
    assert [p.style.name for p in back.paragraphs] == [p.style.name for p in document.paragraphs]
    texts = [p.text for p in document.paragraphs] + [f"{S[17]}.", f"{S[2]}.", f"{S[3]}!"]
    reference = translate(server.url, {"q": texts})["translatedText"]
    cells = back.tables[0].rows[0].cells
    section = back.sections[0]
    assert [p.text for p in back.paragraphs] + [cells[1].text] + [
        section.header.paragraphs[0].text, section.footer.paragraphs[0].text] == reference
    assert back.paragraphs[2].text == "42" and cells[0].text == ""
    assert all(run.text for run in back.paragraphs[1].runs)  # each run kept some words


def _odt_shape(document: odfdo.Document) -> list[tuple[str, dict]]:
    """Every element of the body with its attributes, in order: the file's structure, which
    translation keeps."""
    return [(e.tag, e.attributes) for e in document.body.get_elements("descendant::*")]


def test_an_opendocument_text_keeps_its_elements_and_has_each_paragraph_translated(server):
    document = odfdo.Document("text")
    body = document.body
    body.append(odfdo.Header(1, S[18]))
    paragraph = odfdo.Paragraph(f"{S[19]} ")
    paragraph.append(odfdo.Span(LINES[20], style="Strong_20_Emphasis"))  # inside a sentence
    paragraph.append(f".  {S[21]}.")  # two blanks: odfdo writes a text:s
    paragraph.append(odfdo.Note(note_id="ftn1", citation="1", body=f"{S[22]}."))
    body.append(paragraph)
    body.append(odfdo.Paragraph("42"))  # nothing to translate: copied
    table = odfdo.Table("T", width=2, height=1)
    table.set_value((1, 0), f"{S[23]}.")
    body.append(table)
    sent = io.BytesIO()
    document.save(sent)
    [(status, _, data, content_type)] = send(server.url, [("brief.odt", sent.getvalue())])
    assert status == 200 and content_type == "application/vnd.oasis.opendocument.text"
    back = odfdo.Document(io.BytesIO(data))
    assert _odt_shape(back) == _odt_shape(document)
    assert back.get_part("styles").serialize() == document.get_part("styles").serialize()
    texts = [S[18], f"{S[19]} {LINES[20]}.  {S[21]}.", f"{S[22]}.", f"{S[23]}."]
    heading, outer, note, cell = translate(server.url, {"q": texts})["translatedText"]
    # the first: the empty paragraph of odfdo's template
    paragraphs = back.body.get_elements("descendant::text:p | descendant::text:h")[1:]
    assert paragraphs[0].text == heading
    span = paragraphs[1].get_element("text:span")
    assert span.text and paragraphs[1].text  # each slot kept some words
    without_note = paragraphs[1].clone
    without_note.get_element("text:note").delete()
    assert " ".join(str(without_note).split()) == " ".join(outer.split())
    assert [str(p).strip() for p in paragraphs[2:]] == [note, "42", cell]


def test_files_too_large_or_not_to_translate_get_a_clear_413_or_400(server):
    over = ("x" * 80 + "\n") * (BODY_LIMIT // 81 + 1)
    answers = send(server.url, [
        ("big.txt", over.encode()), ("a.pdf", b"%PDF-1.4"), ("README", b"Hallo."),
        ("empty.txt", b" \n\n"), ("latin1.txt", "Grüße.".encode("latin-1")),
        ("broken.srt", b"1\nnot a timing\nHallo.\n"), ("broken.docx", b"PK\x03\x04 no zip"),
        ("broken.odt", b"PK\x03\x04 no zip"), ("empty.odt", b""),
    ])  # fmt: skip
    assert [(status, answer) for status, answer, *_ in answers] == [
        (413, {"error": f"the file is too large: a request may have at most {BODY_LIMIT} bytes "
                        "(--max-body-bytes)"}),
        (400, {"error": "'file': .pdf is not translated; these are: .txt, .html, .htm, .srt, "
                        ".docx, .odt"}),
        (400, {"error": "'file': a name without extension is not translated; these are: "
                        ".txt, .html, .htm, .srt, .docx, .odt"}),
        (400, {"error": "'file' is empty: there is nothing to translate"}),
        (400, {"error": "'file' is not valid UTF-8: byte 0xfc at 2"}),
        (400, {"error": answers[5][1]["error"]}),
        (400, {"error": answers[6][1]["error"]}),
        (400, {"error": "'file' is not an OpenDocument text (.odt)"}),
        (400, {"error": "'file' is not an OpenDocument text (.odt)"}),
    ]  # fmt: skip
    assert answers[5][1]["error"].startswith("'file' is not a SubRip file")
    assert answers[6][1]["error"].startswith("'file' is not a .docx document")
    [(status, answer, *_)] = send(server.url, [("a.txt", b"Hallo.")], fields={"source": "de"})
    assert (status, answer) == (400, {"error": "'source' and 'target' are required (language "
                                               "codes)"})  # fmt: skip

    async def unknown() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + "/download_file/nothing/a.txt") as response:
                return response.status, await response.json()

    assert asyncio.run(unknown()) == (404, {"error": "no such file: translated files are kept "
                                                     "10 minutes"})  # fmt: skip


def test_kept_files_expire_after_their_lifetime_and_beyond_the_most_kept():
    now = [0.0]
    downloads = Downloads(lifetime=600, most=2, clock=lambda: now[0])
    first = downloads.keep("a.txt", b"a")
    assert downloads.fetch(first, "a.txt") == b"a"
    assert downloads.fetch(first, "b.txt") is None  # the name is part of its address
    now[0] = 599
    second = downloads.keep("b.txt", b"b")
    third = downloads.keep("c.txt", b"c")  # the third of at most two: the oldest goes
    assert downloads.fetch(first, "a.txt") is None
    assert downloads.fetch(second, "b.txt") == b"b"
    now[0] = 599 + 600
    assert downloads.fetch(second, "b.txt") is downloads.fetch(third, "c.txt") is None
