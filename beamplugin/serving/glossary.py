"""A request's glossary: source terms that, found in a sentence, put their target terms in its
translation, as lexical constraints (beamplugin.search.constraints).

Terms match on what the model reads: a sentence and a source term are both cut into pieces by
the server's tokenizer and BPE, and a term is found where its pieces stand in a row among the
sentence's, case as written. The search is leftmost-longest: at each piece the longest term
that starts there, then on after it, so that overlapping terms ("rote hund", "hund") give one
constraint, not two that the translation would have to hold both of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fairseq.data import Dictionary

from beamplugin.search.constraints import Constraints


@dataclass(frozen=True)
class Term:
    """A glossary entry as the client wrote it, and as the model reads and writes it."""

    source: str
    target: str
    source_pieces: tuple[str, ...]
    target_tokens: tuple[int, ...]


class Glossary:
    """Terms looked up by their first piece."""

    def __init__(self, terms: list[Term]) -> None:
        self._starting: dict[str, list[Term]] = {}
        for term in terms:
            self._starting.setdefault(term.source_pieces[0], []).append(term)
        for starting in self._starting.values():  # longest first
            starting.sort(key=lambda term: len(term.source_pieces), reverse=True)

    def find(self, pieces: list[str]) -> list[Term]:
        """The terms found in a sentence's ``pieces``, leftmost-longest, in the order found
        (each once)."""
        found: list[Term] = []
        position = 0
        while position < len(pieces):
            term = next(
                (
                    term
                    for term in self._starting.get(pieces[position], ())
                    if tuple(pieces[position : position + len(term.source_pieces)])
                    == term.source_pieces
                ),
                None,
            )
            if term is None:
                position += 1
                continue
            if term not in found:
                found.append(term)
            position += len(term.source_pieces)
        return found


def glossary_of(
    entries: list[tuple[str, str]], pieces: Callable[[str], list[str]], tgt_dict: Dictionary
) -> Glossary:
    """The (source, target) ``entries`` as a model reads and writes them: cut by ``pieces``
    (its tokenizer and BPE), targets in ``tgt_dict``'s tokens; ValueError for a term with
    nothing to match or write, or a target term with pieces the vocabulary lacks (fairseq
    would constrain the translation to ``<unk>``)."""
    terms = []
    for source, target in entries:
        source_pieces, target_pieces = pieces(source), pieces(target)
        if not source_pieces or not target_pieces:
            raise ValueError(
                f"the term {source!r}: {target!r} has a side with nothing to match or write "
                "(blank, or not valid UTF-8)"
            )
        tokens = [tgt_dict.index(piece) for piece in target_pieces]
        if tgt_dict.unk() in tokens:
            unknown = [p for p, t in zip(target_pieces, tokens, strict=True)
                       if t == tgt_dict.unk()]  # fmt: skip
            raise ValueError(
                f"the target term {target!r} has pieces the model cannot write: "
                f"{' '.join(unknown)}"
            )
        terms.append(Term(source, target, tuple(source_pieces), tuple(tokens)))
    return Glossary(terms)


def constraints_of(terms: list[Term]) -> Constraints:
    """The target terms of ``terms`` as one sentence's constraints, in order; a target that two
    terms share is asked for once (the translation need not hold it twice)."""
    constraints: Constraints = []
    for term in terms:
        tokens = list(term.target_tokens)
        if tokens not in constraints:
            constraints.append(tokens)
    return constraints


def read_glossary(path: str) -> list[tuple[str, str]]:
    """A glossary file's (source, target) terms: ``source<TAB>target`` a line (blank lines
    skipped), each source once; ValueError naming the line that is not."""
    terms: list[tuple[str, str]] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            fields = [field.strip() for field in line.rstrip("\n").split("\t")]
            if len(fields) != 2 or not all(fields):
                raise ValueError(f"{path}:{number}: not source<TAB>target")
            if any(fields[0] == known for known, _ in terms):
                raise ValueError(f"{path}:{number}: the source term {fields[0]!r} is there twice")
            terms.append((fields[0], fields[1]))
    return terms
