"""beamplugin's SequenceGenerator: fairseq-compatible batched beam search that is fast and exact.

A drop-in for ``fairseq.sequence_generator.SequenceGenerator`` (same constructor arguments, same
``generate``/``forward`` signatures, same output structure). With default options the outputs
equal fairseq's; on top of that:

* finished sentences leave the batch at once: tokens, scores, encoder output and incremental
  states shrink with them, and the encoder output is re-indexed only when the batch shrinks (it
  is identical for all beams of a sentence, so per-step beam reorders never touch it);
* the per-step work is a handful of tensor ops with one host synchronisation (the "did anything
  finish?" check); Python only runs when hypotheses actually finish, and then with one more;
* the search runs under ``torch.inference_mode`` (cheaper ops); what it returns are ordinary
  tensors;
* ``stopping="exact"`` keeps searching while an alive hypothesis can still beat the worst
  finished one, ``length_penalty_style="gnmt"`` normalises by ``((5 + len) / 6) ** lenpen``;
* ``no_repeat_ngram_size`` blocks n-grams with the same vectorised code on CPU and CUDA.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from fairseq import search, utils
from fairseq.models import FairseqIncrementalDecoder
from torch import Tensor, nn

from beamplugin.host_transfer import to_device, to_host
from beamplugin.search import beam_step, block_repeated_ngrams, length_normaliser

STOPPING_RULES = ("fairseq", "exact")
LENGTH_PENALTY_STYLES = ("fairseq", "gnmt")
ALIGNMENT_KINDS = (None, False, "hard", "soft")

Hypothesis = dict[str, Any]


class EnsembleDecoder(nn.Module):
    """Runs one or several encoder-decoder models as one; probabilities are averaged."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)
        for model in models:
            if getattr(model, "encoder", None) is None or getattr(model, "decoder", None) is None:
                raise ValueError(
                    f"SequenceGenerator needs encoder-decoder models, got {type(model).__name__}"
                )
        self.incremental = all(isinstance(m.decoder, FairseqIncrementalDecoder) for m in models)
        # Decoders that read one encoder_out row per sentence whatever their rows per sentence
        # (beamplugin's convs2s); the others get a copy per decoder row, as in fairseq, and may
        # assume beam rows per sentence (fconv's BeamableMM does).
        self.per_sentence = [
            getattr(m.decoder, "reads_encoder_out_per_sentence", False) for m in models
        ]
        self.first_step_one_row = all(self.per_sentence)  # see _Search

    def max_decoder_positions(self) -> int:
        return min(m.max_decoder_positions() for m in self.models)

    def encode(self, net_input: dict[str, Tensor]) -> list[Any]:
        return [model.encoder.forward_torchscript(net_input) for model in self.models]

    def select_sentences(
        self, encoder_outs: list[Any], sentences: Tensor, rows_before: int, rows_after: int
    ) -> list[Any]:
        """The encoder outputs of ``sentences`` (indices into the current ones), laid out for
        ``rows_after`` decoder rows per sentence; the current ones serve ``rows_before``."""
        copies = None  # the rows of decoders that read the encoder output per row
        if not all(self.per_sentence):
            copies = (sentences * rows_before).repeat_interleave(rows_after)
        return [
            model.encoder.reorder_encoder_out(out, sentences if per_sentence else copies)
            for model, out, per_sentence in zip(
                self.models, encoder_outs, self.per_sentence, strict=True
            )
        ]

    def reorderers(self) -> list[list[nn.Module]]:
        """Per model, the decoder modules that keep incremental state: what fairseq's
        ``reorder_incremental_state_scripting`` finds by walking all modules at every step."""
        if not self.incremental:
            return [[] for _ in self.models]
        return [
            [m for m in model.decoder.modules() if hasattr(m, "reorder_incremental_state")]
            for model in self.models
        ]

    def reorder_states(
        self, reorderers: list[list[nn.Module]], states: list[dict], order: Tensor
    ) -> None:
        for modules, state in zip(reorderers, states, strict=True):
            for module in modules:
                result = module.reorder_incremental_state(state, order)
                if result is not None:
                    state = result

    def decode_step(
        self, tokens: Tensor, encoder_outs: list[Any], states: list[dict], temperature: float
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs ``[rows, vocab]`` of the next token and attention ``[rows, src]`` (or None)."""
        lprobs, attns = [], []
        for model, encoder_out, state in zip(self.models, encoder_outs, states, strict=True):
            if self.incremental:
                out = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
            else:
                out = model.decoder(tokens, encoder_out=encoder_out)
            extra = out[1] if len(out) > 1 else None
            logits = out[0][:, -1:, :]
            if temperature != 1.0:
                logits = logits / temperature
            lprobs.append(
                model.get_normalized_probs((logits, extra), log_probs=True, sample=None)[:, -1, :]
            )
            attn = _last_step_attention(extra)
            if attn is not None:
                attns.append(attn)
        if len(lprobs) == 1:
            return lprobs[0], attns[0] if attns else None
        # log of the mean probability, as fairseq's EnsembleModel
        mean_lprobs = torch.logsumexp(torch.stack(lprobs), dim=0) - math.log(len(lprobs))
        mean_attn = torch.stack(attns).sum(0).div_(len(attns)) if attns else None
        return mean_lprobs, mean_attn


def _last_step_attention(extra: Any) -> Tensor | None:
    attn = extra
    if isinstance(extra, dict):
        attn = extra.get("attn")
        if isinstance(attn, list | tuple):
            attn = attn[0] if attn else None
    if not isinstance(attn, Tensor):
        return None
    return attn[:, -1, :]


def _length_constraints(strategy: Any) -> tuple[float, float, float, float] | None:
    """(min_len_a, min_len_b, max_len_a, max_len_b) of a LengthConstrainedBeamSearch, else None."""
    if strategy is None or type(strategy) is search.BeamSearch:
        return None
    if type(strategy) is search.LengthConstrainedBeamSearch:
        return strategy.min_len_a, strategy.min_len_b, strategy.max_len_a, strategy.max_len_b
    raise ValueError(
        f"search_strategy {type(strategy).__name__} is not supported by beamplugin's "
        "SequenceGenerator (only BeamSearch and LengthConstrainedBeamSearch); use fairseq's "
        "SequenceGenerator for sampling, diverse or constrained search"
    )


class SequenceGenerator(nn.Module):
    """Beam search over an ensemble of fairseq encoder-decoder models.

    Arguments are fairseq's (see ``fairseq.sequence_generator.SequenceGenerator``) plus:

    Args:
        stopping: ``"fairseq"``: a sentence ends once it holds ``beam_size`` finished
            hypotheses (or at max length). ``"exact"``: it ends only when, in addition, no alive
            hypothesis can still beat the worst of them under the length penalty.
        length_penalty_style: ``"fairseq"`` divides scores by ``len ** len_penalty``,
            ``"gnmt"`` by ``((5 + len) / 6) ** len_penalty``; ``len`` counts tokens incl. EOS.
        print_alignment: ``"hard"`` or ``"soft"`` fills each hypothesis' ``alignment`` from
            its attention, like fairseq's ``SequenceGeneratorWithAlignment``.
        nbest: hypotheses returned per sentence (default ``beam_size``).
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
    ) -> None:
        super().__init__()
        if beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {beam_size}")
        if nbest is not None and not 1 <= nbest <= beam_size:
            raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
        if not temperature > 0:
            raise ValueError(f"temperature must be greater than 0, got {temperature}")
        if no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got {no_repeat_ngram_size}")
        if stopping not in STOPPING_RULES:
            raise ValueError(f"stopping must be one of {STOPPING_RULES}, got {stopping!r}")
        if length_penalty_style not in LENGTH_PENALTY_STYLES:
            raise ValueError(
                f"length_penalty_style must be one of {LENGTH_PENALTY_STYLES}, "
                f"got {length_penalty_style!r}"
            )
        if print_alignment not in ALIGNMENT_KINDS:
            raise ValueError(
                f"print_alignment must be 'hard', 'soft' or None, got {print_alignment!r}"
            )
        if stopping == "exact" and lm_model is not None and lm_weight < 0:
            raise ValueError("stopping='exact' needs lm_weight >= 0 (scores must not increase)")
        self.length_constraints = _length_constraints(search_strategy)
        if isinstance(models, EnsembleDecoder):
            self.model = models
        else:
            self.model = EnsembleDecoder(list(getattr(models, "models", models)))
        self.tgt_dict = tgt_dict
        self.pad, self.unk = tgt_dict.pad(), tgt_dict.unk()
        self.eos = tgt_dict.eos() if eos is None else eos
        self.symbols_to_strip_from_output = set(symbols_to_strip_from_output or ()) | {self.eos}
        self.vocab_size = len(tgt_dict)
        # pad is never selected, so a beam can hold at most vocab - 1 distinct tokens
        self.beam_size = min(beam_size, self.vocab_size - 1)
        self.nbest = self.beam_size if nbest is None else min(nbest, self.beam_size)
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.min_len = min_len
        self.max_len = max_len or self.model.max_decoder_positions()
        if max_len_a == 0 and min_len > min(max_len_b, self.max_len - 1):
            raise ValueError(
                f"min_len={min_len} is larger than the maximum output length "
                f"{min(max_len_b, self.max_len - 1)} (max_len_b={max_len_b}, max_len={max_len})"
            )
        self.normalize_scores = normalize_scores
        self.len_penalty = len_penalty
        self.unk_penalty = unk_penalty
        self.temperature = temperature
        self.match_source_len = match_source_len
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.stopping = stopping
        self.length_penalty_style = length_penalty_style
        self.print_alignment = print_alignment or None
        self.lm_model, self.lm_weight = lm_model, lm_weight
        suppress = []
        for token in tokens_to_suppress:
            index = tgt_dict.index(token)
            if index == self.unk:
                raise ValueError(f"tokens_to_suppress: {token!r} is not in the dictionary")
            suppress.append(index)
        # Tokens set to -inf before each step: always pad; suppressed tokens and, before
        # min_len, EOS only on steps without a forced prefix token (fairseq's rules).
        self._masked_prefix_step = [self.pad]
        self._masked_free_step = [self.pad, *suppress]
        self._masked_short_step = [self.pad, *suppress, self.eos]
        self.model.eval()
        if lm_model is not None:
            lm_model.eval()

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
        """Translate a batch; per sentence a list of hypotheses, best first (fairseq's format)."""
        if constraints is not None:
            raise NotImplementedError(
                "lexical constraints are served by fairseq's SequenceGenerator, not beamplugin's"
            )
        return self._generate(sample, prefix_tokens, bos_token)

    def _output_limit(self, src_tokens: Tensor, src_lengths: Tensor) -> int:
        if self.match_source_len:
            return int(src_lengths.max().item())
        return min(int(self.max_len_a * src_tokens.size(1) + self.max_len_b), self.max_len - 1)

    def _normalise(self, cumulative: Tensor, length: int) -> Tensor:
        if not self.normalize_scores:
            return cumulative
        return cumulative / length_normaliser(length, self.len_penalty, self.length_penalty_style)

    def _generate(
        self, sample: dict[str, Any], prefix_tokens: Tensor | None, bos_token: int | None
    ) -> list[list[Hypothesis]]:
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        src_lengths = net_input.get("src_lengths")
        if src_lengths is None:
            src_lengths = (src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(1)
        max_len = self._output_limit(src_tokens, src_lengths)
        if self.min_len > max_len:
            raise ValueError(
                f"min_len={self.min_len} is larger than the maximum output length {max_len} "
                f"for this batch (max_len_a={self.max_len_a}, max_len_b={self.max_len_b})"
            )
        search = _Search(self, sample, src_tokens, src_lengths, prefix_tokens, bos_token, max_len)
        # Inference mode skips autograd's version counting and views on every op: on the CPU
        # the search's many small ops and the model's take ~20% less time than under no_grad.
        with torch.inference_mode():
            finalized = search.run()
        results = [_best_first(hypos)[: self.nbest] for hypos in finalized]
        if self.print_alignment:
            self._add_alignments(results, src_tokens)
        return results

    def _add_alignments(self, results: list[list[Hypothesis]], src_tokens: Tensor) -> None:
        extract = (
            utils.extract_hard_alignment
            if self.print_alignment == "hard"
            else utils.extract_soft_alignment
        )
        src_tokens = src_tokens.cpu()
        for sent, hypos in enumerate(results):
            for hypo in hypos:
                if hypo["attention"].numel() == 0:
                    raise ValueError(
                        "print_alignment needs a model that returns attention (for fconv, "
                        "prepare it with make_generation_fast_(need_attn=True))"
                    )
                hypo["alignment"] = extract(
                    hypo["attention"].t(), src_tokens[sent], hypo["tokens"], self.pad, self.eos
                )


def _best_first(hypos: list[Hypothesis]) -> list[Hypothesis]:
    # The same sort call as fairseq, so that equal scores keep fairseq's order.
    order = torch.sort(torch.tensor([float(h["score"]) for h in hypos]), descending=True).indices
    return [hypos[i] for i in order.tolist()]


class _Search:
    """State of one ``generate`` call: live sentences, their hypotheses and the finished ones."""

    def __init__(
        self,
        gen: SequenceGenerator,
        sample: dict[str, Any],
        src_tokens: Tensor,
        src_lengths: Tensor,
        prefix_tokens: Tensor | None,
        bos_token: int | None,
        max_len: int,
    ) -> None:
        self.gen = gen
        self.beam = gen.beam_size
        self.max_len = max_len
        bsz = src_tokens.size(0)
        device = src_tokens.device
        self.device = device
        self.net_input = sample["net_input"]
        # Original index of each live sentence (host side) and per-sentence tensors to shrink.
        self.live: list[int] = list(range(bsz))
        self.src_lengths = src_lengths
        self.prefix_tokens = prefix_tokens
        self.finalized: list[list[Hypothesis]] = [[] for _ in range(bsz)]
        # Decoder rows are sentence-major: [live sentences x rows per sentence]. At the first
        # step a sentence has one hypothesis, so models that allow it decode one row per
        # sentence; the others decode beam identical rows, as in fairseq. From the second step
        # on, a row per hypothesis: beam per sentence.
        self.rows_per_sentence = 1 if gen.model.first_step_one_row else self.beam
        self.tokens = torch.full(
            (bsz * self.rows_per_sentence, 1),
            gen.eos if bos_token is None else bos_token,
            dtype=torch.long,
            device=device,
        )
        self.cumulative: Tensor | None = None  # [rows, steps] cumulative score history
        self.attention: Tensor | None = None  # [rows, steps, src_len] attention history
        self.scores: Tensor | None = None  # [live, hypotheses] cumulative scores
        # Exact stopping: worst finished score of full sentences (-inf while not full).
        self.worst = torch.full((bsz,), -math.inf, device=device)
        self._offsets: dict[tuple[int, int], Tensor] = {}
        self.masked_prefix_step = to_device(gen._masked_prefix_step, device)
        self.masked_free_step = to_device(gen._masked_free_step, device)
        self.masked_short_step = to_device(gen._masked_short_step, device)
        # Steps at which a prefix ends (EOS) for some sentence, known once on the host.
        self.prefix_end_steps: set[int] = set()
        if prefix_tokens is not None:
            ends = to_host(prefix_tokens.eq(gen.eos).any(0))[0]
            self.prefix_end_steps = set(ends.nonzero().view(-1).tolist())
        if gen.length_constraints is not None:
            min_a, min_b, max_a, max_b = gen.length_constraints
            self.min_lens = min_a * src_lengths + min_b
            self.max_lens = max_a * src_lengths + max_b

    def offsets(self, n: int, rows_per_sentence: int) -> Tensor:
        """``[n, 1]`` first row of each of ``n`` live sentences."""
        key = (n, rows_per_sentence)
        if key not in self._offsets:
            first = torch.arange(n, device=self.device) * rows_per_sentence
            self._offsets[key] = first.unsqueeze(1)
        return self._offsets[key]

    def run(self) -> list[list[Hypothesis]]:
        gen, beam = self.gen, self.beam
        model = gen.model
        encoder_outs = model.encode(self.net_input)  # one row per sentence
        if self.rows_per_sentence > 1:
            sentences = torch.arange(len(self.live), device=self.device)
            encoder_outs = model.select_sentences(encoder_outs, sentences, 1, beam)
        states: list[dict] = [{} for _ in model.models]
        self.reorderers = model.reorderers()
        for step in range(self.max_len + 1):
            lprobs, attn = model.decode_step(self.tokens, encoder_outs, states, gen.temperature)
            n, rows_per_sentence = len(self.live), self.rows_per_sentence
            if self.scores is None:  # first step: one hypothesis per sentence
                self.scores = lprobs.new_zeros(n, 1)
                self.cumulative = lprobs.new_empty(lprobs.size(0), 0)
                if attn is not None:
                    self.attention = attn.new_empty(attn.size(0), 0, attn.size(1))
            lprobs = self.mask(lprobs, step)
            # the first row of a sentence for each hypothesis (more are copies at step 0)
            live_lprobs = lprobs.view(n, rows_per_sentence, -1)[:, : self.scores.size(1)]
            res = beam_step(live_lprobs, self.scores, beam, gen.eos)
            status, bound = self.step_status(res, step)
            keep: Tensor | None = None
            if step == self.max_len or status.any():
                slots = res.finalize.size(1)  # beam, or fewer with a tiny vocabulary
                if status[:, slots].any():
                    # fairseq's rule: NaN log-probs become -inf (rare, so only redone here)
                    lprobs.nan_to_num_(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
                    res = beam_step(live_lprobs, self.scores, beam, gen.eos)
                    status, bound = self.step_status(res, step)
                done = self.finish(step, res, status[:, :slots], bound, lprobs, attn)
                if step == self.max_len or all(done):
                    break
                if any(done):
                    keep_list = [i for i, d in enumerate(done) if not d]
                    keep = to_device(keep_list, self.device)
                    self.live = [self.live[i] for i in keep_list]
            self.advance(res, attn, keep, states)
            if keep is not None or rows_per_sentence != beam:
                sentences = torch.arange(n, device=self.device) if keep is None else keep
                encoder_outs = model.select_sentences(
                    encoder_outs, sentences, rows_per_sentence, beam
                )
        return self.finalized

    def step_status(self, res: Any, step: int) -> tuple[Tensor, Tensor | None]:
        """The one host synchronisation of a step: on the host, per live sentence, which of
        the top beam candidates end in EOS, whether the best candidate is NaN (a NaN log-prob
        would rank first: topk puts NaN on top) and, for exact stopping, whether no live
        hypothesis can beat the worst finished one; with exact stopping also that bound."""
        columns = [res.finalize, res.cand_scores[:, :1].isnan()]
        if self.gen.stopping != "exact":
            return to_host(torch.cat(columns, 1))[0], None
        bound = self.best_possible(res.alive_scores[:, 0], step)
        columns.append(bound.le(self.worst).unsqueeze(1))
        status, bound = to_host(torch.cat(columns, 1), bound)
        return status, bound

    def mask(self, lprobs: Tensor, step: int) -> Tensor:
        """fairseq's per-step rules: pad, unk penalty, max/min length, prefix, suppression."""
        gen = self.gen
        if gen.lm_model is not None:
            lm_out = gen.lm_model(self.tokens)
            lm_lprobs = gen.lm_model.get_normalized_probs(lm_out, log_probs=True, sample=None)
            lprobs = lprobs + lm_lprobs[:, -1, :] * gen.lm_weight
        prefix_step = (
            self.prefix_tokens is not None
            and step < self.prefix_tokens.size(1)
            and step < self.max_len
        )
        if prefix_step:
            masked = self.masked_prefix_step
        elif step < gen.min_len:
            masked = self.masked_short_step
        else:
            masked = self.masked_free_step
        lprobs.index_fill_(1, masked, -math.inf)
        if gen.unk_penalty:
            lprobs[:, gen.unk] -= gen.unk_penalty
        if step >= self.max_len:  # only EOS is left
            eos_lprobs = lprobs[:, gen.eos].clone()
            lprobs.fill_(-math.inf)
            lprobs[:, gen.eos] = eos_lprobs
        if prefix_step:
            lprobs = self.force_prefix(lprobs, step)
        if gen.no_repeat_ngram_size > 0:
            block_repeated_ngrams(self.tokens, lprobs, gen.no_repeat_ngram_size)
        if gen.length_constraints is not None:
            eos_lprobs = lprobs.view(len(self.live), self.rows_per_sentence, -1)[:, :, gen.eos]
            eos_lprobs.masked_fill_((step < self.min_lens).unsqueeze(1), -math.inf)
            eos_lprobs.masked_fill_((step >= self.max_lens).unsqueeze(1), 0.0)
        return lprobs

    def force_prefix(self, lprobs: Tensor, step: int) -> Tensor:
        """Keep only the prefix token where one is given (pad = free choice at this step)."""
        per_sentence = self.rows_per_sentence
        forced = self.prefix_tokens[:, step].repeat_interleave(per_sentence).unsqueeze(1)
        only_forced = torch.full_like(lprobs, -math.inf).scatter_(
            1, forced, lprobs.gather(1, forced)
        )
        lprobs = torch.where(forced.ne(self.gen.pad), only_forced, lprobs)
        if step in self.prefix_end_steps:
            # A prefix that ends here: all beams become copies of beam 0 (the only one that
            # followed the prefix), as in fairseq; attention stays per row as fairseq's does.
            rows = torch.arange(lprobs.size(0), device=lprobs.device)
            first = rows - rows % per_sentence
            source = torch.where(forced.squeeze(1).eq(self.gen.eos), first, rows)
            lprobs = lprobs.index_select(0, source)
            self.tokens = self.tokens.index_select(0, source)
            self.cumulative = self.cumulative.index_select(0, source)
            if self.scores.size(1) == per_sentence:  # else one score per sentence: unchanged
                self.scores = self.scores.reshape(-1)[source].view(-1, per_sentence)
        return lprobs

    def best_possible(self, best_alive: Tensor, step: int) -> Tensor:
        """Upper bound of the final score of any continuation of the live hypotheses.

        A live hypothesis after ``step`` has ``step + 1`` tokens; it can end with a length
        ``L`` in ``[step + 2, max_len + 1]``. Log-probs are <= 0, so its summed score can only
        drop, except by the unk bonus of a negative unk penalty: ``N = best + bonus``. Its
        normalised score is ``S / lp(L)`` with ``S <= N`` and ``lp > 0`` monotone in ``L``,
        so ``S / lp(L) <= N / lp(L)``, which is largest at one end of the length range:
        ``N / max(lp)`` when ``N <= 0``, else ``N / min(lp)``.
        """
        gen = self.gen
        bonus = max(0.0, -gen.unk_penalty) * (self.max_len - step)
        ceiling = best_alive + bonus if bonus else best_alive
        if not gen.normalize_scores:
            return ceiling
        ends = [
            length_normaliser(length, gen.len_penalty, gen.length_penalty_style)
            for length in (step + 2, self.max_len + 1)
        ]
        return torch.where(ceiling > 0, ceiling / min(ends), ceiling / max(ends))

    def finish(
        self,
        step: int,
        res: Any,
        finalize: Tensor,
        bound: Tensor | None,
        lprobs: Tensor,
        attn: Tensor | None,
    ) -> list[bool]:
        """Store the hypotheses that end now (``finalize``: the host copy of res.finalize) and
        return, per live sentence, whether it is done."""
        gen, beam, per_sentence = self.gen, self.beam, self.rows_per_sentence
        sents, slots = finalize.nonzero(as_tuple=True)
        sents_dev, cands = to_device(
            torch.stack([sents, sents * res.cand_beams.size(1) + slots]), self.device
        )
        rows = sents_dev * per_sentence + res.cand_beams.view(-1).index_select(0, cands)
        self.store(
            step, sents, sents_dev, rows, res.cand_scores.view(-1).index_select(0, cands), attn
        )
        counts = [len(self.finalized[s]) for s in self.live]
        if step == self.max_len:
            done = [True] * len(self.live)
        elif gen.stopping == "fairseq":
            done = [c >= beam for c in counts]
        else:
            worst = [
                min(float(h["score"]) for h in self.finalized[s]) if c >= beam else -math.inf
                for s, c in zip(self.live, counts, strict=True)
            ]
            worst_host = torch.tensor(worst, dtype=self.worst.dtype)
            self.worst = to_device(worst_host, self.device)
            done = bound.le(worst_host).tolist()
        empty = [i for i, d in enumerate(done) if d and counts[i] == 0]
        if empty:
            # Nothing reached EOS: the live hypotheses, with EOS appended, are the answer
            # (beam of them, as in fairseq, even at the first step where all are the same).
            sents = torch.tensor(empty).repeat_interleave(beam)
            hypos = torch.arange(beam).repeat(len(empty))
            sents_dev, hypos_dev = to_device(torch.stack([sents, hypos]), self.device)
            rows = sents_dev * per_sentence + hypos_dev % per_sentence
            cumulative = self.scores[sents_dev, hypos_dev % self.scores.size(1)]
            cumulative = cumulative + lprobs[rows, gen.eos]
            self.store(step, sents, sents_dev, rows, cumulative, attn)
        return done

    def store(
        self,
        step: int,
        sents: Tensor,
        sents_dev: Tensor,
        rows: Tensor,
        eos_cumulative: Tensor,
        attn: Tensor | None,
    ) -> None:
        """Add hypotheses (live rows ``rows`` followed by EOS) to the n-best lists of their
        sentences (``sents`` on the host, ``sents_dev`` the same on the device)."""
        gen = self.gen
        tokens = torch.cat(
            [self.tokens.index_select(0, rows)[:, 1:], torch.full_like(rows, gen.eos)[:, None]], 1
        )
        cumulative = torch.cat([self.cumulative.index_select(0, rows), eos_cumulative[:, None]], 1)
        positional = torch.cat([cumulative[:, :1], cumulative[:, 1:] - cumulative[:, :-1]], 1)
        scores = gen._normalise(eos_cumulative, step + 1)
        if gen.match_source_len:
            too_long = step > self.src_lengths.index_select(0, sents_dev)
            scores = scores.masked_fill(too_long, -math.inf)
        fetched = [tokens, positional, scores]
        if attn is not None:
            history = [self.attention.index_select(0, rows), attn.index_select(0, rows)[:, None]]
            fetched.append(torch.cat(history, 1).transpose(1, 2))
        # Returned tensors must be ordinary ones: callers change them in place
        # (fairseq-generate divides the positional scores by log 2).
        with torch.inference_mode(False):
            tokens, positional, scores, *attention = [t.clone() for t in to_host(*fetched)]
        for i, sent in enumerate(sents.tolist()):
            hypos = self.finalized[self.live[sent]]
            hypo = {
                "tokens": tokens[i],
                "score": scores[i],
                "attention": attention[0][i] if attention else torch.empty(0),
                "alignment": torch.empty(0),
                "positional_scores": positional[i],
            }
            if len(hypos) < self.beam:
                hypos.append(hypo)
            elif gen.stopping == "exact":
                # n-best keeper: a better hypothesis evicts the worst one
                worst = min(range(len(hypos)), key=lambda j: float(hypos[j]["score"]))
                if float(hypo["score"]) > float(hypos[worst]["score"]):
                    hypos[worst] = hypo

    def advance(self, res: Any, attn: Tensor | None, keep: Tensor | None, states: list) -> None:
        """Move to the next beam (dropping finished sentences): tokens, histories, states."""
        alive_beams, alive_tokens = res.alive_beams, res.alive_tokens
        alive_scores = res.alive_scores
        offsets = self.offsets(alive_beams.size(0), self.rows_per_sentence)
        if keep is not None:
            alive_beams, alive_tokens = alive_beams[keep], alive_tokens[keep]
            alive_scores, offsets = alive_scores[keep], offsets[keep]
            self.worst = self.worst[keep]
            self.src_lengths = self.src_lengths[keep]
            if self.prefix_tokens is not None:
                self.prefix_tokens = self.prefix_tokens[keep]
            if self.gen.length_constraints is not None:
                self.min_lens, self.max_lens = self.min_lens[keep], self.max_lens[keep]
        order = (alive_beams + offsets).view(-1)
        self.tokens = torch.cat([self.tokens.index_select(0, order), alive_tokens.view(-1, 1)], 1)
        self.cumulative = torch.cat(
            [self.cumulative.index_select(0, order), alive_scores.view(-1, 1)], 1
        )
        if attn is not None:
            history = torch.cat([self.attention, attn.unsqueeze(1)], 1)
            self.attention = history.index_select(0, order)
        self.scores = alive_scores
        self.rows_per_sentence = self.beam
        self.gen.model.reorder_states(self.reorderers, states, order)
