"""The toy corpus and the environment of data/'s scripts: for test_pipeline.py's demo and
test_time_budget.py's, which runs in a file of its own (beside it on another worker)."""

import os
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
LEXICON = {
    "adjective": {"rote": "red", "blaue": "blue", "grüne": "green", "kleine": "small",
                  "große": "big", "alte": "old", "junge": "young", "schnelle": "fast"},
    "noun": {"Hund": "dog", "Mann": "man", "Vogel": "bird", "Baum": "tree", "Tisch": "table",
             "Zug": "train", "Fisch": "fish", "Lehrer": "teacher"},
    "verb": {"schläft": "sleeps", "wartet": "waits", "steht": "stands", "fällt": "falls",
             "lacht": "laughs", "singt": "sings"},
    "adverb": {"hier": "here", "dort": "there", "heute": "today", "morgen": "tomorrow",
               "oft": "often", "nie": "never"},
}
PAIRS = 1200
TEST_SIZE = 40


def toy_corpus(directory: Path) -> tuple[Path, Path]:
    """PAIRS distinct 'Der rote Hund schläft hier.' / 'The red dog sleeps here.' pairs."""
    words = [list(LEXICON[kind].items()) for kind in ("adjective", "noun", "verb", "adverb")]
    combos = [(a, n, v, d) for a in words[0] for n in words[1] for v in words[2] for d in words[3]]
    random.Random(0).shuffle(combos)
    de = [f"Der {a[0]} {n[0]} {v[0]} {d[0]}." for a, n, v, d in combos[:PAIRS]]
    en = [f"The {a[1]} {n[1]} {v[1]} {d[1]}." for a, n, v, d in combos[:PAIRS]]
    (directory / "toy.de").write_text("\n".join(de) + "\n")
    (directory / "toy.en").write_text("\n".join(en) + "\n")
    return directory / "toy.de", directory / "toy.en"


def env_for(work: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        **extra,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "CONFIG": str(ROOT / "configs" / "smoke.conf"),
        "WORK": str(work),
        "TEST_SIZE": str(TEST_SIZE),
    }
