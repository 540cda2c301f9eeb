"""fairseq-generate --constraints with our task: a binarized test set carries no constraints, so
they are read from a text file beside it (``--constraints-file``), one line per sentence of the
split in its order (line i for sentence id i), the sentence's constraints separated by tabs,
each in the target's preprocessed form (the pieces of the binarized text, as
fairseq-interactive's constraints after the source's tab once its BPE has cut them); a blank
line: no constraints. Pieces the dictionary lacks become ``<unk>``, as in fairseq-interactive."""

from __future__ import annotations

from typing import Any

import torch
from fairseq.data import Dictionary, FairseqDataset, LanguagePairDataset
from fairseq.token_generation_constraints import pack_constraints


def read_constraints(path: str, dictionary: Dictionary) -> list[torch.Tensor]:
    """Each line's constraints, packed as fairseq's collater expects a sentence's
    (``pack_constraints``); ValueError naming a line with an empty constraint."""
    packed = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            text = line.rstrip("\n")
            fields = text.split("\t") if text.strip() else []
            if any(not field.strip() for field in fields):
                raise ValueError(f"{path}:{number}: an empty constraint (between tabs)")
            constraints = [
                dictionary.encode_line(field, append_eos=False, add_if_not_exist=False).long()
                for field in fields
            ]
            packed.append(pack_constraints([constraints])[0])
    return packed


def with_constraints(dataset: FairseqDataset, path: str, dictionary: Dictionary) -> Any:
    """``dataset`` (a split of language pairs), its samples carrying the constraints of
    ``path``; ValueError if the file does not have one line per sentence."""
    if not isinstance(dataset, LanguagePairDataset):
        raise ValueError(
            f"--constraints-file needs a split of language pairs (fairseq's translation task), "
            f"not a {type(dataset).__name__}"
        )
    packed = read_constraints(path, dictionary)
    if len(packed) != len(dataset):
        raise ValueError(
            f"--constraints-file {path} has {len(packed)} lines for the split's {len(dataset)} "
            "sentences: one line a sentence, blank for none"
        )
    dataset.constraints = packed
    return dataset
