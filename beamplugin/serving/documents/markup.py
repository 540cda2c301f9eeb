"""HTML as a :class:`~.document.Document`: the input read by the standard library's
``html.parser`` as a stream of tokens, each with the exact text it had in the input, so that
everything but translated text is copied byte for byte (tags, attributes, entities outside the
translated text, comments, declarations) and even markup that does not parse is kept as it came.

Text between block boundaries (any tag but the inline ones below, ``<br>`` included) is a run;
inline tags, comments and untranslated inline elements in it are marks, which the document
puts back around the words they wrapped (see :mod:`.document`). Not translated: the content of
``<script>``, ``<style>``, ``<code>``, ``<pre>``, ``<kbd>``, ``<samp>``, ``<var>``, ``<svg>``,
``<math>`` and of any element with ``translate="no"`` or the class ``notranslate``; attribute values
(``title``, ``alt``) are not translated either.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from html.parser import HTMLParser

from beamplugin.serving.documents.document import Document, Run

INLINE = frozenset(
    "a abbr b bdi bdo big cite code data del dfn em font i img ins kbd label mark math q s samp "
    "small span strong sub sup svg time tt u var wbr".split()
)
# <pre>: its lines and blanks are its layout, which a translation would not keep
UNTRANSLATED = frozenset("script style code kbd samp var svg math pre".split())
UNFINISHED = re.compile(r"<[a-zA-Z!/?]")
VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())


class _Tokens(HTMLParser):
    """The tokens of an HTML text: (kind, tag name or None, attributes, its exact text)."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=False)  # entities as tokens: copied as they were
        self.text = text
        self.events: list[tuple[str, str | None, dict[str, str | None], int]] = []
        self._line_starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        self.feed(text)
        self.close()

    def tokens(self) -> list[tuple[str, str | None, dict[str, str | None], str]]:
        """Every token with its text; they cover the input end to end (the first from 0)."""
        starts = [0] + [start for *_, start in self.events[1:]]
        ends = starts[1:] + [len(self.text)]
        tokens: list[tuple[str, str | None, dict[str, str | None], str]] = []
        for (kind, tag, attrs, _), start, end in zip(self.events, starts, ends, strict=True):
            if kind == "text" and tokens and tokens[-1][0] == "text":  # one text, one token
                tokens[-1] = ("text", None, {}, tokens[-1][3] + self.text[start:end])
            else:
                tokens.append((kind, tag, attrs, self.text[start:end]))
        if tokens and tokens[-1][0] == "text":
            # Markup left unfinished ("<!-- ..." never closed, "<p" at the end) comes as text:
            # kept as it is, as a comment would be.
            last = tokens.pop()[3]
            found = UNFINISHED.search(last)
            cut = found.start() if found else len(last)
            tokens += [("text", None, {}, last[:cut])] if cut else []
            tokens += [("comment", None, {}, last[cut:])] if cut < len(last) else []
        return tokens

    def _add(self, kind: str, tag: str | None = None, attrs: list | None = None) -> None:
        line, column = self.getpos()  # where this token starts
        self.events.append((kind, tag, dict(attrs or []), self._line_starts[line - 1] + column))

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._add("start", tag, attrs)

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        self._add("empty", tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        self._add("end", tag)

    def handle_data(self, data: str) -> None:
        self._add("text")

    def handle_entityref(self, name: str) -> None:
        self._add("entity")

    def handle_charref(self, name: str) -> None:
        self._add("entity")

    def handle_comment(self, data: str) -> None:
        self._add("comment")

    def handle_decl(self, decl: str) -> None:
        self._add("comment")

    def handle_pi(self, data: str) -> None:
        self._add("comment")

    def unknown_decl(self, data: str) -> None:
        self._add("comment")


def _untranslated(tag: str, attrs: dict[str, str | None]) -> bool:
    classes = (attrs.get("class") or "").split()
    return tag in UNTRANSLATED or (attrs.get("translate") or "").lower() == "no" or (
        "notranslate" in classes
    )


def html_document(text: str, language: str, fits: Callable[[str], bool]) -> Document:
    """``text`` (an HTML document or fragment) as a document whose units are the sentences of
    its text, in ``language``'s rules."""
    parts: list[str | Run] = []
    run: Run | None = None
    stack: list[str] = []  # open elements, to find where an untranslated one ends
    kept: tuple[int, bool, list[str]] | None = None  # (depth, inline, its text) while in one

    def text_run() -> Run:
        nonlocal run
        if run is None:
            run = Run()
            parts.append(run)
        return run

    def boundary(markup: str) -> None:
        nonlocal run
        run = None
        parts.append(markup)

    for kind, tag, attrs, raw in _Tokens(text).tokens():
        if kind == "start" and tag not in VOID:
            stack.append(tag)
        elif kind == "end" and tag in stack:
            del stack[len(stack) - 1 - stack[::-1].index(tag) :]
        if kept is not None:
            depth, inline, held = kept
            held.append(raw)
            if len(stack) < depth:
                kept = None
                (text_run().add_mark if inline else boundary)("".join(held))
            continue
        if kind in ("start", "empty") and _untranslated(tag, attrs):
            if kind == "empty" or tag in VOID:
                (text_run().add_mark if tag in INLINE else boundary)(raw)
            else:
                kept = (len(stack), tag in INLINE, [raw])
        elif kind == "text":
            text_run().add_text(raw)
        elif kind == "entity":
            text_run().add_text(html.unescape(raw), raw)
        elif kind == "comment" or tag in INLINE:
            text_run().add_mark(raw)
        else:
            boundary(raw)
    if kept is not None:  # an untranslated element never closed: kept to the end
        parts.append("".join(kept[2]))
    return Document(parts, language, fits, lines_end_sentences=False,
                    escape=lambda t: html.escape(t, quote=False), collapse=True)  # fmt: skip
