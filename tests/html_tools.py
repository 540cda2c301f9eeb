"""HTML read by lxml (libxml2's parser, not the one the server uses) for the documents' tests."""

from __future__ import annotations

import lxml.html

KEPT_TAGS = ("script", "style", "code", "pre")


def tag_tree(markup: str) -> list:
    """The tag tree of ``markup``: tags, attributes, comments, and the text of the elements the
    server does not translate (script, style, code, pre, translate="no")."""

    def shape(element) -> list:
        if not isinstance(element.tag, str):  # a comment
            return ["comment", element.text]
        kept = element.tag in KEPT_TAGS or element.get("translate") == "no"
        return [element.tag, sorted(element.attrib.items()),
                element.text_content() if kept else None,
                [shape(child) for child in element]]  # fmt: skip

    return shape(lxml.html.fragment_fromstring(markup, create_parent="div"))


def text_of(markup: str) -> str:
    """The text of ``markup`` as a browser shows it, blanks collapsed."""
    root = lxml.html.fragment_fromstring(markup, create_parent="div")
    return " ".join(root.text_content().split())
