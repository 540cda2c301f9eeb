"""A fairseq transformer's weights made ready for decoding, kept while the weights are unchanged.

Per layer, the self-attention's query, key and value projections are one product (their weights
stacked), and every query projection carries fairseq's scaling (``head_dim ** -0.5``) folded in; the
keys and values that every decoder layer's cross-attention reads from the encoder output are one
product too. Every product is a :class:`~beamplugin.modules.prepared_linear.PreparedLinear` (packed
for our kernel or oneDNN's; int8 values under ``--int8``, the encoder layers' too, as CTranslate2's
int8, not the cross-attention's keys and values). Scores differ from fairseq's only in float
rounding.

The prepared weights are checked, not on every step, but when :meth:`TransformerWeights.current`
is called (once per encoder forward: every sentence is encoded before it decodes). They are made
again when a parameter's version, storage or dtype changed (a state dict load, a cast, a move),
when a parameter was registered anywhere (a module's parameter replaced, as ``load_state_dict(...,
assign=True)`` does), when int8 products are switched, and after any forward of fairseq's own
encoder or decoder: training runs them, and fairseq's optimizers write through ``p.data``, which
bumps no version. The parameters are listed once per registration, not per check: walking the
model's modules cost ~0.15 ms a sentence at batch 1.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from fairseq.modules import LearnedPositionalEmbedding
from torch import Tensor, nn

from beamplugin.kernels import float_attention, transformer_layers
from beamplugin.modules.prepared_linear import PreparedLinear, columns_of, prepare_linear
from beamplugin.runtime import heap
from beamplugin.runtime.pages import FileMappings, page_out


class _Registrations:
    """How many parameters any module has registered in this process (torch's global hook)."""

    count = 0

    @classmethod
    def seen(cls, *_: Any) -> None:
        cls.count += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_Registrations.seen)


class LayerWeights(NamedTuple):
    self_qkv: PreparedLinear  # scaled query, key, value, stacked: [3 x embed, embed]
    self_out: PreparedLinear
    fc1: PreparedLinear
    fc2: PreparedLinear
    cross_query: PreparedLinear | None = None  # scaled (decoder layers)
    cross_out: PreparedLinear | None = None


_version, _dtype = operator.attrgetter("_version"), operator.attrgetter("dtype")


class TransformerWeights:
    """The prepared weights of ``model`` (a fairseq ``TransformerModelBase``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._key: tuple[Any, ...] | None = None
        self._parameters: tuple[list[nn.Parameter], int] = ([], -1)  # and the registrations
        self.encoder_layers: list[LayerWeights] = []
        self.decoder_layers: list[LayerWeights] = []
        self.memory: PreparedLinear | None = None  # every decoder layer's cross keys, values
        self.output: PreparedLinear | None = None
        # the output projection of a shortlist's columns: (columns, product, its kernel form)
        self._columns: tuple[Tensor, PreparedLinear, Any] | None = None
        # the decoder's step and the encoder's layers as one call of our kernels, where they can
        self.decoder_in_kernel: transformer_layers.DecoderStep | None = None
        self.encoder_in_kernel: transformer_layers.EncoderLayers | None = None
        own = weakref.ref(self)

        def forget(*_: Any) -> None:
            weights = own()
            if weights is not None:
                weights._key = None

        for part in (model.encoder, model.decoder):
            handle = part.register_forward_pre_hook(forget)
            weakref.finalize(self, handle.remove)

    def current(self) -> TransformerWeights:
        """These weights, made again first if the model's changed."""
        model = self.model
        int8 = bool(getattr(model.decoder, "int8_products", False))
        bf16 = bool(getattr(model.decoder, "bf16_products", False))
        parameters, registrations = self._parameters
        if registrations != _Registrations.count:
            parameters = list(model.parameters())
            self._parameters = parameters, _Registrations.count
        # C-level maps: this runs at every encoder forward (0.1 ms as a generator of tuples)
        key = (
            int8,
            bf16,
            tuple(map(_version, parameters)),
            tuple(map(torch.Tensor.data_ptr, parameters)),
            tuple(map(_dtype, parameters)),
        )
        if key != self._key:
            with torch.no_grad():
                self._prepare(int8, bf16)
            self._key = key
        return self

    def _prepare(self, int8: bool, bf16: bool) -> None:
        encoder, decoder = self.model.encoder, self.model.decoder
        # each weight's pages go back to its mapped checkpoint as soon as its panels are made;
        # the largest first (a 256k vocabulary's projection), while few panels are held
        release = _Release(FileMappings())
        projection = decoder.output_projection
        # with shared embeddings, looking a token up reads its page back
        output = prepare_linear(
            projection.weight, projection.bias, int8, read=release.rows, bf16=bf16
        )
        self.output = release.of(output, [projection])
        self._columns = None

        def prepared(layer: nn.Module) -> LayerWeights:
            weights = release(_prepare_layer(layer, int8, bf16), layer)
            heap.give_back_free_memory()  # the copies and blocks the layouts were made through
            return weights

        cross = [layer.encoder_attn for layer in decoder.layers]
        # the cross-attention's keys and values stay float32: int8 there cost best hypotheses
        # (docs/precision.md); stacked before the layers, while few panels are held
        kv = [p for a in cross for p in (a.k_proj, a.v_proj)]
        self.memory = release.of(_stacked(kv, False, bf16=bf16), kv)
        self.encoder_layers = [prepared(layer) for layer in encoder.layers]
        self.decoder_layers = [prepared(layer) for layer in decoder.layers]
        self.decoder_in_kernel = _in_kernel(decoder, self.decoder_layers, self.output)
        self.encoder_in_kernel = _encoder_in_kernel(encoder, self.encoder_layers)
        heap.give_back_free_memory()

    def output_columns(
        self, columns: Tensor
    ) -> tuple[PreparedLinear, transformer_layers.Product | None]:
        """The output projection of token ``columns`` alone (:func:`columns_of`: the bits of the
        whole projection), and its form for the step in one call (None where that call does
        not run); made again only when ``columns`` is another tensor."""
        kept = self._columns
        if kept is None or kept[0] is not columns:
            self._columns = kept = None  # the last columns' panels go before the next are made
            weight = self.model.decoder.output_projection.weight
            product = columns_of(self.output, weight, columns)
            in_kernel = _kernel_product(product) if self.decoder_in_kernel is not None else None
            kept = self._columns = (columns, product, in_kernel)
        return kept[1], kept[2]


