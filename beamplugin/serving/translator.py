"""Raw text in, n-best translations out, for a long-running process (the server): the models,
generator, tokenizer and BPE set up from fairseq-interactive's options as fairseq-interactive sets
them up, sentences decoded on one :class:`~beamplugin.streams.TranslationStream`, in a thread of
this process or in a process of its own
(:class:`~beamplugin.serving.decoder_process.DecoderProcess`).

Thread-agnostic: ``encode`` and ``submit`` may be called from any thread, the futures resolve in
a thread of the stream (cancelling one cancels its sentence), ``render`` turns their hypotheses
into what fairseq-interactive prints (its ``D-`` text, base-2 scores, ``A-`` alignment).
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from fairseq import tasks, utils
from omegaconf import DictConfig

from beamplugin.fairseq_plugin.language_pairs import LanguagePairs, Pair
from beamplugin.fairseq_plugin.line_input import LineEncoder, RefusedLine
from beamplugin.search.constraints import Constraints
from beamplugin.search.nbest import Hypothesis
from beamplugin.serving.decoder_process import DecoderProcess
from beamplugin.serving.glossary import Glossary, glossary_of
from beamplugin.serving.loading import decoding_device, load_decoder
from beamplugin.serving.text_pieces import TextPieces
from beamplugin.streams import Prompt, StreamObserver, TranslationStream

logger = logging.getLogger(__name__)


class RefusedSentence(ValueError):
    """Sentence ``index`` of a request cannot be translated; ``reason`` says why."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"sentence {index}: {reason}")
        self.index, self.reason = index, reason


@dataclass
class Translation:
    """One hypothesis as fairseq-interactive prints it: ``text`` its D- line's text, ``pieces``
    its H- line's, ``score`` and ``positional_scores`` in base 2, ``alignment`` its A- line
    (``src-tgt`` pairs; None unless the generator aligns)."""

    text: str
    pieces: str
    score: float
    positional_scores: list[float]
    alignment: str | None
    tokens: int  # output tokens, end of sentence included


