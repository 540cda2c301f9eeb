"""fairseq-interactive's input lines: each one translated, or refused by id; none lost.

fairseq-interactive reads its input in buffers of ``--buffer-size`` lines, numbers the lines
from 0 across buffers (the ids of its ``S-/H-/D-`` lines) and asks the task for their tokens
once per buffer, in order. Each line goes through ``LineEncoder``; a refused line is printed
at once on stdout as

    E-<id>\\t<reason>

and keeps its place in the buffer as an empty tensor, which the dataset never batches (an
encoded line holds at least EOS), so every other line keeps its id. The other lines are
translated as usual. A line decoded but without a translation (its ``--constraints`` not met
within the maximum length, where fairseq's generator fails the whole run) gets its ``E-`` line
too (its ``S-`` line follows, without ``H-`` lines). When the input is done and some line was
refused, the process exits with ``EXIT_LINES_REFUSED`` (see ``InteractiveLines``).
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys

import numpy as np
import torch
from fairseq.data import BaseWrapperDataset

from beamplugin.fairseq_plugin.line_input import LineEncoder, RefusedLine

EXIT_LINES_REFUSED = 3


def read_stdin_leniently() -> None:
    """Hand undecodable bytes on stdin over as lone surrogates (``surrogateescape``, which
    LineEncoder refuses by line) instead of failing the whole read: Python decodes stdin
    strictly under UTF-8 locales other than C.UTF-8 unless in UTF-8 mode."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")


class WithoutEmptySources(BaseWrapperDataset):
    """Leaves out of every batch the entries without a single source token (refused lines)."""

    def ordered_indices(self) -> np.ndarray:
        indices = self.dataset.ordered_indices()
        return indices[self.num_tokens_vec(indices) > 0]

    def num_tokens_vec(self, indices: np.ndarray) -> np.ndarray:
        # BaseWrapperDataset does not pass this one on; our batching needs it.
        return self.dataset.num_tokens_vec(indices)


class InteractiveLines:
    """The lines of one fairseq-interactive run, numbered across its buffers.

    Exit status: fairseq-interactive returns normally whatever happened to its lines, so on
    the first refused line an exit hook is registered that, once all else is done, flushes
    stdout, stderr and logging, says on stderr how many lines were refused, and ends the
    process with ``EXIT_LINES_REFUSED`` (``os._exit``: an exit hook cannot change the status
    otherwise). That skips the exit hooks registered before it (torch's, multiprocessing's,
    fairseq's tensorboard writers), none of which has work in fairseq-interactive. A run that
    crashed keeps its own status.
    """

    def __init__(self) -> None:
        self.lines_read = 0
        self.buffer_start = 0  # the id of the current buffer's first line
        self.refused: list[int] = []

    def encode_buffer(
        self, lines: list[str], encoder: LineEncoder
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Tokens and lengths of the next buffer's lines, a refused line as an empty tensor."""
        tokens = []
        self.buffer_start = self.lines_read
        for line in lines:
            try:
                tokens.append(encoder.encode(line))
            except RefusedLine as refusal:
                self._refuse(self.lines_read, refusal.reason)
                tokens.append(torch.empty(0, dtype=torch.long))
            self.lines_read += 1
        return tokens, [len(t) for t in tokens]

    def refuse_decoded(self, buffer_id: int, reason: str) -> None:
        """The current buffer's line ``buffer_id`` was decoded without a translation."""
        self._refuse(self.buffer_start + buffer_id, reason)

    def _refuse(self, line_id: int, reason: str) -> None:
        print(f"E-{line_id}\t{reason}")
        if not self.refused:
            atexit.register(self._exit_with_status)
        self.refused.append(line_id)

    def _exit_with_status(self) -> None:
        if hasattr(sys, "last_value"):  # an uncaught exception: its traceback and status stand
            return
        ids = ", ".join(map(str, self.refused[:10])) + (", ..." if len(self.refused) > 10 else "")
        print(
            f"{len(self.refused)} of {self.lines_read} input lines were not translated "
            f"(ids {ids}; see their E- lines): exit status {EXIT_LINES_REFUSED}",
            file=sys.stderr,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_LINES_REFUSED)
