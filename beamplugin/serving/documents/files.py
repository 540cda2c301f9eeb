"""Files (``POST /translate_file``): a text file and an HTML file translated as ``/translate``
translates a text and an HTML document; a subtitle file (SubRip, read and written by the
``srt`` library) one cue a sentence, its line breaks as blanks (a cue's lines are layout, and
a sentence split across them would be translated in halves), numbering and timings kept."""

from __future__ import annotations

from collections.abc import Callable

import srt

from beamplugin.fairseq_plugin.language_pairs import Pair
from beamplugin.serving.admission import Admission
from beamplugin.serving.documents.translation import translate_documents
from beamplugin.serving.responses import Refused


async def translate_file(
    admission: Admission, text_format: str, text: str, pair: Pair, fits: Callable[[str], bool]
) -> str:
    """The translation of ``text``, a file's content in ``text_format`` ("text", "html" or
    "srt"), in the same format."""
    if text_format != "srt":
        [[translated]], _ = await translate_documents(admission, [text], text_format, 1, pair,
                                                      fits)  # fmt: skip
        return translated
    try:
        cues = list(srt.parse(text))
    except srt.SRTParseError as error:
        raise Refused(400, f"'file' is not a SubRip file: {error}") from None
    units = [" ".join(cue.content.split()) for cue in cues]
    spoken = [unit for unit in units if any(c.isalpha() for c in unit)]  # else copied
    if not spoken:
        raise Refused(400, "'file' has no cue to translate")
    translations = iter(await admission.translate(spoken, 1, pair))
    for cue, unit in zip(cues, units, strict=True):
        if any(c.isalpha() for c in unit):
            cue.content = next(translations)[0].text
    return srt.compose(cues, reindex=False, strict=False)
