"""ConvS2S (Gehring et al. 2017, "Convolutional Sequence to Sequence Learning").

Our own implementation, parameter for parameter compatible with fairseq's ``fconv``: a checkpoint
of ``--arch fconv_X`` loads strictly into ``convs2s_X`` and computes the same outputs. Decoding
is incremental: every decoder convolution keeps an ``input_buffer`` and takes one matrix product
per step, weight normalisation is folded into cached weights, and what attention needs from the
encoder is prepared once per sentence and kept (and reordered) in the incremental state.
"""

from __future__ import annotations

import functools
import math
from argparse import ArgumentParser, Namespace
from typing import Any

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.data import Dictionary
from fairseq.models import (
    FairseqEncoder,
    FairseqEncoderDecoderModel,
    FairseqIncrementalDecoder,
    register_model,
    register_model_architecture,
)
from fairseq.modules import FairseqDropout, GradMultiply
from torch import Tensor, nn

from beamplugin.kernels import convs2s_layers
from beamplugin.models.normalization import plain_softmax
from beamplugin.modules import (
    CausalConvolution,
    ConvAttention,
    LearnedPositions,
    Linear,
    MemoryPool,
    TBCConvolution,
    WeightNormLinear,
    attention_memory_pool,
    encoder_memory,
    parse_attention_spec,
    parse_layer_spec,
)
from beamplugin.modules.convolution import IncrementalState
from beamplugin.modules.output_columns import OutputColumns

SQRT_HALF = math.sqrt(0.5)
# Version 2 of fconv's decoder normalises conv weights per output channel (dim 2); version 1
# checkpoints normalised them over dim 0 and are refolded on load.
DECODER_VERSION = 2


def token_embedding(dictionary: Dictionary, dim: int, path: str | None) -> nn.Embedding:
    embedding = nn.Embedding(len(dictionary), dim, padding_idx=dictionary.pad())
    nn.init.normal_(embedding.weight, 0.0, 0.1)
    nn.init.zeros_(embedding.weight[dictionary.pad()])
    if path:
        pretrained = utils.parse_embedding(path)
        utils.print_embed_overlap(pretrained, dictionary)
        embedding = utils.load_embedding(pretrained, dictionary, embedding)
    return embedding


def residual_projections(
    layers: list[tuple[int, int, int]], in_channels: int
) -> tuple[nn.ModuleList, list[int]]:
    """Per layer, the projection of its residual input when channel counts differ (else None),
    and the input channels of every layer."""
    layer_inputs = [in_channels]
    projections = nn.ModuleList()
    for channels, _, residual in layers:
        residual_dim = layer_inputs[-residual] if residual else channels
        projections.append(
            WeightNormLinear(residual_dim, channels) if residual_dim != channels else None
        )
        layer_inputs.append(channels)
    return projections, layer_inputs


def residual_input(
    residuals: list[Tensor], distance: int, projection: nn.Module | None
) -> Tensor | None:
    if distance == 0:
        return None
    residual = residuals[-distance]
    return residual if projection is None else projection(residual)


