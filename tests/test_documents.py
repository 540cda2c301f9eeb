"""The server's documents without a server: sentences cover the text end to end, a sentence
too long for the model is cut until it fits, text is put back with its own blanks and breaks,
and HTML keeps its tag tree (read by lxml, a parser other than ours) on many random snippets,
with a stand-in translation that changes words and their number."""

from __future__ import annotations

import html
import random
import re

import lxml.html
import pytest
from html_tools import tag_tree

from beamplugin.serving.documents.markup import html_document
from beamplugin.serving.documents.sentences import segments
from beamplugin.serving.documents.translation import text_document


def fits_40(text: str) -> bool:
    return len(text) <= 40


def stand_in(unit: str) -> str:
    """A "translation": words reversed and upper-cased, every third one doubled."""
    words = unit.split()
    return " ".join(w[::-1].upper() * (1 + (i % 3 == 2)) for i, w in enumerate(words))


def reworded(unit: str) -> str:
    """A "translation" with other words and another number of them: the tags must follow."""
    words = [w[::-1].upper() for w in unit.split()]
    return " ".join(words[:-1] if len(words) > 3 else words + ["NEU"])


TEXT = (
    "  Dr. Müller kam an.  Er sagte: Gut!\nZweite Zeile ohne Punkt\n\n"
    "Neuer Absatz. Noch ein Satz?\t\n  - Ein Punkt der Liste\n1. 2. 3.\n\n\n"
    "Das ist es.\n"
)


def test_sentences_cover_the_text_and_follow_lines_and_punctuation():
    cut = segments(TEXT, "de", fits_40, lines_end_sentences=True)
    assert "".join(TEXT[s.start : s.end] for s in cut) == TEXT
    assert [s.start for s in cut[1:]] == [s.end for s in cut[:-1]]
    cores = [TEXT[s.core_start : s.core_end] for s in cut if s.translate]
    assert cores == ["Dr. Müller kam an.", "Er sagte: Gut!", "Zweite Zeile ohne Punkt",
                     "Neuer Absatz.", "Noch ein Satz?", "- Ein Punkt der Liste",
                     "Das ist es."]  # fmt: skip
    copied = [TEXT[s.core_start : s.core_end] for s in cut if not s.translate]
    assert [c for c in copied if c] == ["1. 2. 3."]  # and the blank lines


def test_a_sentence_too_long_for_the_model_is_cut_at_blanks_losing_nothing():
    words = [f"wort{i}" for i in range(2000)]  # 13,890 characters, no punctuation
    text = " ".join(words)
    cut = segments(text, "de", fits_40, lines_end_sentences=True)
    cores = [text[s.core_start : s.core_end] for s in cut]
    assert len(cores) > 300 and all(fits_40(c) for c in cores)
    assert " ".join(cores).split() == words
    # no blank at all (a script without spaces): cut anywhere, still all there
    solid = "字" * 10_000
    cut = segments(solid, "zh", fits_40, lines_end_sentences=True)
    assert "".join(solid[s.core_start : s.core_end] for s in cut) == solid
    assert all(s.core_end - s.core_start <= 40 for s in cut)


def test_text_is_put_back_with_its_own_blanks_and_breaks():
    document = text_document(TEXT, "de", fits_40)
    translated = document.assemble([stand_in(u) for u in document.units])
    expected = TEXT
    for unit in sorted(document.units, key=len, reverse=True):
        expected = expected.replace(unit, stand_in(unit))
    assert translated == expected
    assert re.sub(r"\S", "", translated) == re.sub(r"\S", "", TEXT)  # every blank and break


INLINE = ["b", "i", "em", "strong", "span", "a", "sup", "u"]
MARKUP = re.compile(r"<(/?(b|i|em|strong|span|a|sup|u|code|img|br|p|li|ul|div|script|style)\b|!--)")
WORDS = "der die das haus katze hund schnell rot blau gut sehr klein".split()


def _sentence(rng: random.Random, depth: int = 0) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            tag = rng.choice(INLINE)
            attrs = ' href="/x?a=1&amp;b=2" title="Der Titel"' if tag == "a" else ""
            parts.append(f"<{tag}{attrs}>{_sentence(rng, depth + 1)}</{tag}>")
        elif roll < 0.27:
            parts.append(rng.choice(["&amp;", "&lt;", "&#233;", "&nbsp;", "&eacute;"]))
        elif roll < 0.32:
            parts.append(rng.choice(["<code>x = 1 &lt; 2</code>", "<!-- ein Kommentar -->",
                                     '<span translate="no">Name GmbH</span>', "<img src=a.png>",
                                     "<br>"]))  # fmt: skip
        else:
            parts.append(rng.choice(WORDS))
    return " ".join(parts)


