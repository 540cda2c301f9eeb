"""A sentence's lexical constraints as a state machine with numbered states: the progress of a
hypothesis through them is one integer, and a step advances every candidate by a table lookup.

The states and moves are fairseq's (``fairseq.token_generation_constraints``):
``OrderedConstraintState`` (a position in the constraints' concatenation) and
``UnorderedConstraintState`` (a node of the constraints' trie with counts of the nodes generated
and the constraints completed), their quirks included, so that banks, ``finished`` and the next
tokens of every state are fairseq's (``tests/test_constraints.py`` compares every state reached
with fairseq's own objects). A state is numbered when it is first reached and each move is worked
out once, so a sentence pays for the states its hypotheses visit, not for all those its
constraints could make (unordered constraints make exponentially many).
"""

from __future__ import annotations

from collections.abc import Hashable

# A sentence's constraints: token sequences, each of at least one token.
Constraints = list[list[int]]

ROOT = 0  # the first state of every sentence


class ConstraintStates:
    """The numbered states of one sentence's constraints (``representation``: fairseq's
    ``ordered`` or ``unordered``). Per state: ``bank`` (constraint tokens met, fairseq's sort
    key), ``finished`` (all met: EOS allowed) and ``next_tokens`` (fairseq's list, in its order);
    :meth:`advance` is the state after a token."""

    def __init__(self, constraints: Constraints, representation: str) -> None:
        self._tokens = {token for constraint in constraints for token in constraint}
        self._rule = (
            _Ordered(constraints) if representation == "ordered" else _Unordered(constraints)
        )
        self.sort_tokens = self._rule.sort_tokens()  # fairseq's len(state.tokens): banks' weight
        self._keys: dict[Hashable, int] = {}
        self.bank: list[int] = []
        self.finished: list[bool] = []
        self.next_tokens: list[list[int]] = []
        self._moves: list[dict[int, int]] = []  # per state: constraint token -> state
        self._other: list[int] = []  # per state: the state after any other token
        self._key_of: list[Hashable] = []
        self._number(self._rule.root())

    def advance(self, state: int, token: int) -> int:
        """The state after ``token``."""
        if token not in self._tokens:
            return self._other[state]
        moves = self._moves[state]
        after = moves.get(token)
        if after is None:
            after = moves[token] = self._number(self._rule.advance(self._key_of[state], token))
        return after

    def _number(self, key: Hashable) -> int:
        number = self._keys.get(key)
        if number is not None:
            return number
        number = self._keys[key] = len(self.bank)
        rule = self._rule
        self.bank.append(rule.bank(key))
        self.finished.append(rule.finished(key))
        self.next_tokens.append(rule.next_tokens(key))
        self._moves.append({})
        self._other.append(-1)
        self._key_of.append(key)
        # a token outside the constraints: computed now, since most candidates are such tokens
        self._other[number] = self._number(rule.advance(key, None))
        return number


class _Ordered:
    """fairseq's OrderedConstraintState: a state is the position of the last token met in the
    constraints' concatenation (-1: none)."""

    def __init__(self, constraints: Constraints) -> None:
        self.sequence = [token for constraint in constraints for token in constraint]
        self.endpoints = [i == len(c) - 1 for c in constraints for i in range(len(c))]

    def root(self) -> int:
        return -1

    def bank(self, state: int) -> int:
        return state + 1

    def finished(self, state: int) -> bool:
        return state + 1 == len(self.sequence)

    def sort_tokens(self) -> int:
        return len(self.sequence)  # fairseq's set of the sequence's tensors: one per token

    def next_tokens(self, state: int) -> list[int]:
        # fairseq's set of two tensors, which never compare equal: both, even of one value
        # (fairseq iterates them in the order of their addresses; ties aside, the same)
        tokens = [self.sequence[0]] if state > 0 else []
        if not self.finished(state):
            tokens.append(self.sequence[state + 1])
        return tokens

    def advance(self, state: int, token: int | None) -> int:
        if self.finished(state):
            return state
        if self.sequence[state + 1] == token:
            return state + 1
        if self.endpoints[state]:  # between constraints (at -1 fairseq reads the last: True)
            return state
        if token == self.sequence[0]:
            return 0
        return -1


class _Unordered:
    """fairseq's UnorderedConstraintState: a state is (trie node, times each node is generated,
    times each node is completed), the counts as tuples over the nodes."""

    def __init__(self, constraints: Constraints) -> None:
        self.token: list[int | None] = [None]
        self.parent: list[int] = [-1]
        self.children: list[dict[int, int]] = [{}]  # in insertion order, as fairseq's dicts
        self.terminal: list[int] = [0]
        self.constraints_below: list[int] = [0]  # fairseq's num_constraints
        for constraint in constraints:
            node = 0
            for token in constraint:
                child = self.children[node].get(token)
                if child is None:
                    child = self.children[node][token] = len(self.token)
                    self.token.append(token)
                    self.parent.append(node)
                    self.children.append({})
                    self.terminal.append(0)
                    self.constraints_below.append(0)
                node = child
            self.terminal[node] += 1
            while node != -1:
                self.constraints_below[node] += 1
                node = self.parent[node]

    def sort_tokens(self) -> int:
        return len({token for token in self.token if token is not None})

    def root(self) -> tuple:
        nodes = len(self.token)
        return (0, (0,) * nodes, (0,) * nodes)

    def bank(self, key: tuple) -> int:
        return sum(key[1])

    def finished(self, key: tuple) -> bool:
        node, _, completed = key
        in_final = bool(self.terminal[node]) and completed[node] < self.terminal[node]
        return self.constraints_below[0] - (sum(completed) + in_final) == 0

    def next_tokens(self, key: tuple) -> list[int]:
        node = key[0]
        root_tokens = set(self.children[0].keys())
        if node != 0:  # the same set operations as fairseq, so the same order
            return list(root_tokens.union(set(self.children[node].keys())))
        return list(root_tokens)

    def advance(self, key: tuple, token: int | None) -> tuple:
        node, generated, completed = key
        child = self.children[node].get(token) if token is not None else None
        if child is not None and generated[child] < self.constraints_below[child]:
            return (child, _plus(generated, child, 1), completed)
        # fall off the trie: start again from the root, then rewind the path left
        child = self.children[0].get(token) if token is not None else None
        if child is not None and generated[child] < self.constraints_below[child]:
            after, new_generated = child, _plus(generated, child, 1)
        else:
            after, new_generated = 0, generated
        new_completed = completed
        walk = node
        while walk != 0:
            if self.terminal[walk] and completed[walk] < self.terminal[walk]:
                new_completed = _plus(completed, walk, 1)
                break
            new_generated = _plus(new_generated, walk, -1)
            walk = self.parent[walk]
        return (after, new_generated, new_completed)


def _plus(counts: tuple, index: int, delta: int) -> tuple:
    return counts[:index] + (counts[index] + delta,) + counts[index + 1 :]
