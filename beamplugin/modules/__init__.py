"""Layers the models are built from: ConvS2S's, the memory pool of sentences in flight, a
transformer decoder's self-attention history (kept outside beamplugin/models, which fairseq
auto-imports)."""

from beamplugin.modules.attention import (
    ConvAttention,
    EncoderMemory,
    attention_memory_pool,
    encoder_memory,
)
from beamplugin.modules.convolution import CausalConvolution, TBCConvolution
from beamplugin.modules.layer_spec import parse_attention_spec, parse_layer_spec
from beamplugin.modules.linear import Linear
from beamplugin.modules.memory_pool import MemoryPool, Pooled
from beamplugin.modules.positions import LearnedPositions
from beamplugin.modules.weight_norm import FoldedWeightNorm, WeightNormLinear

__all__ = [
    "CausalConvolution",
    "ConvAttention",
    "EncoderMemory",
    "FoldedWeightNorm",
    "LearnedPositions",
    "Linear",
    "MemoryPool",
    "Pooled",
    "TBCConvolution",
    "WeightNormLinear",
    "attention_memory_pool",
    "encoder_memory",
    "parse_attention_spec",
    "parse_layer_spec",
]
