"""Shared pytest fixtures (keep each small and clearly named)."""

import pytest
from fairseq.data import Dictionary


@pytest.fixture
def toy_dictionary() -> Dictionary:
    """fairseq's four special symbols (bos=0, pad=1, eos=2, unk=3) and 26 words."""
    dictionary = Dictionary()
    for index in range(26):
        dictionary.add_symbol(f"word{index}")
    return dictionary
