"""Random source batches shaped as fairseq's translation task collates them."""

import torch
from fairseq.data import Dictionary


def left_padded_sources(dictionary: Dictionary, lengths: list[int]) -> torch.Tensor:
    """Left-padded random sentences of the given lengths (EOS included), each ending in EOS."""
    src = torch.full((len(lengths), max(lengths)), dictionary.pad())
    for row, length in enumerate(lengths):
        src[row, -length:-1] = torch.randint(dictionary.nspecial, len(dictionary), (length - 1,))
        src[row, -1] = dictionary.eos()
    return src
