"""fairseq's per-step rules seen through a StepView alone, without an engine or a model: each
rule masks exactly the rows of the sentences it concerns, whatever step the others are at."""

from __future__ import annotations

import math

import torch

from beamplugin.search.log_prob_rules import LogProbRules, StepView
from beamplugin.search.options import DecodingOptions

PAD, EOS, UNK = 1, 2, 3
VOCAB = 10
BEAM = 2


class BeamRows:
    """``BEAM`` rows for every sentence, sentence-major: the layout of a step with no sentence
    at its first step."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def rows_of(self, sentences: list[int]) -> torch.Tensor | None:
        if len(sentences) == len(self.steps):
            return None
        return torch.tensor([s * BEAM + b for s in sentences for b in range(BEAM)])

    def first_rows(self) -> torch.Tensor:
        return torch.arange(len(self.steps)) * BEAM

    def row_sentences(self) -> torch.Tensor:
        return torch.arange(len(self.steps)).repeat_interleave(BEAM)

    def steps_on_device(self) -> torch.Tensor:
        return torch.tensor(self.steps)


def view(steps: list[int], max_lens: list[int], prefix: torch.Tensor | None = None) -> StepView:
    sentences = len(steps)
    prefix = torch.empty(sentences, 0, dtype=torch.long) if prefix is None else prefix
    return StepView(
        tokens=torch.full((sentences * BEAM, max(steps) + 1), EOS),
        steps=steps,
        max_lens=max_lens,
        prefix_lens=[prefix.size(1)] * sentences,
        prefix_ends=[-1] * sentences,
        layout=BeamRows(steps),
        per_sentence={"prefix": prefix},
    )


def options(**kwargs: object) -> DecodingOptions:
    return DecodingOptions(eos=EOS, pad=PAD, unk=UNK, max_len=100, beam_size=BEAM, **kwargs)


def lprobs(sentences: int) -> torch.Tensor:
    return torch.randn(sentences * BEAM, VOCAB, generator=torch.Generator().manual_seed(0))


def test_eos_is_masked_only_for_sentences_short_of_min_len():
    rules = LogProbRules(options(min_len=3))
    before = lprobs(3)
    after, copies = rules.apply(before.clone(), view(steps=[1, 3, 2], max_lens=[9, 9, 9]))
    assert copies is None
    assert torch.isinf(after[:, PAD]).all()
    short = torch.tensor([True, True, False, False, True, True])
    assert torch.isinf(after[short, EOS]).all()
    assert torch.equal(after[~short, EOS], before[~short, EOS])
    others = [t for t in range(VOCAB) if t not in (PAD, EOS)]
    assert torch.equal(after[:, others], before[:, others])


def test_a_sentence_at_its_maximum_length_may_only_end():
    rules = LogProbRules(options(unk_penalty=0.5))
    before = lprobs(2)
    after, _ = rules.apply(before.clone(), view(steps=[4, 7], max_lens=[9, 7]))
    final = after[BEAM:]
    assert torch.equal(final[:, EOS], before[BEAM:, EOS])
    assert torch.isinf(final[:, [t for t in range(VOCAB) if t != EOS]]).all()
    torch.testing.assert_close(after[:BEAM, UNK], before[:BEAM, UNK] - 0.5)


def test_a_forced_prefix_leaves_only_its_token_and_pad_is_a_free_choice():
    rules = LogProbRules(options())
    before = lprobs(2)
    prefix = torch.tensor([[5, 6], [PAD, 7]])
    after, _ = rules.apply(before.clone(), view(steps=[0, 0], max_lens=[9, 9], prefix=prefix))
    assert torch.equal(after[:BEAM, 5], before[:BEAM, 5])
    assert (after[:BEAM, [t for t in range(VOCAB) if t != 5]] == -math.inf).all()
    free = after[BEAM:]
    assert torch.equal(free[:, PAD + 1 :], before[BEAM:, PAD + 1 :])