class ConvS2SEncoder(FairseqEncoder):
    """Token + learned position embeddings, then convolution + GLU blocks with scaled
    residuals. Returns ``encoder_out = (x, y)`` with x the top layer projected to the embedding
    size and y = (x + input embedding) * sqrt(0.5), both batch x src_len x embed_dim, and
    ``encoder_padding_mask`` (batch x src_len, None without padding), as fconv does."""

    def __init__(
        self,
        dictionary: Dictionary,
        embed_dim: int,
        layers: list[tuple[int, int, int]],
        dropout: float,
        max_positions: int,
        embed_path: str | None = None,
    ) -> None:
        super().__init__(dictionary)
        self.padding_idx = dictionary.pad()
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.num_attention_layers = 1  # set by the model: scales the gradient of the output
        self.embed_tokens = token_embedding(dictionary, embed_dim, embed_path)
        self.embed_positions = LearnedPositions(max_positions, embed_dim, self.padding_idx)
        self.fc1 = WeightNormLinear(embed_dim, layers[0][0], dropout=dropout)
        self.projections, layer_inputs = residual_projections(layers, layers[0][0])
        self.convolutions = nn.ModuleList(
            TBCConvolution(in_channels, channels * 2, width, dropout=dropout)
            for in_channels, (channels, width, _) in zip(layer_inputs, layers, strict=False)
        )
        self.residuals = [residual for _, _, residual in layers]
        self.fc2 = WeightNormLinear(layers[-1][0], embed_dim)

    def forward(self, src_tokens: Tensor, src_lengths: Tensor | None = None) -> dict[str, Any]:
        x = self.embed_tokens(src_tokens) + self.embed_positions(src_tokens)
        x = self.dropout_module(x)
        input_embedding = x
        x = self.fc1(x)

        padding_mask = src_tokens.eq(self.padding_idx)
        if not padding_mask.any():
            padding_mask = None
        else:
            time_major_mask = padding_mask.t().unsqueeze(-1)

        x = x.transpose(0, 1)  # time-major for the convolutions
        residuals = [x]
        for projection, conv, distance in zip(
            self.projections, self.convolutions, self.residuals, strict=True
        ):
            residual = residual_input(residuals, distance, projection)
            if padding_mask is not None:
                x = x.masked_fill(time_major_mask, 0)
            x = F.glu(conv(self.dropout_module(x)), dim=2)
            if residual is not None:
                x = (x + residual) * SQRT_HALF
            residuals.append(x)
        x = self.fc2(x.transpose(0, 1))

        if padding_mask is not None:
            x = x.masked_fill(padding_mask.unsqueeze(-1), 0)
        # every attention layer sends gradient into x; keep the encoder's share constant
        x = GradMultiply.apply(x, 1.0 / (2.0 * self.num_attention_layers))
        y = (x + input_embedding) * SQRT_HALF
        out = {"encoder_out": (x, y), "encoder_padding_mask": padding_mask}
        # Prepared here, once per sentence, so that decoding never rebuilds or reorders it per
        # step: beams of a sentence share it, and it only follows reorder_encoder_out.
        out["attention_memory"] = encoder_memory(out)
        return out

    def reorder_encoder_out(self, encoder_out: dict[str, Any], new_order: Tensor) -> dict[str, Any]:
        """The rows of ``new_order`` (a permutation, repetition or subset of the batch)."""
        def select(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, new_order)

        return {
            "encoder_out": tuple(select(t) for t in encoder_out["encoder_out"]),
            "encoder_padding_mask": select(encoder_out["encoder_padding_mask"]),
            "attention_memory": {k: select(t) for k, t in encoder_out["attention_memory"].items()},
        }

    def max_positions(self) -> int:
        return self.embed_positions.max_positions

    def memory_pool(self) -> MemoryPool:
        """Where a search keeps the encoder output of sentences at different steps."""
        return attention_memory_pool(self.embed_tokens.embedding_dim)


