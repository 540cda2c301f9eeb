"""Blocks translated in this process, without Ray: one stream on all of torch's threads, given
``BLOCKS_AT_ONCE`` blocks at a time from threads of a pool."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from omegaconf import DictConfig

from beamplugin.corpus.block_translator import BLOCKS_AT_ONCE, BlockResult, BlockTranslator
from beamplugin.corpus.inputs import Block


class LocalRunner:
    """The models of ``cfg`` loaded in this process, translating blocks (``split_sentences``:
    each line a document cut into sentences; under ``glossary``'s terms, if any)."""

    def __init__(
        self, cfg: DictConfig, split_sentences: bool = False,
        glossary: list[tuple[str, str]] | None = None,
    ) -> None:  # fmt: skip
        self._translator = BlockTranslator(cfg, split_sentences, glossary)
        self.workers_alive = 1

    def run(self, blocks: Iterator[Block]) -> Iterator[tuple[Block, BlockResult]]:
        """Each block of ``blocks`` with its result, in the order they finish; blocks are taken
        from ``blocks`` as there is room for them."""
        with ThreadPoolExecutor(BLOCKS_AT_ONCE, thread_name_prefix="beamplugin-block") as pool:
            in_flight: dict[Future, Block] = {}

            def fill() -> None:
                while len(in_flight) < BLOCKS_AT_ONCE:
                    block = next(blocks, None)
                    if block is None:
                        return
                    in_flight[pool.submit(self._translator.translate, block.data)] = block

            fill()
            while in_flight:
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                finished = [(in_flight.pop(future), future.result()) for future in done]
                fill()  # before the caller writes: the stream keeps decoding meanwhile
                yield from finished

    def close(self) -> None:
        self._translator.close()
