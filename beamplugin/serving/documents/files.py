"""Files (``POST /translate_file``): a text file and an HTML file translated as ``/translate``
translates a text and an HTML document; a subtitle file (SubRip, read and written by the
``srt`` library) one cue a sentence, its line breaks as blanks (a cue's lines are layout, and
a sentence split across them would be translated in halves), numbering and timings kept; a
Word file (.docx, by ``python-docx``) each paragraph a text cut into sentences, its runs
(stretches of one formatting) kept: a run boundary is a mark of the paragraph's text, put back
by word position as HTML's inline tags are, and everything else of the file is copied; an
OpenDocument text (.odt) likewise (:mod:`.odt`)."""

from __future__ import annotations

import io
from collections.abc import Callable

import docx
import srt

from beamplugin.fairseq_plugin.language_pairs import Pair
from beamplugin.serving.admission import Admission
from beamplugin.serving.documents.document import BOUNDARY, Document, Run
from beamplugin.serving.documents.odt import translate_odt
from beamplugin.serving.documents.translation import translate_documents
from beamplugin.serving.requests import FileRequest, docx_paragraphs
from beamplugin.serving.responses import Refused


async def translate_file(
    admission: Admission, ask: FileRequest, fits: Callable[[str], bool]
) -> bytes:
    """The file ``ask`` gives, translated, in the same format."""
    if ask.format == "docx":
        return await _translate_docx(admission, ask.data, ask.pair, fits)
    if ask.format == "odt":
        return await translate_odt(admission, ask.data, ask.pair, fits)
    if ask.format == "srt":
        return (await _translate_srt(admission, ask.text, ask.pair)).encode("utf-8")
    [[translated]], _ = await translate_documents(admission, [ask.text], ask.format, 1, ask.pair,
                                                  fits)  # fmt: skip
    return translated.encode("utf-8")


async def _translate_docx(
    admission: Admission, data: bytes, pair: Pair, fits: Callable[[str], bool]
) -> bytes:
    document = docx.Document(io.BytesIO(data))
    paragraphs = [p for p in docx_paragraphs(document) if p.runs]
    texts = []
    for paragraph in paragraphs:
        run = Run()
        for number, piece in enumerate(paragraph.runs):
            if number:
                run.add_mark(BOUNDARY)
            run.add_text(piece.text)
        texts.append(Document([run], pair[0], fits, lines_end_sentences=True))
    units = [unit for text in texts for unit in text.units]
    translations = iter(await admission.translate(units, 1, pair, documents=1) if units else [])
    for paragraph, text in zip(paragraphs, texts, strict=True):
        if text.units:
            mine = [next(translations)[0].text for _ in text.units]
            pieces = text.assemble(mine).split(BOUNDARY)
            for piece, translated in zip(paragraph.runs, pieces, strict=True):
                piece.text = translated
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


async def _translate_srt(admission: Admission, text: str, pair: Pair) -> str:
    try:
        cues = list(srt.parse(text))
    except srt.SRTParseError as error:
        raise Refused(400, f"'file' is not a SubRip file: {error}") from None
    units = [" ".join(cue.content.split()) for cue in cues]
    spoken = [unit for unit in units if any(c.isalpha() for c in unit)]  # else copied
    if not spoken:
        raise Refused(400, "'file' has no cue to translate")
    translations = iter(await admission.translate(spoken, 1, pair, documents=1))
    for cue, unit in zip(cues, units, strict=True):
        if any(c.isalpha() for c in unit):
            cue.content = next(translations)[0].text
    return srt.compose(cues, reindex=False, strict=False)
