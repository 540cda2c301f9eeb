"""Extraction of sentence pairs from Ding dictionary lines (Debian's trans-de-en format)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "extract_ding.py"
# data/ holds scripts, not a package: load the module from its file.
_spec = importlib.util.spec_from_file_location("extract_ding", SCRIPT)
extract_ding = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(extract_ding)
extract_pairs, is_sentence = extract_ding.extract_pairs, extract_ding.is_sentence
line_pairs, strip_annotations = extract_ding.line_pairs, extract_ding.strip_annotations

# Real lines from /usr/share/trans/de-en (Ding, GPL-2+), one per feature.
SUB_ENTRIES = (
    "Kriegsgefahr {f} [pol.] | Kriegsgefahren {pl} | Die unmittelbare Kriegsgefahr ist gebannt. "
    ":: threat of war | threats of war | The immediate threat of war has been lifted."
)
ALTERNATIVES_MATCHING = (
    "sich benehmen {vi} | Benimm dich!; Benehmen Sie sich! | Er kann sich nicht benehmen. "
    ":: to behave | Just behave!; Behave yourself! | He doesn’t know how to behave."
)
ALTERNATIVES_UNEVEN = (
    "vernünftig {adj} | Er scheint ja ganz vernünftig zu sein. "
    ":: sensible | He seems quite sensible.; He seems like a sensible sort of person."
)
ANNOTATIONS = (
    "Nervensäge {f} | Du gehst mir auf den Senkel [Dt.] [slang]! | Sie ist (wirklich) nett. "
    ":: nuisance | You’re a pain in the neck [Br.] <pain>! | She is (really) nice."
)
TEMPLATES = (
    "etw. rauchen {vt} | eine rauchen gehen | Er ging hinaus, um schnell eine zu rauchen. "
    "| Wir mussten drei Stunden lang Schlange stehen. "
    ":: to smoke sth. | to go for a smoke | He went outside to take a quick smoke. "
    "| We had to queue/line up for three hours."
)


def test_sub_entries_pair_up_position_by_position_and_keep_only_sentences():
    assert list(line_pairs(SUB_ENTRIES)) == [
        (
            "Die unmittelbare Kriegsgefahr ist gebannt.",
            "The immediate threat of war has been lifted.",
        )
    ]


def test_alternatives_pair_up_when_counts_match():
    assert list(line_pairs(ALTERNATIVES_MATCHING)) == [
        ("Benimm dich!", "Just behave!"),
        ("Benehmen Sie sich!", "Behave yourself!"),
        ("Er kann sich nicht benehmen.", "He doesn’t know how to behave."),
    ]


def test_uneven_alternatives_keep_only_the_first_of_each_side():
    assert list(line_pairs(ALTERNATIVES_UNEVEN)) == [
        ("Er scheint ja ganz vernünftig zu sein.", "He seems quite sensible.")
    ]


def test_annotations_are_stripped_and_spaces_tidied():
    assert list(line_pairs(ANNOTATIONS)) == [
        ("Du gehst mir auf den Senkel!", "You’re a pain in the neck!"),
        ("Sie ist nett.", "She is nice."),
    ]
    assert strip_annotations("Sorry, I don't understand. /SIDU/") == "Sorry, I don't understand."
    assert strip_annotations("a {b (nested [c])} d") == "a d"


def test_templates_choices_and_fragments_are_not_sentences():
    assert list(line_pairs(TEMPLATES)) == [
        ("Er ging hinaus, um schnell eine zu rauchen.", "He went outside to take a quick smoke.")
    ]
    assert not is_sentence("to be sensible enough to do sth.")
    assert not is_sentence("Dem steht allerdings entgegen, dass …")
    assert not is_sentence("Kunden werben")
    assert not is_sentence("Horrors!")
    assert is_sentence("„Komm her!“")


def test_misaligned_comment_and_malformed_lines_give_nothing():
    misaligned = "A | Das ist gut. | B :: a | That is good."
    assert list(line_pairs(misaligned)) == []
    assert list(line_pairs("# Version :: devel 2023-01-30")) == []
    assert list(line_pairs("Das ist gut. :: That is good. :: Extra.")) == []


def test_duplicates_are_dropped_keeping_dictionary_order():
    pairs = extract_pairs([ANNOTATIONS, SUB_ENTRIES, ANNOTATIONS + "\n"])
    assert [de for de, _ in pairs] == [
        "Du gehst mir auf den Senkel!",
        "Sie ist nett.",
        "Die unmittelbare Kriegsgefahr ist gebannt.",
    ]


def test_command_line_writes_aligned_files_and_rejects_non_dictionaries(tmp_path):
    dictionary = tmp_path / "de-en"
    dictionary.write_text("# header\n" + SUB_ENTRIES + "\n" + ALTERNATIVES_MATCHING + "\n")
    run = subprocess.run(
        [sys.executable, SCRIPT, dictionary, tmp_path / "out"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert "4 sentence pairs" in run.stdout
    de = (tmp_path / "out.de").read_text().splitlines()
    en = (tmp_path / "out.en").read_text().splitlines()
    assert len(de) == len(en) == 4 and de[1] == "Benimm dich!" and en[1] == "Just behave!"

    dictionary.write_text("just some text\n")
    run = subprocess.run(
        [sys.executable, SCRIPT, dictionary, tmp_path / "out"], capture_output=True, text=True
    )
    assert run.returncode != 0 and "no sentence pairs" in run.stderr