def _snippet(rng: random.Random) -> str:
    blocks = []
    for _ in range(rng.randint(1, 4)):
        sentences = " ".join(_sentence(rng).capitalize() + rng.choice([".", "!", "?"])
                             for _ in range(rng.randint(1, 3)))  # fmt: skip
        roll = rng.random()
        if roll < 0.1:
            blocks.append("<script>var s = '<b>Satz. Satz.</b>';</script>")
        elif roll < 0.15:
            blocks.append(rng.choice(["<style>p > b { color: red }</style>",
                                      "<pre>Ein Satz.\n  Noch   einer.</pre>"]))  # fmt: skip
        elif roll < 0.25:
            blocks.append(f'<div translate="no"><p>{sentences}</p></div>')
        elif roll < 0.35:
            blocks.append(f"<ul>\n  <li>{sentences}</li>\n  <li class=x>{sentences}</li>\n</ul>")
        else:
            blocks.append(f'<p class="c{rng.randint(0, 9)}">\n  {sentences}\n</p>')
    return "\n".join(blocks)


def _kept(markup: str) -> list[str]:
    return re.findall(r"<script>.*?</script>|<style>.*?</style>|<code>.*?</code>|<pre>.*?</pre>|"
                      r'<div translate="no">.*?</div>|<span translate="no">.*?</span>|<!--.*?-->',
                      markup, re.S)  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_html_keeps_its_tag_tree_on_many_snippets(seed):
    rng = random.Random(seed)
    for _ in range(50):
        snippet = _snippet(rng)
        document = html_document(snippet, "de", fits_40)
        assert not any(MARKUP.search(u) for u in document.units), snippet  # text only
        translated = document.assemble([reworded(u) for u in document.units])
        assert tag_tree(translated) == tag_tree(snippet), (snippet, translated)
        assert _kept(translated) == _kept(snippet)
        rest = lxml.html.fragment_fromstring(  # all the text outside what is kept: translated
            re.sub("|".join(map(re.escape, _kept(translated))) or "$^", "", translated),
            create_parent="div",
        ).text_content()
        assert not set(re.findall(r"\w+", rest.lower())) & set(WORDS), translated


def test_inline_tags_stay_around_the_words_they_wrapped():
    snippet = '<p>Das <b>rote</b> Haus &amp; <a href="/k">die Katze</a>. Sehr <i>gut</i>!</p>'
    document = html_document(snippet, "de", fits_40)
    assert document.units == ["Das rote Haus & die Katze.", "Sehr gut!"]
    word_for_word = [u.upper() for u in document.units]  # as the toy model: one word a word
    assert document.assemble(word_for_word) == (
        '<p>DAS <b>ROTE</b> HAUS &amp; <a href="/k">DIE KATZE</a>. SEHR <i>GUT</i>!</p>'
    )


@pytest.mark.parametrize("broken", [
    "<p>nicht geschlossen <b>fett", "</p></div>Text ohne Anfang.", "<p <b>>seltsam</b>",
    "<div translate=no>nie geschlossen <p>Satz.", "a < b und c > d &unbekannt; &#xZZ;",
    "<!-- offen", "<p>Ein Satz.<p>Noch einer.",
])  # fmt: skip
def test_html_that_does_not_parse_loses_nothing(broken):
    document = html_document(broken, "de", fits_40)
    itself = document.assemble(document.units)  # each sentence "translated" as itself
    assert html.unescape(itself) == html.unescape(broken)  # all there, escaped where needed
    assert tag_tree(document.assemble([stand_in(u) for u in document.units])) == tag_tree(broken)


def test_mixed_scripts_emoji_and_combining_marks_lose_nothing():
    text = "Hallo 世界。Привет, мир! مرحبا بالعالم. e\u0301te\u0301 👍🏽 ok?\n\u200b\n"
    cut = segments(text, "de", fits_40, lines_end_sentences=True)
    assert "".join(text[s.start : s.end] for s in cut) == text
    document = text_document(text, "de", fits_40)
    assert document.assemble(document.units) == text
    assert document.assemble([stand_in(u) for u in document.units]).count("\n") == 2
