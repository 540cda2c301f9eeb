"""``beamplugin-serve``'s command line: fairseq-interactive's options and the server's, then the
server until SIGTERM or SIGINT (beamplugin.serving.app)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import DictConfig

import beamplugin
from beamplugin.serving.app import TranslationService, serve
from beamplugin.serving.decoder_process import log_to_stderr
from beamplugin.serving.glossary import read_glossary
from beamplugin.serving.guards import Guards, load_api_keys
from beamplugin.serving.translator import Translator

logger = logging.getLogger("beamplugin.serving.app")


# fairseq-interactive's options a newcomer needs first (``--help``); all of them: --help-all.
DECODING_OPTIONS = [
    (("data",), "DATA-BIN", "the data directory the model was trained with (its dictionaries)"),
    (("--path",), "CKPT.pt", "the checkpoint; A.pt:B.pt decodes with an ensemble"),
    (("-s", "--source-lang"), "SRC", "source language (as in the data directory)"),
    (("-t", "--target-lang"), "TGT", "target language (with -s: the default pair)"),
    (("--task",), "NAME", "beam_translation (default), or beam_translation_multi for a "
     "multilingual model (M2M-100, NLLB: with its --lang-pairs, --encoder-langtok src, "
     "--decoder-langtok, --fixed-dictionary), every pair of which is served"),
    (("--bpe",), "NAME", "the BPE of the model's text, e.g. sentencepiece"),
    (("--sentencepiece-model",), "SPM.model", "with --bpe sentencepiece: its model"),
    (("--tokenizer",), "NAME", "a tokenizer before the BPE (moses, ...)"),
    (("--beam",), "N", "beam size (default 5)"),
    (("--nbest",), "N", "translations a request gets by default (default 1, at most --beam)"),
    (("--lenpen",), "X", "length penalty (default 1)"),
    (("--max-len-a",), "A", "at most A x source length + B output tokens (default 0 and 200)"),
    (("--max-len-b",), "B", None),
    (("--batch-size",), "N", "sentences decoded together at most (default 64)"),
    (("--max-tokens",), "N", "source tokens decoded together at most"),
    (("--cpu",), None, "decode on the CPU even when CUDA is there"),
    (("--bf16",), None, "decode in bfloat16 (also --fp16, --int8)"),
    (("--print-alignment",), None, "serve alignments (/v1/translate's 'alignment')"),
    (("--constraints",), "ordered|unordered", "apply glossaries: their target terms in the "
     "order their source terms are found (ordered) or in any order (unordered)"),
]


def brief_help() -> str:
    """``--help``: the server's options and the decoding options most used."""
    parser = argparse.ArgumentParser(
        prog="beamplugin-serve",
        usage="%(prog)s DATA-BIN --path CKPT.pt [options]",
        description="A translation server for fairseq models with a fast batched beam search: "
        "LibreTranslate's POST /translate, POST /v1/translate (n-best lists), a page at /, "
        "its API at /docs.",
        epilog="Every option of fairseq-interactive applies: --help-all lists them.",
        add_help=False,
    )
    add_decoding_options(parser)
    add_server_options(parser)
    parser.add_argument_group("Help").add_argument(
        "-h", "--help", action="store_true", help="this; --help-all: every option"
    )
    return parser.format_help()


def add_decoding_options(
    parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()
) -> None:
    """The decoding options most used (:data:`DECODING_OPTIONS`) as a brief help shows them, but
    those whose first flag is in ``leave_out``."""
    decoding = parser.add_argument_group("Decoding (fairseq-interactive's options)")
    for flags, metavar, text in DECODING_OPTIONS:
        if flags[0] in leave_out:
            continue
        if metavar is None:
            decoding.add_argument(*flags, action="store_true", help=text)
        else:
            decoding.add_argument(*flags, metavar=metavar, help=text or argparse.SUPPRESS)


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The server's own options, in two groups of ``parser``."""
    server = parser.add_argument_group("Server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    server.add_argument(
        "--max-queued", type=int, default=256, metavar="N",
        help="sentences that may wait for room in the engine; beyond that requests get 503",
    )  # fmt: skip
    server.add_argument(
        "--max-request-sentences", type=int, metavar="N",
        help="sentences in one request, a document (a text to split, a file) counting as one "
        "(default: 64, or --max-queued if smaller)",
    )  # fmt: skip
    server.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, metavar="BYTES",
        help="larger request bodies get 413",
    )  # fmt: skip
    server.add_argument(
        "--shutdown-timeout", type=float, default=600.0, metavar="SECONDS",
        help="seconds a stopping server waits for accepted requests before it gives up on them",
    )  # fmt: skip
    server.add_argument(
        "--request-timeout", type=float, metavar="SECONDS",
        help="a translation not answered by then gets 504 and its sentences are cancelled",
    )  # fmt: skip
    server.add_argument(
        "--glossary-max-terms", type=int, default=32, metavar="N",
        help="terms a request's glossary may have, else 400 (glossaries need --constraints)",
    )  # fmt: skip
    server.add_argument(
        "--glossary", action="append", default=[], metavar="FILE.tsv",
        help="a glossary requests may name (by the file's name without .tsv): "
        "source<TAB>target a line; repeatable",
    )  # fmt: skip
    guards = parser.add_argument_group("Server guards")
    guards.add_argument(
        "--api-keys", metavar="FILE",
        help="translate only for these keys: KEY or KEY<TAB>REQUESTS_PER_MINUTE a line; given "
        "as 'api_key' in the body or 'Authorization: Bearer KEY', else 403",
    )  # fmt: skip
    guards.add_argument(
        "--metrics-open", action="store_true", help="/metrics without a key when keys are on"
    )
    guards.add_argument(
        "--req-limit", type=int, metavar="N",
        help="translation requests a minute per key (per client address without keys), else "
        "429 with Retry-After",
    )  # fmt: skip
    guards.add_argument(
        "--char-limit", type=int, metavar="N", help="characters a request, else 400"
    )