def _prepare_layer(layer: nn.Module, int8: bool, bf16: bool) -> LayerWeights:
    own = layer.self_attn

    def of(module: nn.Linear) -> PreparedLinear:
        return prepare_linear(module.weight, module.bias, int8, bf16=bf16)

    weights = LayerWeights(
        self_qkv=_stacked([own.q_proj, own.k_proj, own.v_proj], int8, own.scaling, bf16),
        self_out=of(own.out_proj),
        fc1=of(layer.fc1),
        fc2=of(layer.fc2),
    )
    cross = getattr(layer, "encoder_attn", None)
    if cross is None:
        return weights
    return weights._replace(
        cross_query=_stacked([cross.q_proj], int8, cross.scaling, bf16),
        cross_out=of(cross.out_proj),
    )


class _Release:
    """Hands the pages of weights our kernels carry back to the file they are mapped from
    (beamplugin.runtime.pages); weights in memory no file backs are left as they are."""

    def __init__(self, mappings: FileMappings) -> None:
        self.mappings = mappings

    def __call__(self, weights: LayerWeights, layer: nn.Module) -> LayerWeights:
        own = layer.self_attn
        carried = [
            (weights.self_qkv, [own.q_proj, own.k_proj, own.v_proj]),
            (weights.self_out, [own.out_proj]),
            (weights.fc1, [layer.fc1]),
            (weights.fc2, [layer.fc2]),
        ]
        if weights.cross_query is not None:
            cross = layer.encoder_attn
            carried += [(weights.cross_query, [cross.q_proj]),
                        (weights.cross_out, [cross.out_proj])]  # fmt: skip
        for prepared, modules in carried:
            self.of(prepared, modules)
        return weights

    def rows(self, weight: Tensor) -> None:
        """Release rows of a weight as soon as they are quantized (a 1 GB projection's pages
        are not all held at once)."""
        page_out(weight, self.mappings)

    def of(self, prepared: PreparedLinear, modules: list[nn.Module]) -> PreparedLinear:
        """``prepared``, the weights of ``modules`` (made into it) released if our kernels
        carry it."""
        if prepared.on_our_kernels():
            for module in modules:
                page_out(module.weight.detach(), self.mappings)
        return prepared


def _in_kernel(
    decoder: nn.Module, layers: list[LayerWeights], output: PreparedLinear
) -> transformer_layers.DecoderStep | None:
    """The decoder's step for beamplugin.kernels.transformer_layers: where every product is on our
    float32 or int8 kernel (not half precision, not torch's), the activation a relu, every norm
    affine, and the embedding plain (fairseq's scaled tokens plus positions); else None (the
    step runs one call at a time)."""
    attention = decoder.layers[0].self_attn
    if not transformer_layers.available() or not float_attention.taken(
        attention.num_heads, attention.head_dim
    ):
        return None
    ends = _ends(decoder, output)
    plan = [_layer_plan(*pair) for pair in zip(decoder.layers, layers, strict=True)]
    if ends is None or None in plan:
        return None
    try:
        return transformer_layers.DecoderStep(plan, ends, decoder.layers[0].self_attn.num_heads)
    except ValueError:  # a weight that is not contiguous, or not float32
        return None


