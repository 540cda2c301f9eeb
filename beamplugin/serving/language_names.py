"""A language's name for a language code, as LibreTranslate's ``/languages`` shows it, from
``langcodes`` (CLDR's English names): M2M-100's ``de``, NLLB's ``zho_Hant`` (a script after the
underscore), mBART's ``ar_AR`` (a region after it, left out: mBART's are not real regions)."""

from __future__ import annotations

from functools import cache

import langcodes
from langcodes.tag_parser import LanguageTagError


@cache
def language_name(code: str) -> str:
    """``de`` -> German, ``zho_Hant`` -> Chinese (Traditional), ``en_XX`` -> English; a code
    langcodes does not know is its own name."""
    base, _, suffix = code.partition("_")
    tag = f"{base}-{suffix}" if len(suffix) == 4 else base  # a script (Latn, Hant), not a region
    try:
        language = langcodes.Language.get(tag)
    except LanguageTagError:
        return code
    return language.display_name() if language.is_valid() else code
