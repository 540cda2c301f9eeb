"""``beamplugin-translate``'s command line: fairseq-interactive's options for the model and the
corpus's own, then the job (beamplugin.corpus.job) on this process's stream, or on a Ray
cluster with ``--ray``; the summary on stdout. Exit status: 0, or ``EXIT_LINES_REFUSED`` (3)
when some line was rejected (as fairseq-interactive in this project), 2 for unusable input (a
glossary included). ``--glossary FILE.tsv`` (with ``--constraints``): the server's glossaries,
the terms found in each line (each sentence of it with ``--split-sentences``) put in its
translation."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from fairseq import options
from fairseq.data.data_utils import infer_language_pair
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import DictConfig

from beamplugin.corpus.inputs import expand, survey
from beamplugin.corpus.job import Job, Runner
from beamplugin.corpus.local_runner import LocalRunner
from beamplugin.corpus.manifest import Manifest
from beamplugin.fairseq_plugin.interactive_input import EXIT_LINES_REFUSED
from beamplugin.serving.cli import add_decoding_options, interactive_parser
from beamplugin.serving.decoder_process import log_to_stderr
from beamplugin.serving.glossary import read_glossary

logger = logging.getLogger("beamplugin.corpus")

# Options that change how a job runs, never what it writes: a rerun may change them and still
# take up the blocks done before (any other option must be the same).
RUNNING_OPTIONS = {
    "inputs", "output", "block_lines", "ray", "workers", "cpus_per_worker", "no_progress_bar",
    "log_format", "log_interval", "log_file", "batch_size", "max_tokens", "buffer_size", "cpu",
    "num_workers",
}  # fmt: skip
# Ray's own switch, read when ray is imported: this machine's loopback address as its node
# address (as on macOS), so that a Ray started for one job listens on 127.0.0.1 only.
RAY_LOOPBACK = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def add_corpus_options(parser: argparse.ArgumentParser) -> None:
    corpus = parser.add_argument_group("Corpus")
    corpus.add_argument(
        "--input", dest="inputs", nargs="+", required=True, metavar="FILE",
        help="text files, one sentence a line (a document a line with --split-sentences), "
        "plain or gzip; a quoted glob matches several",
    )  # fmt: skip
    corpus.add_argument(
        "--split-sentences", action="store_true",
        help="each line is a document: cut into sentences as the server cuts a text, each "
        "translated alone, the line put back together with its own blanks",
    )  # fmt: skip
    corpus.add_argument(
        "--output", required=True, metavar="DIR",
        help="DIR/<input file name>.<target language>, beside the manifest and rejects",
    )  # fmt: skip
    corpus.add_argument(
        "--block-lines", type=int, default=1000, metavar="N",
        help="lines a block: what a worker is handed at once, written at once (default 1000)",
    )  # fmt: skip
    corpus.add_argument(
        "--glossary", metavar="FILE.tsv",
        help="with --constraints ordered|unordered: source<TAB>target a line; the target of "
        "each source term found in a line (in each sentence with --split-sentences) is put "
        "in its translation",
    )  # fmt: skip
    cluster = parser.add_argument_group("Ray cluster")
    cluster.add_argument(
        "--ray", nargs="?", const="", metavar="ADDRESS",
        help="translate on the Ray cluster at ADDRESS; alone: RAY_ADDRESS if set, else a Ray "
        "started on this machine for the job",
    )  # fmt: skip
    cluster.add_argument(
        "--workers", type=int, metavar="N",
        help="with --ray: workers (default: as many as the cluster's CPUs allow)",
    )  # fmt: skip
    cluster.add_argument(
        "--cpus-per-worker", type=int, default=1, metavar="N",
        help="with --ray: CPUs (torch threads) a worker takes (default 1)",
    )  # fmt: skip


def brief_help() -> str:
    """``--help``: the corpus options and the decoding options most used."""
    parser = argparse.ArgumentParser(
        prog="beamplugin-translate",
        usage="%(prog)s DATA-BIN --path CKPT.pt --input FILE... --output DIR [options]",
        description="Translate text files of any size, line for line, in blocks that are "
        "written once and resumed where a stopped job left off; on this machine, or on a Ray "
        "cluster with --ray.",
        epilog="Every option of fairseq-interactive applies: --help-all lists them.",
        add_help=False,
    )
    # a line each
    add_decoding_options(parser, leave_out=("--nbest", "--print-alignment"))
    add_corpus_options(parser)
    return parser.format_help()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, DictConfig]:
    """fairseq-interactive's options and the corpus's, as fairseq parses them."""
    parser, argv = interactive_parser(argv, brief_help)
    parser.conflict_handler = "resolve"  # our --input (files) replaces fairseq-interactive's
    add_corpus_options(parser)
    args = options.parse_args_and_arch(parser, argv)
    if args.block_lines < 1 or args.cpus_per_worker < 1 or (args.workers or 1) < 1:
        parser.error("--block-lines, --workers and --cpus-per-worker must be positive")
    if args.glossary and not args.constraints:
        parser.error("--glossary needs --constraints (ordered or unordered)")
    cfg = convert_namespace_to_omegaconf(args)
    if not (cfg.task.source_lang and cfg.task.target_lang):
        cfg.task.source_lang, cfg.task.target_lang = infer_language_pair(cfg.task.data)
    return args, cfg


def decoding_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options that change a translation, as the manifest records them (a glossary by its
    bytes: a rerun with the file changed is another job)."""
    options = {k: v for k, v in sorted(vars(args).items()) if k not in RUNNING_OPTIONS}
    if args.glossary:
        options["glossary"] = hashlib.sha256(Path(args.glossary).read_bytes()).hexdigest()
    return options


def make_runner(
    args: argparse.Namespace, cfg: DictConfig, glossary: list[tuple[str, str]] | None
) -> Runner:
    if args.ray is None:
        return LocalRunner(cfg, args.split_sentences, glossary)
    if not (args.ray or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault(*RAY_LOOPBACK)
    from beamplugin.corpus.ray_runner import RayRunner  # Ray is imported with --ray only

    return RayRunner(
        cfg, args.ray, args.workers, args.cpus_per_worker, args.split_sentences, glossary
    )


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    started = time.perf_counter()
    try:
        glossary = read_glossary(args.glossary) if args.glossary else None
        inputs = [survey(path, args.block_lines) for path in expand(args.inputs)]
        directory = Path(args.output)
        directory.mkdir(parents=True, exist_ok=True)
        manifest = Manifest(directory / "manifest.jsonl", decoding_options(args))
    except (OSError, ValueError) as error:  # no such input, a manifest of another job (OtherJob)
        logger.error("%s", error)
        return 2
    job = Job(inputs, directory, cfg.task.target_lang, manifest)
    logger.info(
        "%d input file(s), %d lines, %d blocks (%d done before), surveyed in %.1f s",
        len(inputs), job.summary.lines, job.summary.blocks, job.summary.blocks_before,
        time.perf_counter() - started,
    )  # fmt: skip
    job.summary.glossary = glossary is not None
    try:
        runner = make_runner(args, cfg, glossary)
    except ValueError as error:  # a glossary term the model cannot match or write
        logger.error("--glossary: %s", error)
        return 2
    try:
        bar = sys.stderr.isatty() and not args.no_progress_bar
        summary = job.run(runner, bar, driver_only=args.ray is not None)
    finally:
        runner.close()
    print("\n".join(summary.report()), flush=True)
    return EXIT_LINES_REFUSED if summary.rejected else 0


def cli_main() -> None:
    log_to_stderr()
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