def _encoder_in_kernel(
    encoder: nn.Module, layers: list[LayerWeights]
) -> transformer_layers.EncoderLayers | None:
    """The encoder's layers in one call of beamplugin.kernels.transformer_layers, on the terms of
    :func:`_in_kernel`; else None (one call at a time)."""
    attention = encoder.layers[0].self_attn
    if not transformer_layers.available() or not float_attention.taken(
        attention.num_heads, attention.head_dim
    ):
        return None
    plan = [_layer_plan(*pair) for pair in zip(encoder.layers, layers, strict=True)]
    if None in plan:
        return None
    try:
        return transformer_layers.EncoderLayers(plan, encoder.layers[0].self_attn.num_heads)
    except ValueError:
        return None


def _layer_plan(layer: nn.Module, weights: LayerWeights) -> transformer_layers.Layer | None:
    """A layer's products and norms for beamplugin.kernels.transformer_layers, or None where that
    cannot run it (see :func:`_in_kernel`)."""
    cross = weights.cross_query is not None
    norms = [layer.self_attn_layer_norm, layer.final_layer_norm]
    if cross:
        norms.insert(1, layer.encoder_attn_layer_norm)
    if layer.activation_fn is not F.relu or any(
        n.weight is None or n.bias is None or n.weight.dtype != torch.float32 for n in norms
    ):  # fmt: skip
        return None
    products = [weights.self_qkv, weights.self_out, weights.fc1, weights.fc2]
    if cross:
        products += [weights.cross_query, weights.cross_out]
    if not all(w.on_our_kernels() for w in products):
        return None
    affine = [(n.weight.detach(), n.bias.detach(), n.eps) for n in norms]
    if not cross:
        affine.insert(1, None)
    before = layer.normalize_before
    post = [None if before else norm for norm in affine]  # inside the sublayer's last call
    product = _kernel_product
    return transformer_layers.Layer(
        product(weights.self_qkv), product(weights.self_out, post[0]),
        product(weights.cross_query), product(weights.cross_out, post[1]),
        product(weights.fc1), product(weights.fc2, post[2]),
        *(norm if before else None for norm in affine),
    )  # fmt: skip


def _ends(decoder: nn.Module, output: PreparedLinear) -> transformer_layers.Ends | None:
    """The embedding, positions, final norm and output of ``decoder`` for its step in one call,
    or None where it has parts that call does not compute."""
    extras = [decoder.quant_noise, decoder.project_in_dim, decoder.project_out_dim]
    extras.append(decoder.layernorm_embedding)
    positions, tokens = decoder.embed_positions, decoder.embed_tokens
    if any(part is not None for part in extras) or positions is None or tokens.max_norm:
        return None
    if isinstance(positions, LearnedPositionalEmbedding):
        if positions.max_norm:
            return None
        table = positions.weight.detach()
    else:
        table = positions.weights.detach()
    norm = decoder.layer_norm
    if norm is not None and (norm.weight is None or norm.bias is None):
        return None
    final = None if norm is None else (norm.weight.detach(), norm.bias.detach(), norm.eps)
    if not output.on_our_kernels():
        return None
    out = _kernel_product(output)
    embedding, scale = tokens.weight.detach(), float(decoder.embed_scale)
    return transformer_layers.Ends(embedding, scale, table, decoder.padding_idx, final, out)


def _kernel_product(
    weight: PreparedLinear | None, norm: transformer_layers.Norm | None = None
) -> transformer_layers.Product | None:
    """``weight`` (on our float32 or int8 kernel) and the post-norm its call applies."""
    if weight is None:
        return None
    if weight.int8 is not None:
        int8 = weight.int8
        return transformer_layers.Product(int8.panels, int8.bias, norm, int8.scales)
    return transformer_layers.Product(weight.packed, weight.bias, norm)


def _stacked(
    projections: list[nn.Linear], int8: bool, scaling: float = 1.0, bf16: bool = False
) -> PreparedLinear:
    """One product for ``projections`` (their outputs side by side), the first one's weight and
    bias multiplied by ``scaling``; ``int8`` and ``bf16`` as :func:`prepare_linear`'s."""
    parts = [(p.weight, p.bias) for p in projections]
    weight, bias = parts[0]
    parts[0] = (weight * scaling, None if bias is None else bias * scaling)
    stacked_bias = None
    if any(b is not None for _, b in parts):
        stacked_bias = torch.cat([b if b is not None else w.new_zeros(w.size(0)) for w, b in parts])
    weight = torch.cat([w for w, _ in parts])
    return prepare_linear(weight, stacked_bias, int8, keep_weight=False, bf16=bf16)
