"""Which engine decodes: the device engine (beamplugin.engine.device_engine: fixed rows, the
whole step on the device, CUDA graphs) where the options ask for it and it serves the model and
options, else the engine of beamplugin.engine.engine."""

from __future__ import annotations

import logging

from beamplugin.engine.device_engine import DeviceEngine, why_not
from beamplugin.engine.engine import Decoder, DecodingEngine
from beamplugin.engine.ensemble import EnsembleDecoder
from beamplugin.search.options import DecodingOptions

logger = logging.getLogger(__name__)


def open_engine(
    model: EnsembleDecoder,
    options: DecodingOptions,
    max_sentences: int | None = None,
    max_tokens: int | None = None,
    bos_token: int | None = None,
) -> DecodingEngine | DeviceEngine:
    """An engine for ``model`` with ``options``: ``options.device_engine`` "on" takes the
    device engine wherever it serves them, "auto" on a GPU only, "off" never."""
    wanted = options.device_engine
    if wanted == "auto":
        parameter = next(model.parameters(), None)
        wanted = "on" if parameter is not None and parameter.is_cuda else "off"
    if wanted == "on":
        reason = why_not(model, options)
        if reason is None:
            return DeviceEngine(
                model, options, max_sentences, max_tokens, bos_token, options.cuda_graphs
            )
        if options.device_engine == "on":
            logger.info("the device engine does not decode %s: the other engine does", reason)
    return DecodingEngine(model, options, max_sentences, max_tokens, bos_token)


def engine_for(
    decoder: Decoder,
    max_sentences: int | None = None,
    max_tokens: int | None = None,
    bos_token: int | None = None,
) -> DecodingEngine | DeviceEngine:
    """An engine decoding with ``decoder``'s model and options (see :func:`open_engine`)."""
    return open_engine(decoder.model, decoder.options, max_sentences, max_tokens, bos_token)