def interactive_parser(
    argv: list[str] | None, brief: Callable[[], str]
) -> tuple[argparse.ArgumentParser, list[str] | None]:
    """fairseq-interactive's parser with this plugin's task and user dir, for a command of ours
    that takes its options, and the arguments to parse: ``--help`` prints ``brief()`` and exits,
    ``--help-all`` becomes fairseq's ``--help`` (its full list, the command's options with it)."""
    given = sys.argv[1:] if argv is None else argv
    if "-h" in given or "--help" in given:
        print(brief())
        sys.exit(0)
    if "--help-all" in given:
        argv = ["--help" if a == "--help-all" else a for a in given]
    parser = options.get_interactive_generation_parser(default_task="beam_translation")
    parser.set_defaults(user_dir=str(Path(beamplugin.__file__).parent))
    return parser, argv


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, DictConfig]:
    """fairseq-interactive's options and the server's, as fairseq parses them. ``--help``
    prints the brief help and exits; ``--help-all`` fairseq's full list and the server's."""
    parser, argv = interactive_parser(argv, brief_help)
    add_server_options(parser)
    args = options.parse_args_and_arch(parser, argv)
    if args.max_request_sentences is None:
        args.max_request_sentences = min(64, args.max_queued)
    if not 1 <= args.max_request_sentences <= args.max_queued:
        parser.error("--max-request-sentences must be between 1 and --max-queued")
    for name in ("req_limit", "char_limit", "request_timeout", "glossary_max_terms"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.glossary and not args.constraints:
        parser.error("--glossary needs --constraints (ordered or unordered)")
    names = [Path(path).stem for path in args.glossary]
    if len(set(names)) < len(names):
        parser.error("two --glossary files of the same name")
    return args, convert_namespace_to_omegaconf(args)


def guards_of(args: argparse.Namespace) -> Guards:
    """The guards the options ask for (the keys file read now: a bad one stops the start)."""
    keys = load_api_keys(args.api_keys) if args.api_keys else None
    return Guards(keys, args.req_limit, args.char_limit, args.metrics_open)


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    try:
        guards = guards_of(args)
    except (OSError, ValueError) as error:
        logger.error("--api-keys: %s", error)
        return 2
    if guards.keys:  # how many, never which
        logger.info("%d API keys; /metrics %s", len(guards.keys),
                    "open" if guards.metrics_open else "needs one")  # fmt: skip
    try:  # before the models load, so that a bad file stops the start at once
        read = {Path(path).stem: read_glossary(path) for path in args.glossary}
    except (OSError, ValueError) as error:
        logger.error("--glossary: %s", error)
        return 2
    translator = Translator(cfg, args.max_queued, in_process=False)
    glossaries = {}
    for name, terms in read.items():
        try:  # the terms as the model reads them: a target term it cannot write stops the start
            glossaries[name] = translator.glossary(terms)
        except ValueError as error:
            translator.close()
            logger.error("--glossary %s: %s", name, error)
            return 2
        logger.info("glossary %s: %d terms", name, len(terms))
    units = ("sentences", "source tokens")
    limits = [f"{n} {unit}" for n, unit in zip(translator.capacity, units, strict=True) if n]
    logger.info(
        "beam %d, at most %s in flight, %d more may wait",
        translator.beam, " and ".join(limits), args.max_queued,
    )  # fmt: skip
    service = TranslationService(
        translator, args.max_request_sentences, guards, args.request_timeout,
        args.glossary_max_terms, glossaries,
    )  # fmt: skip
    asyncio.run(
        serve(service, args.host, args.port, args.max_body_bytes, args.shutdown_timeout)
    )
    translator.close()
    logger.info("stopped: %d sentences translated", translator.stream.completed)
    if translator.stream.failure is not None:  # a supervisor sees that it did not end well
        logger.error("the decoder had failed: %r", translator.stream.failure)
        return 1
    return 0


def cli_main() -> None:
    log_to_stderr()
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
