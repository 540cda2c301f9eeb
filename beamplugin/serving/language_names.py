"""A language's name for a language code, as LibreTranslate's ``/languages`` shows it.

``language_names.json`` holds the English names of ISO 639 (taken from Debian's iso-codes,
" (macrolanguage)" left out) for every two-letter code (M2M-100's, most of them) and its
three-letter one, and for the three-letter codes of FLORES-200 (NLLB's ``eng_Latn`` ...). A code
it does not know is its own name.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

NAMES = Path(__file__).with_name("language_names.json")


@cache
def _names() -> dict[str, str]:
    return json.loads(NAMES.read_text(encoding="utf-8"))


def language_name(code: str) -> str:
    """``de`` -> German, ``eng_Latn`` -> English (Latn); else ``code``."""
    base, _, script = code.partition("_")
    name = _names().get(base)
    if name is None:
        return code
    return f"{name} ({script})" if script else name
