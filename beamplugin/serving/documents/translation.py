"""A request's documents through the server's :class:`~beamplugin.serving.admission.Admission`:
the sentences of all of them queued together (each one a request of the engine's, sharing its
steps with whatever else is in flight), then each document put back together."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from beamplugin.fairseq_plugin.language_pairs import Pair
from beamplugin.serving.admission import Admission
from beamplugin.serving.documents.document import Document, Run
from beamplugin.serving.documents.markup import html_document
from beamplugin.serving.glossary import Term, constraints_of


def text_document(text: str, language: str, fits: Callable[[str], bool]) -> Document:
    """``text`` cut into sentences by ``language``'s rules and at every line break."""
    run = Run()
    run.add_text(text)
    return Document([run], language, fits, lines_end_sentences=True)


async def translate_documents(
    admission: Admission,
    texts: list[str],
    text_format: str,
    nbest: int,
    pair: Pair,
    fits: Callable[[str], bool],
    find_terms: Callable[[str], list[Term]] | None = None,
) -> tuple[list[list[str]], list[list[Term]]]:
    """The ``nbest`` translations of each of ``texts`` (``text_format`` "text" or "html") in
    ``pair``: translation k of a document puts together hypothesis k of each of its
    sentences. Refused as Admission refuses (counting documents, not sentences); a document
    with no sentence to translate (numbers, markup only) is answered as it is. With
    ``find_terms`` (a sentence's glossary terms), each sentence's translation holds its terms'
    targets; also returned: the terms applied in each document, in the order found."""
    read = html_document if text_format == "html" else text_document
    # In a thread: a megabyte of text takes a second or two to cut, which the event loop
    # should spend answering others.
    documents = await asyncio.to_thread(lambda: [read(text, pair[0], fits) for text in texts])
    units = [unit for document in documents for unit in document.units]
    found: list[list[Term]] = [[] for _ in units]
    constraints = None
    if find_terms is not None:
        found = await asyncio.to_thread(lambda: [find_terms(unit) for unit in units])
        constraints = [constraints_of(terms) or None for terms in found]
    translations = await admission.translate(units, nbest, pair, constraints, documents=len(texts)
                                             ) if units else []  # fmt: skip

    def assemble() -> tuple[list[list[str]], list[list[Term]]]:
        answers, applied, start = [], [], 0
        for document in documents:
            end = start + len(document.units)
            mine = translations[start:end]
            answers.append([document.assemble([h[k].text for h in mine]) for k in range(nbest)])
            applied.append(list(dict.fromkeys(t for terms in found[start:end] for t in terms)))
            start = end
        return answers, applied

    return await asyncio.to_thread(assemble)
