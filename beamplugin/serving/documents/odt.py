"""OpenDocument text files (.odt, read and written by ``odfdo``): each paragraph and heading
(of the body, its tables, frames and notes) a text cut into sentences, as a .docx's paragraphs
are. A paragraph's text lies in slots: its own text, then each inline element's text (spans,
links) and the text after it; the slots' boundaries are marks put back by word position, as
HTML's inline tags are, and each slot gets its piece of the translation, so that every element
stays where it was and keeps its style. Spaces, tabs and line breaks written as elements
(``text:s``, ``text:tab``, ``text:line-break``) are read as the blank they stand for; any other
element in a paragraph (a note's citation, a field, a frame, a bookmark) is copied as it is and
put back by word position; everything else of the file (styles, images, meta) is copied."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import odfdo

from beamplugin.fairseq_plugin.language_pairs import Pair
from beamplugin.serving.admission import Admission
from beamplugin.serving.documents.document import BOUNDARY, Document, Run
from beamplugin.serving.requests import odt_paragraphs

INLINE = frozenset({"text:span", "text:a", "text:meta"})  # containers of the paragraph's text
BLANKS = {"text:s": " ", "text:tab": "\t", "text:line-break": "\n"}


@dataclass
class Slot:
    """One of a paragraph's texts: ``element``'s ``which`` ("text" or "tail"); ``blank_after``
    where a blank element follows it, which writes the blank itself."""

    element: odfdo.Element
    which: str
    blank_after: bool = False

    def put(self, piece: str) -> None:
        """Sets the slot to ``piece``: a translation's blank before a blank element dropped
        (the element writes it), the input's own kept."""
        if self.blank_after and not (getattr(self.element, self.which) or " ")[-1].isspace():
            piece = piece.rstrip()
        setattr(self.element, self.which, piece)


async def translate_odt(
    admission: Admission, data: bytes, pair: Pair, fits: Callable[[str], bool]
) -> bytes:
    """The .odt ``data`` with its paragraphs' sentences translated in ``pair``, as .odt bytes."""
    document = odfdo.Document(io.BytesIO(data))
    found = []
    for paragraph in odt_paragraphs(document):
        run, slots = Run(), []
        _read(paragraph, "text", run, slots)
        found.append((Document([run], pair[0], fits, lines_end_sentences=True), slots))
    units = [unit for text, _ in found for unit in text.units]
    translations = iter(await admission.translate(units, 1, pair, documents=1) if units else [])
    for text, slots in found:
        if text.units:
            mine = [next(translations)[0].text for _ in text.units]
            pieces = text.assemble(mine).split(BOUNDARY)
            for slot, piece in zip(slots, pieces, strict=True):
                slot.put(piece)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def _read(element: odfdo.Element, which: str, run: Run, slots: list[Slot]) -> None:
    """Adds ``element``'s text (``which``: "text", then its children, or its "tail") to
    ``run`` as one slot, a boundary mark before every slot but the first."""
    if slots:
        run.add_mark(BOUNDARY)
    slots.append(Slot(element, which))
    run.add_text(getattr(element, which) or "")  # odfdo: a tail may be None
    if which == "tail":
        return
    for child in element.children:
        if child.tag in INLINE:
            _read(child, "text", run, slots)
        elif child.tag in BLANKS:  # the blank it stands for, which the element itself writes
            run.add_text(BLANKS[child.tag], raw="")
            slots[-1].blank_after = True
        _read(child, "tail", run, slots)
