"""How far a job is, as it runs: lines done, lines a second, the time left and the workers
alive, on a tqdm bar when stderr is a terminal, else as a log line every ``LOG_SECONDS``."""

from __future__ import annotations

import datetime
import logging
import sys
import time

from tqdm import tqdm

logger = logging.getLogger(__name__)

LOG_SECONDS = 10.0


class Progress:
    """Of a job of ``total`` lines, ``done`` of them before this run (the rate and time left
    count this run's lines only); ``bar``: a tqdm bar, else log lines."""

    def __init__(self, total: int, done: int, bar: bool) -> None:
        self.total, self.done, self.translated = total, done, 0
        self._started = self._logged = time.perf_counter()
        self._bar = None
        if bar:
            self._bar = tqdm(total=total, initial=done, unit=" lines", dynamic_ncols=True,
                             file=sys.stderr, smoothing=0.05)  # fmt: skip

    def advance(self, lines: int, workers: int) -> None:
        """``lines`` more translated; ``workers`` alive."""
        self.done += lines
        self.translated += lines
        if self._bar is not None:
            self._bar.set_postfix(workers=workers, refresh=False)
            self._bar.update(lines)
            return
        now = time.perf_counter()
        if now - self._logged >= LOG_SECONDS or self.done == self.total:
            self._logged = now
            rate = self.translated / max(now - self._started, 1e-9)
            left = (self.total - self.done) / rate if rate else 0.0
            logger.info(
                "%d of %d lines (%.0f%%), %.1f lines/s, %s left, %d workers",
                self.done, self.total, 100 * self.done / max(self.total, 1), rate,
                datetime.timedelta(seconds=round(left)), workers,
            )  # fmt: skip

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
