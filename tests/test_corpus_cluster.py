"""beamplugin-translate --ray on a real Ray cluster on this machine (ray.cluster_utils.Cluster: a
head without CPUs and two worker nodes of one CPU each, small object stores, 127.0.0.1 only):
2,000 lines under a glossary give the bytes one process gives them, and the same terms counted;
without one, a driver killed mid-run and started again does
not translate finished blocks again; a worker node removed mid-run: every line once all the
same. Ray is installed by make test (the extra "cluster"): without it these tests fail."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from corpus_tools import BAD_LINES, block_rows, blocks_translated, outputs, run, translate_command
from corpus_tools import write_corpus as write_toy_corpus
from ray.cluster_utils import Cluster
from server_tools import shared_toy_model

from beamplugin.corpus.cli import RAY_LOOPBACK, main

pytestmark = pytest.mark.usefixtures("one_thread")

LINES = 2000
NODE = {"object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}
# A node whose processes are gone is declared dead within about 2 s, not Ray's 30.
HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                 "health_check_failure_threshold": 3}  # fmt: skip
RUN_SECONDS = 240  # a run that takes longer fails its test
# Source terms of two words, each in about 1.6% of the lines: few lines constrained (slower)
GLOSSARY = {"dort hund": "bird", "kleine mann": "cat"}


@pytest.fixture(scope="module")
def ray_cluster():
    """The cluster's head; the drivers (subprocesses) and this process take 127.0.0.1 as this
    node's address. Shut down whatever happens to the tests."""
    os.environ.setdefault(*RAY_LOOPBACK)
    cluster = Cluster(shutdown_at_exit=True)
    try:
        cluster.add_node(num_cpus=0, include_dashboard=False, _system_config=HEALTH_CHECKS,
                         **NODE)  # fmt: skip
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def cluster(ray_cluster):
    """The cluster with its two worker nodes, whatever an earlier test removed (a node is
    started only for a test that needs it, not after the last one)."""
    while len(ray_cluster.worker_nodes) < 2:
        ray_cluster.add_node(num_cpus=1, **NODE)
    return ray_cluster


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return shared_toy_model(tmp_path_factory)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    return write_toy_corpus(tmp_path_factory.mktemp("corpus"), LINES)


@pytest.fixture(scope="module")
def one_process(toy, corpus, tmp_path_factory) -> dict[str, bytes]:
    """What the job writes without Ray, in this process."""
    output = tmp_path_factory.mktemp("one-process")
    assert main(translate_command(toy, corpus, output, "--block-lines", "500")[1:]) == 3
    return outputs(output)


def test_two_thousand_lines_with_a_glossary_through_the_cluster_are_the_bytes_of_one_process(
    cluster, toy, corpus, tmp_path, capsys
):
    """The workers get the glossary the driver checked: each line's terms found and put in as
    in one process, the same bytes, the same terms counted in the summary and the manifest."""
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("".join(f"{s}\t{t}\n" for s, t in GLOSSARY.items()))
    terms = ("--constraints", "unordered", "--glossary", str(glossary))
    local = translate_command(toy, corpus, tmp_path / "local", "--block-lines", "500", *terms)
    assert main(local[1:]) == 3
    local_summary = capsys.readouterr().out
    command = translate_command(toy, corpus, tmp_path / "ray", "--block-lines", "100", *terms,
                                "--ray", cluster.address)  # fmt: skip
    done = run(command, RUN_SECONDS)
    assert done.returncode == 3, done.stderr[-3000:]  # lines rejected
    assert outputs(tmp_path / "ray") == outputs(tmp_path / "local")
    applied = terms_in(corpus)
    assert applied > 40
    summary = f"glossary: {applied} terms applied in the lines translated now"
    assert summary in done.stdout and summary in local_summary
    assert sum(row["terms_applied"] for row in block_rows(tmp_path / "ray")) == applied
    rejects = (tmp_path / "ray" / "a.de.en.rejects.tsv").read_text().splitlines()
    assert [row.split("\t")[:2] for row in rejects] == [["a.de", str(n)] for n in BAD_LINES]
    translated = (tmp_path / "ray" / "a.de.en").read_text().split("\n")
    assert sum(bool(line) for line in translated) == LINES // 2 - len(BAD_LINES)
    assert blocks_translated(done.stdout) == (20, 20, 0)
    workers = [line for line in done.stdout.splitlines() if line.startswith("worker ")]
    assert len(workers) == 2, done.stdout  # both took blocks, and say how fast they went
    assert "4 rejected" in done.stdout and "driver:" in done.stdout


def test_a_driver_killed_mid_run_and_started_again_translates_finished_blocks_once(
    cluster, toy, corpus, one_process, tmp_path
):
    command = translate_command(toy, corpus, tmp_path, "--block-lines", "50",
                                "--ray", cluster.address)  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(block_rows(tmp_path)) >= 4 or driver.poll() is not None)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    finished = len(block_rows(tmp_path))
    assert 4 <= finished < 40, "killed too late to test anything"
    done = run(command, RUN_SECONDS)
    assert done.returncode == 3, done.stderr[-3000:]
    assert blocks_translated(done.stdout) == (40, 40 - finished, finished)
    assert outputs(tmp_path) == one_process
    assert_each_block_once(tmp_path, 40)


def test_a_worker_node_removed_mid_run_the_job_completes_with_each_line_once(
    cluster, toy, corpus, one_process, tmp_path
):
    command = translate_command(toy, corpus, tmp_path, "--block-lines", "50",
                                "--ray", cluster.address)  # fmt: skip
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # once both workers have finished a block: each has two in hand from then on
        wait_for(lambda: len(workers(tmp_path)) == 2 or driver.poll() is not None)
        rows = block_rows(tmp_path)
        cluster.remove_node(next(iter(cluster.worker_nodes)))
        stdout, stderr = driver.communicate(timeout=RUN_SECONDS)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 3, stderr[-3000:]
    assert len(rows) < 40 and len({row["worker"] for row in rows}) == 2  # mid-run, both busy
    assert "a Ray worker died" in stderr, stderr[-3000:]
    assert blocks_translated(stdout) == (40, 40, 0)
    assert outputs(tmp_path) == one_process
    assert_each_block_once(tmp_path, 40)


def terms_in(corpus: list[Path]) -> int:
    """GLOSSARY's terms in the corpus's lines that are not rejected, each once a line (the BPE
    cuts each word alone: a term's words in a row in a line are its pieces in a row there)."""
    plain, compressed = corpus
    lines = [line for number, line in enumerate(plain.read_bytes().splitlines(), 1)
             if number not in BAD_LINES]  # fmt: skip
    lines += gzip.decompress(compressed.read_bytes()).splitlines()
    return sum(f" {term} ".encode() in b" " + line + b" " for line in lines for term in GLOSSARY)


def workers(directory: Path) -> set[str]:
    """The workers that finished a block so far."""
    return {row["worker"] for row in block_rows(directory)}


def assert_each_block_once(directory: Path, blocks: int) -> None:
    rows = [(row["input"], row["first_line"]) for row in block_rows(directory)]
    assert len(rows) == len(set(rows)) == blocks


def wait_for(condition, timeout: float = RUN_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
