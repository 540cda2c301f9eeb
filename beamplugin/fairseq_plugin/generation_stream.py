"""fairseq-generate's batches decoded as one stream (continuous batching).

fairseq-generate asks the task for one batch's hypotheses at a time (``inference_step``) and
prints them before it takes the next batch. To keep the engine full while a batch's last
sentences finish, the task reads ahead: the batch iterator it hands out is a
:class:`ReadAhead`, and the :class:`GenerationStream` behind it feeds the engine sentence after
sentence, in the iterator's order, taking further batches from it whenever the engine has room;
``inference_step`` returns once every sentence of the batch it was given is finished. Batches
read ahead are handed to fairseq-generate later, as usual. Every sentence is a request of its
own, so its results are those it gets alone. Capacity: ``--batch-size`` sentences and
``--max-tokens`` source tokens in flight (fairseq's units: the engine counts beam x source).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from fairseq import utils
from fairseq.token_generation_constraints import unpack_constraints
from torch import Tensor

from beamplugin.engine import Finished, Request, engine_for
from beamplugin.fairseq_plugin.generator import SequenceGenerator
from beamplugin.runtime.host_transfer import to_device
from beamplugin.search.nbest import Hypothesis
from beamplugin.streams import IteratorSource, run, sentence_request

logger = logging.getLogger(__name__)

Batch = dict[str, Any]
# A batch's forced prefixes [sentences, p] (or None) and the BOS its hypotheses start from (or
# None: EOS): the task's ``decoder_prompts``.
Prompts = Callable[[Batch], tuple[Tensor | None, int | None]]


class ReadAhead:
    """A batch iterator (fairseq's CountingIterator, wrapped) that can be read ahead of its
    consumer: batches taken early by :meth:`read` are still handed out, in order, by ``next``."""

    def __init__(self, batches: Any, max_sentences: int | None, max_tokens: int | None) -> None:
        self.batches = batches
        self.max_sentences, self.max_tokens = max_sentences, max_tokens
        self.handed_out: Batch | None = None  # the consumer's current batch
        self._read_early: deque[Batch] = deque()  # read ahead, not handed out yet
        # handed out before the stream read them (kept only once there is a stream)
        self._unread: deque[Batch] = deque()
        self.stream: GenerationStream | None = None

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> Batch:
        if self._read_early:
            self.handed_out = self._read_early.popleft()
        else:
            self.handed_out = next(self.batches)
            if self.stream is not None:
                self._unread.append(self.handed_out)
        return self.handed_out

    def __getattr__(self, name: str) -> Any:  # n, has_next, take, ...: the wrapped iterator's
        return getattr(self.batches, name)

    def start_stream(self, generator: SequenceGenerator, prompts: Prompts) -> GenerationStream:
        """The stream for ``generator``, from the batch handed out last on (made once)."""
        if self.stream is None or self.stream.generator is not generator:
            self._unread = deque([self.handed_out])
            self.stream = GenerationStream(self, generator, prompts)
        return self.stream

    def read(self) -> Batch | None:
        """The next batch in order that the stream has not read (None at the end)."""
        if self._unread:
            return self._unread.popleft()
        batch = next(self.batches, None)
        if batch is not None:
            self._read_early.append(batch)
        return batch

    @property
    def exhausted(self) -> bool:
        """Whether the stream has read every batch (seen before it looks past the last one:
        fairseq-interactive asks for no more hypotheses after a buffer's last batch)."""
        return not self._unread and not self.batches.has_next()

    def is_current(self, sample: Batch) -> bool:
        """Whether ``sample`` is the batch last handed out, or its copy on the GPU, or (from
        fairseq-interactive, which passes on only the source) its source tokens."""
        current = self.handed_out
        if current is None or "net_input" not in current:
            return False
        if sample is current:
            return True
        if "id" in sample:
            return torch.equal(sample["id"].cpu(), current["id"])
        tokens = sample.get("net_input", {}).get("src_tokens")
        return tokens is not None and torch.equal(tokens.cpu(), current["net_input"]["src_tokens"])


class GenerationStream:
    """Decodes the batches of a :class:`ReadAhead` as one stream for ``inference_step``."""

    def __init__(self, batches: ReadAhead, generator: SequenceGenerator, prompts: Prompts):
        self.batches = batches
        self.generator = generator
        self.prompts = prompts
        max_tokens = batches.max_tokens and batches.max_tokens * generator.beam_size
        self.engine = engine_for(generator, batches.max_sentences, max_tokens)
        self.pad = generator.pad
        self.device = next(generator.model.parameters()).device
        self.results: dict[int, Finished] = {}
        self.sentences = 0
        self._decoding = run(self.engine, IteratorSource(self.requests()))
        self._reported = False

    def requests(self) -> Iterator[Request]:
        """Every sentence of every batch, in the iterator's order, one request each."""
        while (batch := self.batches.read()) is not None:
            if "net_input" not in batch:
                continue
            src_tokens = batch["net_input"]["src_tokens"]
            prefixes, bos = self.prompts(batch)
            constraints = batch.get("constraints")  # fairseq-interactive --constraints: packed
            for row, sentence_id in enumerate(batch["id"].tolist()):
                tokens = to_device(utils.strip_pad(src_tokens[row], self.pad), self.device)
                prefix = None if prefixes is None else to_device(prefixes[row], self.device)
                own = None
                if constraints is not None:
                    own = [c.tolist() for c in unpack_constraints(constraints[row].cpu())]
                self.sentences += 1
                yield sentence_request(sentence_id, tokens, prefix, bos, own)

    def hypotheses(
        self, refuse: Callable[[int, str], None] | None = None
    ) -> list[list[Hypothesis]]:
        """The hypotheses of every sentence of the batch handed out last. A sentence that could
        not be decoded (its constraints not met within the maximum length): ``refuse(id,
        reason)`` and no hypotheses, or without ``refuse`` an error naming it (fairseq's
        generator fails its whole batch there)."""
        wanted = self.batches.handed_out["id"].tolist()
        with torch.inference_mode():
            while any(i not in self.results for i in wanted):
                finished = next(self._decoding)
                self.results[finished.key] = finished
        done = [self.results.pop(i) for i in wanted]
        for finished in done:
            if finished.error is None:
                continue
            if refuse is None:
                raise ValueError(f"sentence {finished.key}: {finished.error}") from finished.error
            refuse(finished.key, str(finished.error))
        self._report()
        return [finished.hypotheses if finished.error is None else [] for finished in done]

    def _report(self) -> None:
        if self._reported or not self.batches.exhausted or not self.engine.idle:
            return
        self._reported = True
        if self.sentences < 2:  # fairseq-interactive's default, a line at a time: no summary
            return
        batches = self.batches
        capacity = " and ".join(
            f"{limit} {unit}"
            for limit, unit in ((batches.max_sentences, "sentences"),
                                (batches.max_tokens, "source tokens"))
            if limit
        )
        logger.info(
            "continuous batching: %d sentences decoded as one stream, at most %s in flight; "
            "%d sentences joined others mid-search",
            self.sentences, capacity or "all", self.engine.refills,
        )