class ConvS2SDecoder(FairseqIncrementalDecoder):
    """Embeddings + positions, causal convolution + GLU blocks each followed by attention over
    the encoder (where enabled), scaled residuals, then fc2 and the output projection fc3.

    Full pass (``incremental_state`` None): batch x tgt_len x vocab logits. Incremental pass:
    only the last token of ``prev_output_tokens`` is read; logits are batch x 1 x vocab.
    The second output is the attention averaged over layers (None in training, when
    ``need_attn`` is off, or when a call asks for none: ``forward(..., need_attn=False)``).
    """

    # The decoder accepts an encoder_out with one row per sentence while it decodes several
    # (sentence-major) rows per sentence: beamplugin's generator then never copies the encoder
    # output per beam (see ConvAttention).
    reads_encoder_out_per_sentence = True
    # Rows of sentences at different steps can share a forward: each row's position is counted
    # in its own (left-padded) token history, a new sentence's rows start from zeroed state
    # (reorder_incremental_state's fresh_rows), and the encoder memory is pooled per sentence
    # (ConvS2SEncoder.memory_pool). See beamplugin.engine.ensemble.
    decodes_mixed_steps = True
    # With ``output_columns`` (a shortlist per row), fc3 multiplies those columns alone where
    # they are few and the logits are of the last step only: see
    # beamplugin.modules.output_columns.
    computes_output_columns = True

    def __init__(
        self,
        dictionary: Dictionary,
        embed_dim: int,
        layers: list[tuple[int, int, int]],
        attention: list[bool],
        out_embed_dim: int,
        dropout: float,
        max_positions: int,
        share_embed: bool = False,
        embed_path: str | None = None,
    ) -> None:
        super().__init__(dictionary)
        self.register_buffer("version", torch.Tensor([DECODER_VERSION]))
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.need_attn = True
        self.padding_idx = padding_idx = dictionary.pad()
        self.embed_tokens = token_embedding(dictionary, embed_dim, embed_path)
        self.embed_positions = LearnedPositions(max_positions, embed_dim, padding_idx)
        self.fc1 = WeightNormLinear(embed_dim, layers[0][0], dropout=dropout)
        self.projections, layer_inputs = residual_projections(layers, layers[0][0])
        self.convolutions = nn.ModuleList(
            CausalConvolution(in_channels, channels * 2, width, dropout=dropout)
            for in_channels, (channels, width, _) in zip(layer_inputs, layers, strict=False)
        )
        self.attention = nn.ModuleList(
            ConvAttention(channels, embed_dim) if attend else None
            for (channels, _, _), attend in zip(layers, attention, strict=True)
        )
        self.residuals = [residual for _, _, residual in layers]
        self.fc2 = WeightNormLinear(layers[-1][0], out_embed_dim)
        if share_embed:
            if out_embed_dim != embed_dim:
                raise ValueError(
                    "--share-input-output-embed needs --decoder-out-embed-dim "
                    f"({out_embed_dim}) equal to --decoder-embed-dim ({embed_dim})"
                )
            self.fc3 = Linear(out_embed_dim, len(dictionary))
            self.fc3.weight = self.embed_tokens.weight
        else:
            self.fc3 = WeightNormLinear(out_embed_dim, len(dictionary), dropout=dropout)

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: dict[str, Any] | None = None,
        incremental_state: IncrementalState | None = None,
        need_attn: bool = True,
        output_columns: OutputColumns | None = None,
        **unused: Any,
    ) -> tuple[Tensor, Tensor | None]:
        if encoder_out is None:
            raise ValueError("the convs2s decoder attends over the encoder: encoder_out is None")
        # a memory pool's groups of sentences, or one memory for all rows
        groups = encoder_out.get("attention_groups") or [
            (encoder_out["attention_memory"], len(prev_output_tokens))
        ]
        incremental = incremental_state is not None
        if incremental:
            tokens = prev_output_tokens[:, -1:]
            # per row: rows of sentences at different steps are left-padded to one width
            positions = self.embed_positions.at(prev_output_tokens.ne(self.padding_idx).sum(1))
        else:
            tokens = prev_output_tokens
            positions = self.embed_positions(prev_output_tokens)
        x = self.dropout_module(self.embed_tokens(tokens) + positions)
        target_embedding = x
        keep_attn = not self.training and self.need_attn and need_attn
        if incremental:  # the step in one call of our kernels where it serves
            in_kernel = convs2s_layers.step_of(self, x, groups)
            if in_kernel is not None:
                return in_kernel(self, x, x, groups, incremental_state, keep_attn, output_columns)
        x = self.fc1(x)

        # the full pass convolves time-major and attends batch-major; a step is batch x 1 x C
        def swap(t: Tensor) -> Tensor:
            return t if incremental else t.transpose(0, 1)

        x = swap(x)
        avg_attn = None
        residuals = [x]
        for projection, conv, attention, distance in zip(
            self.projections, self.convolutions, self.attention, self.residuals, strict=True
        ):
            residual = residual_input(residuals, distance, projection)
            x = F.glu(conv(self.dropout_module(x), incremental_state), dim=2)
            if attention is not None:
                x, attn = attention(swap(x), target_embedding, groups, keep_attn)
                x = swap(x)
                if keep_attn:
                    # averaged over all layers, attending or not, as fconv does
                    attn = attn / len(self.attention)
                    avg_attn = attn if avg_attn is None else avg_attn + attn
            if residual is not None:
                x = (x + residual).mul_(SQRT_HALF)
            residuals.append(x)
        x = self.dropout_module(self.fc2(swap(x)))
        if output_columns is not None:
            return self._output_columns(x[:, -1], output_columns).unsqueeze(1), avg_attn
        return self.fc3(x), avg_attn

    def _output_columns(self, x: Tensor, output_columns: OutputColumns) -> Tensor:
        """The logits ``[rows, n]`` of ``output_columns``' n columns alone where they are few,
        else ``[rows, vocab]`` of every token (the log-softmax reads each row's own)."""
        fc3 = self.fc3
        if not output_columns.narrow(fc3.out_features):
            return fc3(x)
        return fc3.columns_product(x, fc3.weight, fc3.bias, output_columns.columns)

    def reorder_incremental_state(
        self, incremental_state: IncrementalState, new_order: Tensor, fresh_rows: int = 0
    ) -> None:
        """Keep the rows of ``new_order`` in every convolution's input_buffer. ``new_order`` may
        permute, repeat or drop rows; the last ``fresh_rows`` rows of the result start afresh
        (new sentences). The encoder memory is not state: it lives in encoder_out, which the
        generator keeps per sentence."""
        for conv in self.convolutions:
            conv.reorder_buffer(incremental_state, new_order, fresh_rows)

    def max_positions(self) -> int:
        return self.embed_positions.max_positions

    def upgrade_state_dict_named(self, state_dict: dict[str, Tensor], name: str) -> None:
        """Refold version-1 fconv conv weights (normalised over dim 0) per output channel."""
        prefix = f"{name}." if name else ""
        version = state_dict.get(f"{prefix}version")
        if version is not None and utils.item(version[0]) >= DECODER_VERSION:
            return
        for index in range(len(self.convolutions)):
            conv = f"{prefix}convolutions.{index}."
            state_dict.pop(f"{conv}_linearized_weight", None)  # a cache old fairseq saved
            if f"{conv}weight_g" in state_dict:
                weight = torch._weight_norm(
                    state_dict[f"{conv}weight_v"], state_dict[f"{conv}weight_g"], 0
                )
                state_dict[f"{conv}weight_v"] = weight
                state_dict[f"{conv}weight_g"] = torch.norm_except_dim(weight, 2, 2)
        state_dict[f"{prefix}version"] = torch.Tensor([DECODER_VERSION])

    def make_generation_fast_(self, need_attn: bool = False, **kwargs: Any) -> None:
        self.need_attn = need_attn

    def train(self, mode: bool = True) -> ConvS2SDecoder:
        # the step in one call is made again after: parameters may have changed behind their
        # version counters (fairseq's optimizers write through p.data), as InferenceCache's
        convs2s_layers.forget(self)
        return super().train(mode)

    def _apply(self, fn, recurse=True):  # noqa: ANN001  (torch's private signature)
        convs2s_layers.forget(self)  # parameters moved or cast
        return super()._apply(fn, recurse)