class Translator:
    """The models of ``cfg`` (fairseq-interactive's options) behind one stream with at most
    ``max_queued`` sentences waiting; each sentence is decoded as on its own, in the language
    pair its request asks for (``languages``: every pair of a multilingual task's
    ``--lang-pairs``, the one of ``-s``/``-t`` by default). ``in_process``:
    the stream decodes in a thread of this process (``generator`` is then the models'
    generator), else in a process of its own (beamplugin.serving.decoder_process), which loads
    them."""

    def __init__(self, cfg: DictConfig, max_queued: int, in_process: bool = True) -> None:
        self.cfg = cfg
        self.task = tasks.setup_task(cfg.task)
        self.stream: TranslationStream | DecoderProcess
        if in_process:
            self.generator, settings = load_decoder(cfg, self.task)
            self.stream = settings.stream(self.generator, max_queued)
            self.device = decoding_device(cfg)
        else:
            self.generator = None
            self.stream = DecoderProcess(cfg, max_queued)
            settings = self.stream.settings
            self.device = torch.device("cpu")  # the decoder process moves sources to its own
        self.nbest, self.beam = cfg.generation.nbest, settings.beam
        self.capacity = settings.max_sentences, settings.max_tokens
        self.aligns = bool(cfg.generation.print_alignment)
        self.languages = LanguagePairs.of(self.task)
        self.src_dict, self.tgt_dict = self.task.source_dictionary, self.task.target_dictionary
        self.text = TextPieces(self.task, cfg)
        limit = settings.max_source_positions
        if limit is not None:  # room for a language token
            limit -= self.languages.added_source_tokens
        self.encoder = LineEncoder(self.src_dict, limit, self.text.encode)
        # how a glossary's target terms are met (fairseq's --constraints); None: not served,
        # which keeps the device engine, which has no constrained step
        self.constraints: str | None = cfg.generation.constraints
        self.align_dict = utils.load_align_dict(cfg.generation.replace_unk)
        # the generator strips the default pair's target-language token; a request its own
        self._strip = settings.symbols_to_strip - self.languages.output_tokens(
            self.languages.default
        )

    def encode(self, lines: list[str], pair: Pair) -> list[torch.Tensor]:
        """The source tokens of every line as the encoder reads them in ``pair``, or
        RefusedSentence for the first one that cannot be translated (LineEncoder's reasons:
        not UTF-8, empty, too long for the model)."""
        encoded = []
        for index, line in enumerate(lines):
            try:
                encoded.append(self.encode_line(line, pair))
            except RefusedLine as refusal:
                raise RefusedSentence(index, refusal.reason) from None
        return encoded

    def encode_line(self, line: str, pair: Pair) -> torch.Tensor:
        """One line's source tokens as the encoder reads them in ``pair`` (its language token
        where the model has one), on the decoder's device; RefusedLine if it cannot be."""
        return self.languages.source_tokens(pair, self.encoder.encode(line)).to(self.device)

    def pieces(self, text: str) -> list[str]:
        """``text`` cut as the model reads it (beamplugin.serving.text_pieces)."""
        return self.text.pieces(text)

    def glossary(self, entries: list[tuple[str, str]]) -> Glossary:
        """The (source, target) ``entries`` as the model reads and writes them
        (beamplugin.serving.glossary.glossary_of: ValueError for a term it cannot)."""
        return glossary_of(entries, self.text.pieces, self.tgt_dict)

    def fits(self, text: str) -> bool:
        """Whether ``text`` has no more source tokens than the model accepts (what a document's
        sentences are cut to)."""
        limit = self.encoder.max_positions
        if limit is None:
            return True
        return len(self.encoder.encode_fn(text.strip()).split()) + 1 <= limit  # + end of sentence

    def prompt(self, pair: Pair) -> Prompt:
        """What a hypothesis in ``pair`` starts with (a multilingual model's target-language
        token), on the decoder's device."""
        prefix, bos = self.languages.prompt(pair)
        return Prompt(None if prefix is None else prefix.to(self.device), bos)

    def submit(
        self,
        sources: list[torch.Tensor],
        pair: Pair,
        constraints: list[Constraints | None] | None = None,
    ) -> list[Future]:
        """A future of each sentence's hypotheses in ``pair`` (best first, each holding its
        ``constraints``), queued all together or, with too few places free, none
        (``QueueFull``)."""
        return self.stream.submit_together(sources, self.prompt(pair), constraints)

    def observe(self, observer: StreamObserver) -> None:
        """Report the decoder's steps and queue waits to ``observer`` from now on."""
        self.stream.observer = observer

    @property
    def queued(self) -> int:
        """Sentences accepted and not in flight yet."""
        return self.stream.queued

    @property
    def in_flight(self) -> int:
        return self.stream.in_flight

    @property
    def cancelled(self) -> int:
        """Sentences cancelled before they were answered."""
        return self.stream.cancelled

    @property
    def restarts(self) -> int:
        """Decoder processes started to replace one that died."""
        return self.stream.restarts if isinstance(self.stream, DecoderProcess) else 0

    @property
    def restarting(self) -> bool:
        """A decoder process died and the next one is not ready yet."""
        return isinstance(self.stream, DecoderProcess) and self.stream.restarting

    def render(
        self, source: torch.Tensor, hypotheses: list[Hypothesis], pair: Pair
    ) -> list[Translation]:
        """``hypotheses`` of ``source`` in ``pair`` as fairseq-interactive post-processes and
        prints them."""
        strip = self._strip | self.languages.output_tokens(pair)
        post_process = self.cfg.common_eval.post_process
        # Token lists, not tensors: Dictionary.string reads a tensor element by element, slowly
        # (docs/speed.md). The source text only serves --replace-unk.
        src_str = ""
        if self.align_dict is not None:
            src_str = self.src_dict.string(source.tolist(), post_process)
        rendered = []
        for hypo in hypotheses:
            _, pieces, alignment = utils.post_process_prediction(
                hypo_tokens=hypo["tokens"].tolist(),
                src_str=src_str,
                alignment=hypo["alignment"],
                align_dict=self.align_dict,
                tgt_dict=self.tgt_dict,
                remove_bpe=post_process,
                extra_symbols_to_ignore=strip,
            )
            rendered.append(
                Translation(
                    text=self.text.decode(pieces),
                    pieces=pieces,
                    score=float(hypo["score"]) / math.log(2),
                    positional_scores=(hypo["positional_scores"] / math.log(2)).tolist(),
                    alignment=(
                        " ".join(f"{s}-{t}" for s, t in alignment) if self.aligns else None
                    ),
                    tokens=len(hypo["tokens"]),
                )
            )
        return rendered

    def close(self) -> None:
        """Take no more sentences; return once every accepted one is decoded."""
        self.stream.close()
