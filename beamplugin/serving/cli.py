"""``beamplugin-serve``'s command line: fairseq-interactive's options and the server's, then the
server until SIGTERM or SIGINT (beamplugin.serving.app)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from omegaconf import DictConfig

import beamplugin
from beamplugin.serving.app import TranslationService, serve
from beamplugin.serving.decoder_process import log_to_stderr
from beamplugin.serving.guards import Guards, load_api_keys
from beamplugin.serving.translator import Translator

logger = logging.getLogger("beamplugin.serving.app")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, DictConfig]:
    """fairseq-interactive's options and the server's, as fairseq parses them."""
    parser = options.get_interactive_generation_parser(default_task="beam_translation")
    parser.set_defaults(user_dir=str(Path(beamplugin.__file__).parent))
    server = parser.add_argument_group("Server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8080, help="port (0: any free one)")
    server.add_argument(
        "--max-queued", type=int, default=256,
        help="sentences that may wait for room in the engine; beyond that requests get 503",
    )  # fmt: skip
    server.add_argument(
        "--max-request-sentences", type=int,
        help="sentences in one request (default: 64, or --max-queued if smaller)",
    )  # fmt: skip
    server.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413"
    )
    server.add_argument(
        "--shutdown-timeout", type=float, default=600.0,
        help="seconds a stopping server waits for accepted requests before it gives up on them",
    )  # fmt: skip
    server.add_argument(
        "--request-timeout", type=float, metavar="SECONDS",
        help="a translation not answered by then gets 504 and its sentences are cancelled",
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
    args = options.parse_args_and_arch(parser, argv)
    if args.max_request_sentences is None:
        args.max_request_sentences = min(64, args.max_queued)
    if not 1 <= args.max_request_sentences <= args.max_queued:
        parser.error("--max-request-sentences must be between 1 and --max-queued")
    for name in ("req_limit", "char_limit", "request_timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
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
    translator = Translator(cfg, args.max_queued, in_process=False)
    units = ("sentences", "source tokens")
    limits = [f"{n} {unit}" for n, unit in zip(translator.capacity, units, strict=True) if n]
    logger.info(
        "beam %d, at most %s in flight, %d more may wait",
        translator.beam, " and ".join(limits), args.max_queued,
    )  # fmt: skip
    service = TranslationService(
        translator, args.max_request_sentences, guards, args.request_timeout
    )
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