@register_model("convs2s")
class ConvS2SModel(FairseqEncoderDecoderModel):
    """Convolutional sequence to sequence model; options and architectures mirror fconv's."""

    def __init__(self, encoder: ConvS2SEncoder, decoder: ConvS2SDecoder) -> None:
        super().__init__(encoder, decoder)
        attending = sum(layer is not None for layer in decoder.attention)
        if attending == 0:
            raise ValueError("--decoder-attention: at least one decoder layer must attend")
        self.encoder.num_attention_layers = attending
        # the decoder's step in one call checks its weights again after each encoder forward
        # (every sentence is encoded before it decodes)
        encoder.register_forward_pre_hook(functools.partial(_recheck, decoder))

    @property
    def plain_softmax(self) -> bool:
        """Whether this model's log-probs are torch's log-softmax of its decoder's logits."""
        return plain_softmax(self)

    @staticmethod
    def add_args(parser: ArgumentParser) -> None:
        # --max-source-positions / --max-target-positions come from the translation task
        parser.add_argument("--dropout", type=float, metavar="D", help="dropout probability")
        parser.add_argument("--encoder-embed-dim", type=int, metavar="N",
                            help="encoder embedding dimension")
        parser.add_argument("--encoder-embed-path", type=str, metavar="STR",
                            help="path to pre-trained encoder embedding")
        parser.add_argument("--encoder-layers", type=str, metavar="EXPR",
                            help='encoder layers [(dim, kernel_size[, residual]), ...], '
                                 'e.g. "[(256, 3)] * 4"')
        parser.add_argument("--decoder-embed-dim", type=int, metavar="N",
                            help="decoder embedding dimension")
        parser.add_argument("--decoder-embed-path", type=str, metavar="STR",
                            help="path to pre-trained decoder embedding")
        parser.add_argument("--decoder-layers", type=str, metavar="EXPR",
                            help="decoder layers [(dim, kernel_size[, residual]), ...]")
        parser.add_argument("--decoder-out-embed-dim", type=int, metavar="N",
                            help="decoder output embedding dimension")
        parser.add_argument("--decoder-attention", type=str, metavar="EXPR",
                            help="decoder attention: True, False or [True, ...] per layer")
        parser.add_argument("--share-input-output-embed", action="store_true",
                            help="share input and output embeddings (requires "
                                 "--decoder-out-embed-dim equal to --decoder-embed-dim)")

    @classmethod
    def build_model(cls, args: Namespace, task: Any) -> ConvS2SModel:
        base_architecture(args)
        encoder_layers = parse_layer_spec(args.encoder_layers, "--encoder-layers")
        decoder_layers = parse_layer_spec(args.decoder_layers, "--decoder-layers")
        attention = parse_attention_spec(
            args.decoder_attention, len(decoder_layers), "--decoder-attention"
        )
        encoder = ConvS2SEncoder(
            task.source_dictionary,
            embed_dim=args.encoder_embed_dim,
            layers=encoder_layers,
            dropout=args.dropout,
            max_positions=args.max_source_positions,
            embed_path=args.encoder_embed_path,
        )
        decoder = ConvS2SDecoder(
            task.target_dictionary,
            embed_dim=args.decoder_embed_dim,
            layers=decoder_layers,
            attention=attention,
            out_embed_dim=args.decoder_out_embed_dim,
            dropout=args.dropout,
            max_positions=args.max_target_positions,
            share_embed=args.share_input_output_embed,
            embed_path=args.decoder_embed_path,
        )
        return cls(encoder, decoder)


