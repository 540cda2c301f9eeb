"""beamplugin's SequenceGenerator: fairseq-compatible batched beam search that is fast and exact.

A drop-in for ``fairseq.sequence_generator.SequenceGenerator`` (same constructor arguments, same
``generate``/``forward`` signatures, same output structure). With default options the outputs
equal fairseq's. ``generate`` admits the whole batch into a :class:`~beamplugin.engine.
DecodingEngine` and steps it until every sentence is finished: the same engine that decodes
streams with continuous batching (beamplugin.streams), so static and continuous decoding
cannot drift apart. On top of fairseq's generator:

* finished sentences leave the batch at once (their slots go to the next sentences in a stream);
* the per-step work is a handful of tensor ops with one host synchronisation (the "did anything
  finish?" check); Python only runs when hypotheses actually finish, and then with one more;
* the search runs under ``torch.inference_mode`` (cheaper ops); what it returns are ordinary
  tensors;
* ``stopping="exact"`` keeps searching while an alive hypothesis can still beat the worst
  finished one, ``length_penalty_style="gnmt"`` normalises by ``((5 + len) / 6) ** lenpen``;
* ``no_repeat_ngram_size`` blocks n-grams with the same vectorised code on CPU and CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from fairseq import search
from fairseq.token_generation_constraints import unpack_constraints
from torch import Tensor, nn

from beamplugin.engine import Request, open_engine
from beamplugin.engine.ensemble import EnsembleDecoder
from beamplugin.search.nbest import Hypothesis
from beamplugin.search.options import DecodingOptions, LengthConstraints
from beamplugin.search.vocabulary_map import VocabularyMap
from beamplugin.streams import IteratorSource, run


def _strategy_options(strategy: Any) -> tuple[LengthConstraints | None, str | None]:
    """The length bounds (min_len_a, min_len_b, max_len_a, max_len_b) of a
    LengthConstrainedBeamSearch and the representation ("ordered" or "unordered") of a
    LexicallyConstrainedBeamSearch; None where the strategy has none."""
    if strategy is None or type(strategy) is search.BeamSearch:
        return None, None
    if type(strategy) is search.LengthConstrainedBeamSearch:
        bounds = strategy.min_len_a, strategy.min_len_b, strategy.max_len_a, strategy.max_len_b
        return bounds, None
    if type(strategy) is search.LexicallyConstrainedBeamSearch:
        return None, strategy.representation
    raise ValueError(
        f"search_strategy {type(strategy).__name__} is not supported by beamplugin's "
        "SequenceGenerator (only BeamSearch, LengthConstrainedBeamSearch and "
        "LexicallyConstrainedBeamSearch); use fairseq's SequenceGenerator for sampling or "
        "diverse search"
    )


def _suppressed(tgt_dict: Any, tokens: tuple[str, ...] | list[str]) -> tuple[int, ...]:
    """The ids of ``tokens``; a token not in the dictionary is an error."""
    ids = []
    for token in tokens:
        index = tgt_dict.index(token)
        if index == tgt_dict.unk():
            raise ValueError(f"tokens_to_suppress: {token!r} is not in the dictionary")
        ids.append(index)
    return tuple(ids)


class SequenceGenerator(nn.Module):
    """Beam search over an ensemble of fairseq encoder-decoder models.

    Arguments are fairseq's (see ``fairseq.sequence_generator.SequenceGenerator``) plus
    ``stopping``, ``length_penalty_style``, ``print_alignment`` (``"hard"`` or ``"soft"``: like
    fairseq's ``SequenceGeneratorWithAlignment``), ``nbest`` (hypotheses returned per sentence,
    default ``beam_size``), ``attention`` (False: hypotheses without their attention, as
    fairseq-generate needs them without ``--print-alignment``), ``shortlist`` (a
    :class:`~beamplugin.search.vocabulary_map.VocabularyMap`), ``device_engine`` and
    ``cuda_graphs``: see
    :class:`~beamplugin.search.options.DecodingOptions`, which they become (``self.options``),
    validated once.
    """

    def __init__(
        self,
        models: list[nn.Module] | Any,
        tgt_dict: Any,
        beam_size: int = 1,
        max_len_a: float = 0,
        max_len_b: int = 200,
        max_len: int = 0,
        min_len: int = 1,
        normalize_scores: bool = True,
        len_penalty: float = 1.0,
        unk_penalty: float = 0.0,
        temperature: float = 1.0,
        match_source_len: bool = False,
        no_repeat_ngram_size: int = 0,
        search_strategy: Any = None,
        eos: int | None = None,
        symbols_to_strip_from_output: set[int] | None = None,
        lm_model: nn.Module | None = None,
        lm_weight: float = 1.0,
        tokens_to_suppress: tuple[str, ...] | list[str] = (),
        stopping: str = "fairseq",
        length_penalty_style: str = "fairseq",
        print_alignment: str | None = None,
        nbest: int | None = None,
        attention: bool = True,
        shortlist: VocabularyMap | None = None,
        device_engine: str = "auto",
        cuda_graphs: bool = True,
    ) -> None:
        super().__init__()
        if nbest is not None and not 1 <= nbest <= beam_size:
            raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
        if stopping == "exact" and lm_model is not None and lm_weight < 0:
            raise ValueError("stopping='exact' needs lm_weight >= 0 (scores must not increase)")
        length_constraints, constraints = _strategy_options(search_strategy)
        models = list(getattr(models, "models", models))
        self.model = EnsembleDecoder(models, lm_model, lm_weight)
        self.tgt_dict = tgt_dict
        self.vocab_size = len(tgt_dict)
        # pad is never selected, so a beam can hold at most vocab - 1 distinct tokens
        beam = min(beam_size, self.vocab_size - 1) if beam_size >= 1 else beam_size
        self.options = DecodingOptions(
            eos=tgt_dict.eos() if eos is None else eos,
            pad=tgt_dict.pad(),
            unk=tgt_dict.unk(),
            max_len=max_len or self.model.max_decoder_positions(),
            beam_size=beam,
            nbest=beam if nbest is None else min(nbest, beam),
            max_len_a=max_len_a,
            max_len_b=max_len_b,
            min_len=min_len,
            normalize_scores=normalize_scores,
            len_penalty=len_penalty,
            length_penalty_style=length_penalty_style,
            unk_penalty=unk_penalty,
            temperature=temperature,
            match_source_len=match_source_len,
            no_repeat_ngram_size=no_repeat_ngram_size,
            suppressed=_suppressed(tgt_dict, tokens_to_suppress),
            length_constraints=length_constraints,
            stopping=stopping,
            print_alignment=print_alignment or None,
            attention=attention,
            shortlist=shortlist,
            device_engine=device_engine,
            cuda_graphs=cuda_graphs,
            constraints=constraints,
        )
        # fairseq's generator attributes, read by fairseq-generate and -interactive
        self.beam_size = self.options.beam_size
        self.pad, self.unk, self.eos = self.options.pad, self.options.unk, self.options.eos
        self.symbols_to_strip_from_output = set(symbols_to_strip_from_output or ()) | {self.eos}
        self.model.eval()

    @torch.no_grad()
    def forward(
        self,
        sample: dict[str, Any],
        prefix_tokens: Tensor | None = None,
        bos_token: int | None = None,
    ) -> list[list[Hypothesis]]:
        return self._generate(sample, prefix_tokens, bos_token)

    @torch.no_grad()
    def generate(
        self,
        models: Any,
        sample: dict[str, Any],
        prefix_tokens: Tensor | None = None,
        constraints: Tensor | None = None,
        bos_token: int | None = None,
        **kwargs: Any,
    ) -> list[list[Hypothesis]]:
        """Translate a batch; per sentence a list of hypotheses, best first (fairseq's format).
        ``constraints``: fairseq's packed constraints (``pack_constraints``), met as the
        search strategy (a ``LexicallyConstrainedBeamSearch``) says."""
        if constraints is not None and self.options.constraints is None:
            raise NotImplementedError(  # fairseq's generator's error
                "Target-side constraints were provided, but search method doesn't support them"
            )
        return self._generate(sample, prefix_tokens, bos_token, constraints)

    def _generate(
        self,
        sample: dict[str, Any],
        prefix_tokens: Tensor | None,
        bos_token: int | None,
        constraints: Tensor | None = None,
    ) -> list[list[Hypothesis]]:
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        batch = Request(
            list(range(src_tokens.size(0))), src_tokens, net_input.get("src_lengths"), prefix_tokens
        )
        if constraints is not None:
            batch.constraints = [
                [c.tolist() for c in unpack_constraints(row)] for row in constraints.cpu()
            ]
        results: list[list[Hypothesis]] = [[] for _ in batch.keys]
        engine = open_engine(self.model, self.options, bos_token=bos_token)
        # Inference mode skips autograd's version counting and views on every op: the search's
        # many small ops and the model's take less time than under no_grad (docs/speed.md).
        with torch.inference_mode():
            for finished in run(engine, IteratorSource([batch])):
                if finished.error is not None:
                    raise finished.error
                results[finished.key] = finished.hypotheses
        return results
