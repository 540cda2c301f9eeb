"""Blocks translated on a Ray cluster: one actor per worker (the models loaded once, our stream
inside), ``BLOCKS_AT_ONCE`` blocks handed to each as it frees up, the block's bytes going through
Ray's object store and its translations coming back the same way to the driver, which alone
writes them.

A worker that dies (its process, or its node) fails the blocks it held: they go back in front of
the queue for the workers alive, and a new worker is asked for in its place (Ray starts it where
resources free up; it gets blocks once it has loaded its models). Nothing of a dead worker's
blocks was written, so each block is written once. A block that was on ``MAX_ATTEMPTS`` workers
that died stops the job, as does a worker whose models fail to load.

The only module that imports Ray: nothing of it is loaded without ``--ray``.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Iterator

import ray
import torch
from fairseq import utils
from omegaconf import DictConfig
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from beamplugin.corpus.block_translator import BLOCKS_AT_ONCE, BlockResult, BlockTranslator
from beamplugin.corpus.inputs import Block

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
# How long the driver waits without a single worker able to take blocks (none placed yet, all
# dead and none placed since) before it gives up.
NO_WORKER_TIMEOUT = 600.0
POLL_SECONDS = 5.0


class _Worker:
    """A Ray actor: the models of ``cfg`` on ``threads`` torch threads (``split_sentences``:
    each line a document cut into sentences), under ``glossary``'s terms if any."""

    def __init__(
        self, cfg: DictConfig, threads: int, split_sentences: bool,
        glossary: list[tuple[str, str]] | None,
    ) -> None:  # fmt: skip
        torch.set_num_threads(threads)
        utils.import_user_module(cfg.common)  # the models and tasks of another --user-dir
        self.translator = BlockTranslator(cfg, split_sentences, glossary)

    def ready(self) -> str:
        return self.translator.name

    def translate(self, data: bytes) -> BlockResult:
        return self.translator.translate(data)


class RayRunner:
    """Workers on the Ray cluster at ``address`` ("": ``RAY_ADDRESS`` if set, else a Ray started
    on this machine for the job and stopped with it): ``workers`` of them (None: as many as the
    cluster's CPUs allow), ``cpus`` CPUs (torch threads) each; ``split_sentences``: each line a
    document cut into sentences; under ``glossary``'s terms if any."""

    def __init__(
        self, cfg: DictConfig, address: str, workers: int | None, cpus: int,
        split_sentences: bool = False, glossary: list[tuple[str, str]] | None = None,
    ) -> None:  # fmt: skip
        address = address or os.environ.get("RAY_ADDRESS", "")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        cluster_cpus = int(ray.cluster_resources().get("CPU", 0))
        self.workers = workers or cluster_cpus // cpus
        if self.workers < 1:
            raise ValueError(f"the Ray cluster has {cluster_cpus} CPUs, a worker needs {cpus}")
        logger.info("Ray cluster with %d CPUs: %d workers of %d CPU(s)",
                    cluster_cpus, self.workers, cpus)  # fmt: skip
        self._actor_class = ray.remote(_Worker).options(
            num_cpus=cpus, max_concurrency=BLOCKS_AT_ONCE
        )
        self._cfg, self._cpus = cfg, cpus
        self._split, self._glossary = split_sentences, glossary
        self._starting: dict[ray.ObjectRef, ActorHandle] = {}
        self._free: collections.Counter[ActorHandle] = collections.Counter()  # ready ones
        for _ in range(self.workers):
            self._start_worker()

    @property
    def workers_alive(self) -> int:
        return len(self._free)

    def _start_worker(self) -> None:
        actor = self._actor_class.remote(self._cfg, self._cpus, self._split, self._glossary)
        self._starting[actor.ready.remote()] = actor

    def run(self, blocks: Iterator[Block]) -> Iterator[tuple[Block, BlockResult]]:
        """Each block of ``blocks`` with its result, in the order they finish; blocks are taken
        from ``blocks`` as workers free up."""
        in_flight: dict[ray.ObjectRef, tuple[Block, ActorHandle]] = {}
        again: collections.deque[Block] = collections.deque()  # of workers that died
        attempts: collections.Counter[tuple[str, int]] = collections.Counter()
        last_worker, exhausted = time.monotonic(), False
        while True:
            exhausted = self._hand_out(blocks, again, in_flight) or exhausted
            if exhausted and not in_flight and not again:
                return
            if self._free:
                last_worker = time.monotonic()
            elif time.monotonic() - last_worker > NO_WORKER_TIMEOUT:
                raise RuntimeError(f"no Ray worker could take blocks for {NO_WORKER_TIMEOUT} s")
            yield from self._collect(in_flight, again, attempts)

    def _collect(
        self,
        in_flight: dict[ray.ObjectRef, tuple[Block, ActorHandle]],
        again: collections.deque[Block],
        attempts: collections.Counter[tuple[str, int]],
    ) -> list[tuple[Block, BlockResult]]:
        """What came back within POLL_SECONDS: workers ready, blocks translated (their worker
        free again), blocks of workers that died (back in ``again``)."""
        finished = []
        done, _ = ray.wait([*in_flight, *self._starting], num_returns=1, timeout=POLL_SECONDS)
        for ref in done:
            if ref in self._starting:
                self._started(ref)
                continue
            block, actor = in_flight.pop(ref)
            try:
                finished.append((block, ray.get(ref)))
            except RayActorError as error:
                self._lost(actor, error)
                self._again(block, attempts, again)
                continue
            if actor in self._free:  # not declared dead by another of its blocks
                self._free[actor] += 1
        return finished

    def _hand_out(
        self,
        blocks: Iterator[Block],
        again: collections.deque[Block],
        in_flight: dict[ray.ObjectRef, tuple[Block, ActorHandle]],
    ) -> bool:
        """A block to every free place of a worker, those of dead workers first; whether
        ``blocks`` has none left."""
        for actor in list(self._free):
            while self._free[actor] > 0:
                block = again.popleft() if again else next(blocks, None)
                if block is None:
                    return True
                self._free[actor] -= 1
                in_flight[actor.translate.remote(block.data)] = (block, actor)
        return False

    def _started(self, ref: ray.ObjectRef) -> None:
        """A worker's first answer: it is ready, or it died while starting."""
        actor = self._starting.pop(ref)
        try:
            name = ray.get(ref)
        except RayActorError as error:
            if error.actor_init_failed:  # its models do not load: neither will the others'
                raise RuntimeError(f"a Ray worker failed to start: {error}") from error
            logger.warning("a Ray worker died while starting (%s); starting another", error)
            self._start_worker()
            return
        logger.info("worker %s ready", name)
        self._free[actor] = BLOCKS_AT_ONCE

    def _lost(self, actor: ActorHandle, error: RayActorError) -> None:
        """``actor`` died: another is asked for in its place (once, whatever it held)."""
        if actor in self._free:
            del self._free[actor]
            logger.warning("a Ray worker died (%s); starting another", error)
            self._start_worker()

    @staticmethod
    def _again(
        block: Block, attempts: collections.Counter, again: collections.deque[Block]
    ) -> None:
        key = (block.input, block.first_line)
        attempts[key] += 1
        if attempts[key] >= MAX_ATTEMPTS:
            raise RuntimeError(
                f"{block.input}, lines {block.first_line}-{block.first_line + block.lines - 1}: "
                f"{MAX_ATTEMPTS} workers died translating it; giving up"
            )
        again.append(block)

    def close(self) -> None:
        """Stop the workers (and a Ray this job started)."""
        ray.shutdown()