def _recheck(decoder: ConvS2SDecoder, *_: Any) -> None:
    """A forward pre-hook of the encoder (bound to its model's decoder with functools.partial,
    so that copies and pickles of the model keep it): the decoder's step in one call checks its
    weights at its next step."""
    convs2s_layers.recheck(decoder)


def _default(args: Namespace, name: str, value: Any) -> None:
    if getattr(args, name, None) is None:
        setattr(args, name, value)


@register_model_architecture("convs2s", "convs2s")
def base_architecture(args: Namespace) -> None:
    _default(args, "dropout", 0.1)
    _default(args, "encoder_embed_dim", 512)
    _default(args, "encoder_embed_path", None)
    _default(args, "encoder_layers", "[(512, 3)] * 20")
    _default(args, "decoder_embed_dim", 512)
    _default(args, "decoder_embed_path", None)
    _default(args, "decoder_layers", "[(512, 3)] * 20")
    _default(args, "decoder_out_embed_dim", 256)
    _default(args, "decoder_attention", "True")
    _default(args, "share_input_output_embed", False)
    _default(args, "max_source_positions", 1024)
    _default(args, "max_target_positions", 1024)


def _shaped(
    args: Namespace, embed_dim: int, encoder_layers: str, decoder_layers: str, out_embed_dim: int
) -> None:
    """An architecture's defaults: embedding size of both sides, layers, output embedding."""
    _default(args, "encoder_embed_dim", embed_dim)
    _default(args, "encoder_layers", encoder_layers)
    _default(args, "decoder_embed_dim", embed_dim)
    _default(args, "decoder_layers", decoder_layers)
    _default(args, "decoder_out_embed_dim", out_embed_dim)
    base_architecture(args)


@register_model_architecture("convs2s", "convs2s_iwslt_de_en")
def convs2s_iwslt_de_en(args: Namespace) -> None:
    _shaped(args, 256, "[(256, 3)] * 4", "[(256, 3)] * 3", 256)


@register_model_architecture("convs2s", "convs2s_wmt_en_ro")
def convs2s_wmt_en_ro(args: Namespace) -> None:
    _default(args, "decoder_out_embed_dim", 512)
    base_architecture(args)


@register_model_architecture("convs2s", "convs2s_wmt_en_de")
def convs2s_wmt_en_de(args: Namespace) -> None:
    # 9 layers of 512 units, 4 of 1024, then two 1x1 convolutions of 2048
    layers = "[(512, 3)] * 9 + [(1024, 3)] * 4 + [(2048, 1)] * 2"
    _shaped(args, 768, layers, layers, 512)


@register_model_architecture("convs2s", "convs2s_wmt_en_fr")
def convs2s_wmt_en_fr(args: Namespace) -> None:
    # 6 layers of 512 units, 4 of 768, 3 of 1024, then 1x1 convolutions of 2048 and 4096
    layers = "[(512, 3)] * 6 + [(768, 3)] * 4 + [(1024, 3)] * 3"
    layers += " + [(2048, 1)] * 1 + [(4096, 1)] * 1"
    _shaped(args, 768, layers, layers, 512)


@register_model_architecture("convs2s", "convs2s_tiny")
def convs2s_tiny(args: Namespace) -> None:
    """64 wide, two encoder and two decoder layers of width 3: for tests and CPU demos."""
    _shaped(args, 64, "[(64, 3)] * 2", "[(64, 3)] * 2", 64)
