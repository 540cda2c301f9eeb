"""Whether a fairseq model's log-probs are plainly torch's log-softmax of its decoder's logits, as
fairseq's defaults compute them: then the engine may normalise our decoders' logits itself, in
place (beamplugin.engine.ensemble.search_log_probs)."""

from __future__ import annotations

from fairseq.models import BaseFairseqModel, FairseqDecoder
from fairseq.models.transformer import TransformerModelBase
from torch import nn

# the model classes' own methods that come down to the decoder's, unchanged
_MODEL_METHODS = (BaseFairseqModel.get_normalized_probs, TransformerModelBase.get_normalized_probs)


def plain_softmax(model: nn.Module) -> bool:
    """Whether ``model`` normalizes its logits as fairseq's models do by default: a
    (log-)softmax in float32, no adaptive softmax, no method of its own on the way, no ONNX
    tracing."""
    model_class, decoder = type(model), model.decoder
    return (
        model_class.get_normalized_probs in _MODEL_METHODS
        and model_class.get_normalized_probs_scriptable
        is BaseFairseqModel.get_normalized_probs_scriptable
        and type(decoder).get_normalized_probs is FairseqDecoder.get_normalized_probs
        and type(decoder).get_normalized_probs_scriptable
        is FairseqDecoder.get_normalized_probs_scriptable
        and getattr(decoder, "adaptive_softmax", None) is None
        and not getattr(decoder, "onnx_trace", False)
    )
