"""A fairseq transformer decoder's weights made ready for one decoder step at a time, kept while
the weights are unchanged.

Per layer, the self-attention's query, key and value projections are one product (their weights
stacked), and the query projections carry fairseq's scaling (``head_dim ** -0.5``) folded in;
every product is a :class:`~beamplugin.modules.linear.PreparedLinear` (oneDNN's packing, or
int8 values under ``--int8``). Scores differ from fairseq's only in float rounding.

The prepared weights are checked, not on every step, but when :meth:`DecoderWeights.current` is
called (once per encoder forward: every sentence is encoded before it decodes). They are made
again when a parameter's version, storage or dtype changed (a state dict load, a cast, a move),
when int8 products are switched, and after any forward of fairseq's own decoder: training runs
one, and fairseq's optimizers write through ``p.data``, which bumps no version.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from beamplugin.modules.linear import PreparedLinear, prepare_linear


class LayerWeights(NamedTuple):
    self_qkv: PreparedLinear  # scaled query, key, value, stacked: [3 x embed, embed]
    self_out: PreparedLinear
    cross_query: PreparedLinear  # scaled
    cross_out: PreparedLinear
    fc1: PreparedLinear
    fc2: PreparedLinear


class DecoderWeights:
    """The prepared weights of ``decoder`` (a fairseq ``TransformerDecoderBase``)."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self._key: tuple[Any, ...] | None = None
        self.layers: list[LayerWeights] = []
        self.output: PreparedLinear | None = None
        own = weakref.ref(self)

        def forget(*_: Any) -> None:
            weights = own()
            if weights is not None:
                weights._key = None

        handle = decoder.register_forward_pre_hook(forget)
        weakref.finalize(self, handle.remove)

    def current(self) -> DecoderWeights:
        """These weights, made again first if the decoder's changed."""
        decoder = self.decoder
        int8 = bool(getattr(decoder, "int8_products", False))
        key = (int8, *((p._version, p.data_ptr(), p.dtype) for p in decoder.parameters()))
        if key != self._key:
            with torch.no_grad():
                self.layers = [_prepare_layer(layer, int8) for layer in decoder.layers]
                projection = decoder.output_projection
                self.output = prepare_linear(projection.weight, projection.bias, int8)
            self._key = key
        return self


def _prepare_layer(layer: nn.Module, int8: bool) -> LayerWeights:
    own, cross = layer.self_attn, layer.encoder_attn

    def of(module: nn.Linear) -> PreparedLinear:
        return prepare_linear(module.weight, module.bias, int8)

    def scaled(module: nn.Linear, scaling: float) -> tuple[Tensor, Tensor | None]:
        bias = None if module.bias is None else module.bias * scaling
        return module.weight * scaling, bias

    query = scaled(own.q_proj, own.scaling)
    parts = [query, (own.k_proj.weight, own.k_proj.bias), (own.v_proj.weight, own.v_proj.bias)]
    stacked_bias = None
    if any(b is not None for _, b in parts):
        stacked_bias = torch.cat([b if b is not None else w.new_zeros(w.size(0)) for w, b in parts])
    return LayerWeights(
        self_qkv=prepare_linear(torch.cat([w for w, _ in parts]), stacked_bias, int8),
        self_out=of(own.out_proj),
        cross_query=prepare_linear(*scaled(cross.q_proj, cross.scaling), int8),
        cross_out=of(cross.out_proj),
        fc1=of(layer.fc1),
        fc2=of(layer.fc2),
    )
