"""A transformer decoder step in one call (``native/transformer_layers.c``) on the CPU: the last
tokens' embeddings and positions, the history's mask, the layers' products (float32, int8, or
float32 rows on bfloat16 weights),
norms and attention kernels, the final norm and the output projection, which Python called one
by one (5-6 us each at a step's few rows, some 200 us a step for 3 layers), called from C in
the same order, so with the same bits. The weights' pointers are set once per
:class:`DecoderStep`; a step fills in its tokens, history window and memory."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NamedTuple

import torch
from torch import Tensor

from beamplugin.kernels import int8_products, native_library
from beamplugin.kernels.product_calls import (
    Norm,
    Product,
    ProductCall,
    product_call,
    product_kernels,
)

_P = ctypes.c_void_p
_I = ctypes.c_int64


class Layer(NamedTuple):
    """A layer's products and the norms before its sublayers (None: post-norm); an encoder
    layer has no cross-attention."""

    qkv: Product
    self_out: Product
    cross_query: Product | None
    cross_out: Product | None
    fc1: Product  # relu after
    fc2: Product
    self_norm: Norm | None
    cross_norm: Norm | None
    final_norm: Norm | None


class Ends(NamedTuple):
    """What comes before the layers and after them: the token embedding ``[vocab, embed]`` and
    its scale, the positions' table ``[positions, embed]`` (row pad + a row's own tokens), the
    padding token; the final norm (or None) and the output projection."""

    embedding: Tensor
    scale: float
    positions: Tensor
    pad: int
    final_norm: Norm | None
    output: Product


class Group(NamedTuple):
    """Rows of sentences that read one memory pool: every layer's keys ``[sentences, heads,
    head_dim, src]`` and values ``[sentences, heads, src, head_dim]`` (attention.c's layout),
    their padding bias ``[sentences, 1, 1, src]``, and the rows (sentence by sentence)."""

    keys: list[Tensor]
    values: list[Tensor]
    bias: Tensor
    rows: int


class _Norm(ctypes.Structure):
    _fields_ = [("gamma", _P), ("beta", _P), ("eps", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, ProductCall) for name in Layer._fields[:6]]
    _fields_ += [(name, _Norm) for name in Layer._fields[6:]]
    _fields_ += [("keys", _P), ("values", _P)]


class _Group(ctypes.Structure):
    _fields_ = [("keys", ctypes.POINTER(_P)), ("values", ctypes.POINTER(_P))]
    _fields_ += [(name, _I) for name in ("k_sentence", "k_head", "k_dim", "v_sentence",
                                         "v_head", "bias_sentence")]  # fmt: skip
    _fields_ += [("bias", _P), ("rows", _I), ("each", _I), ("src", _I)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _P)]
    _fields_ += [(name, _I) for name in ("token_stride", "steps", "pad", "vocab", "positions")]
    _fields_ += [("embedding", _P), ("position_table", _P), ("embed_scale", ctypes.c_float)]
    _fields_ += [("final_norm", _Norm), ("output", ProductCall), ("logits", _P)]
    _fields_ += [("products", _P), ("int8_products", _P), ("bf16_products", _P)]
    _fields_ += [("smallest", ctypes.c_float)]
    _fields_ += [("norm", _P), ("self_attention", _P), ("cross_attention", _P)]
    _fields_ += [(name, _I) for name in ("layers", "rows", "embed", "heads", "head_dim",
                                         "hidden", "width", "slots", "row_stride",
                                         "head_stride", "groups", "alignment_layer")]  # fmt: skip
    _fields_ += [("sources", _P), ("bias", _P), ("group", ctypes.POINTER(_Group))]
    _fields_ += [("alignment", _P), ("alignment_width", _I)]
    _fields_ += [(name, _P) for name in ("x", "a", "b", "normed", "qkv", "context", "query",
                                         "inner")]  # fmt: skip
    _fields_ += [("threads", ctypes.c_int), ("failed", ctypes.c_int)]


class _Sources(ctypes.Structure):
    _fields_ = [("sentences", _I), ("width", _I), ("bias_sentence", _I), ("bias", _P)]
    _fields_ += [("keys", _P), ("values", _P)]


@native_library.cached
def _kernels() -> tuple[Any, list[int | None]] | None:
    """transformer_layers.c's entry and the addresses of the kernels it calls (None where any of
    them cannot be built)."""
    run = native_library.function("transformer_layers", "decoder_step", [_P, _P], _P)
    products = product_kernels()
    attention = [
        native_library.address("attention", "self_attention"),
        native_library.address("attention", "cross_attention"),
    ]
    if run is None or products is None or None in attention:
        return None
    return run, [products.products, products.int8, products.norm, *attention, products.bf16]


def available() -> bool:
    """Whether the layers can run here (transformer_layers.c and the kernels it calls built)."""
    return _kernels() is not None


def _norm(norm: Norm | None) -> _Norm:
    if norm is None:
        return _Norm(None, None, 0.0)
    return _Norm(norm[0].data_ptr(), norm[1].data_ptr(), norm[2])


def _layer_table(layers: list[Layer], int8_kernel: int | None) -> ctypes.Array:
    table = (_Layer * len(layers))()
    for entry, layer in zip(table, layers, strict=True):
        for name, product in zip(Layer._fields[:6], layer[:6], strict=True):
            setattr(entry, name, product_call(product, int8_kernel))
        entry.self_norm, entry.cross_norm = _norm(layer.self_norm), _norm(layer.cross_norm)
        entry.final_norm = _norm(layer.final_norm)
    return table


class EncoderLayers:
    """An encoder's ``layers`` (float32 or int8 products, contiguous tensors; no
    cross-attention) ready to run sentences through them in one call."""

    def __init__(self, layers: list[Layer], heads: int) -> None:
        kernels = native_library.function(
            "transformer_layers", "encoder_layers", [_P, _P, ctypes.POINTER(_Sources)], _P
        )
        assert kernels is not None and _kernels() is not None, "check available() first"
        self.run, self.addresses = kernels, _kernels()[1]
        self.layers = layers  # keeps the tensors the pointers point into
        first = layers[0]
        self.embed, self.hidden = first.qkv.panels.in_features, first.fc1.panels.out_features
        self.heads, self.head_dim = heads, self.embed // heads
        self.table = _layer_table(layers, self.addresses[1])

    def __call__(self, x: Tensor, sentences: int, bias: Tensor) -> Tensor:
        """The layers' output ``[sentences x width, embed]`` for ``x`` (the same shape, float32,
        contiguous, sentence by sentence), each position attending over its sentence's, masked
        by ``bias`` ``[sentences, 1, 1, width]`` (0 or -inf, positions consecutive)."""
        rows, embed = x.shape
        width = rows // sentences
        if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or embed != self.embed:
            raise ValueError(f"x must be contiguous float32 [rows, {self.embed}] on the CPU")
        if bias.shape != (sentences, 1, 1, width) or bias.stride(3) != 1 or rows % sentences:
            raise ValueError(f"the bias must be [{sentences}, 1, 1, {rows // sentences}]")
        scratch = x.new_empty(rows * (9 * embed + self.hidden))
        sizes = [embed, embed, embed, 3 * embed, embed, self.hidden, embed, embed]
        parts = scratch.split([rows * n for n in sizes])
        a, b, normed, qkv, context, inner, keys, values = (p.data_ptr() for p in parts)
        addresses = self.addresses
        step = _Step(
            products=addresses[0], int8_products=addresses[1], bf16_products=addresses[5],
            smallest=int8_products.SMALLEST_SCALE, norm=addresses[2],
            cross_attention=addresses[4], layers=len(self.layers), rows=rows, embed=embed,
            heads=self.heads, head_dim=self.head_dim, hidden=self.hidden, x=x.data_ptr(), a=a,
            b=b, normed=normed, qkv=qkv, context=context, inner=inner,
            threads=torch.get_num_threads(),
        )  # fmt: skip
        sources = _Sources(sentences, width, bias.stride(0), bias.data_ptr(), keys, values)
        out = self.run(ctypes.byref(step), self.table, ctypes.byref(sources))
        if out is None:
            raise MemoryError(f"no memory to quantize {rows} rows")
        return (parts[0] if out == a else parts[1]).view(rows, embed)


class DecoderStep:
    """``layers`` and their ``ends`` (float32 or int8 products, contiguous tensors) ready to run
    a step's rows through them, one step at a time: a step fills in its tables, so generators
    decoding in several threads take turns (the C call releases the GIL)."""

    def __init__(self, layers: list[Layer], ends: Ends, heads: int) -> None:
        self.kernels = _kernels()
        assert self.kernels is not None, "check available() first"
        int8_kernel = self.kernels[1][1]
        self.layers, self.ends = layers, ends  # keep the tensors the pointers point into
        first = layers[0]
        self.embed, self.hidden = first.qkv.panels.in_features, first.fc1.panels.out_features
        self.heads, self.head_dim = heads, self.embed // heads
        self.vocab = ends.output.panels.out_features
        tables = (ends.embedding, ends.positions)
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.size(1) != self.embed
               for t in tables):  # fmt: skip
            raise ValueError(f"embedding and positions must be contiguous float32 x {self.embed}")
        self.table = _layer_table(layers, int8_kernel)
        self.output = product_call(ends.output, int8_kernel)
        self._columns: tuple[Product, ProductCall] | None = None  # the last shortlist's output
        self._turn = threading.Lock()
        self._scratch = torch.empty(0)  # the step's scratch, laid out for _scratch_rows
        self._scratch_rows: tuple[int, int] | None = None
        addresses = self.kernels[1]
        # what every step shares; a step fills in the rest
        self.step = _Step(
            token_stride=0, pad=ends.pad, vocab=ends.embedding.size(0),
            positions=ends.positions.size(0), embedding=ends.embedding.data_ptr(),
            position_table=ends.positions.data_ptr(), embed_scale=ends.scale,
            final_norm=_norm(ends.final_norm), output=self.output,
            products=addresses[0], int8_products=addresses[1], bf16_products=addresses[5],
            smallest=int8_products.SMALLEST_SCALE, norm=addresses[2],
            self_attention=addresses[3], cross_attention=addresses[4], layers=len(layers),
            embed=self.embed, heads=heads, head_dim=self.head_dim, hidden=self.hidden,
        )  # fmt: skip

    def groups(self, groups: list[Group]) -> Groups:
        """``groups`` checked and laid out for the steps that read them."""
        return Groups(groups, len(self.layers), self.heads, self.head_dim)

    def __call__(
        self,
        tokens: Tensor,
        windows: Tensor,
        sources: Tensor,
        groups: Groups,
        alignment_layer: int | None,
        output: Product | None,
        logits: Tensor,
    ) -> Tensor | None:
        """Write into ``logits`` (float32 ``[rows, vocab]``, contiguous) the logits
        (``output``'s columns instead of the ends', if given: a shortlist's) of the next token
        after ``tokens`` ``[rows, steps]``
        (int64, right-aligned, pad before a row's own), given the rows' histories ``windows``
        ``[2 x layers, slots, heads, width, head_dim]`` (row ``r``'s column ``j`` in slot
        ``sources[r, j]``; its last column written here, in slot ``r``) and the ``groups``'
        memories; return the alignment layer's cross-attention weights averaged over heads
        ``[rows, src]``, each group's left-padded with zeros to the widest (None without an
        ``alignment_layer``)."""
        rows = tokens.size(0)
        self._check(tokens, windows, sources)
        if groups.rows != rows:
            raise ValueError("the groups' rows must add up to the step's")
        projection, width = self.output, self.vocab
        if output is not None:  # a shortlist's columns: the same product until they change
            kept = self._columns  # (read once: another thread's engine may replace it)
            if kept is None or kept[0] is not output:
                kept = self._columns = output, product_call(output, self.kernels[1][1])
            projection, width = kept[1], output.panels.out_features
        if (
            logits.shape != (rows, width)
            or logits.dtype != torch.float32
            or not logits.is_contiguous()
        ):
            raise ValueError(f"the logits must be float32 [{rows}, {width}], contiguous")
        attn = None if alignment_layer is None else windows.new_empty((rows, groups.widest))
        with self._turn:
            self.step.output = projection
            self._run(logits, attn, tokens, windows, sources, groups, alignment_layer)
        return attn

    def _run(
        self,
        logits: Tensor,
        attn: Tensor | None,
        tokens: Tensor,
        windows: Tensor,
        sources: Tensor,
        groups: Groups,
        alignment_layer: int | None,
    ) -> None:
        """Fill in the step's struct and tables (the outputs ``logits`` and ``attn``, if any)
        and run it."""
        (rows, steps), slots, width = tokens.shape, windows.size(1), sources.size(1)
        step = self.step
        if self._scratch_rows != (rows, width):
            self._lay_out_scratch(rows, width)
        step.logits = logits.data_ptr()
        if attn is None:  # no alignment layer: nothing averaged (the C code reads NULL)
            step.alignment = None
        else:
            step.alignment, step.alignment_width = attn.data_ptr(), attn.size(1)
            step.alignment_layer = alignment_layer
        history, layer_bytes = windows.data_ptr(), 4 * windows.stride(0)
        for index, entry in enumerate(self.table):
            entry.keys = history + 2 * index * layer_bytes
            entry.values = entry.keys + layer_bytes
        step.tokens, step.token_stride, step.steps = tokens.data_ptr(), tokens.stride(0), steps
        step.rows, step.width, step.slots, step.sources = rows, width, slots, sources.data_ptr()
        step.row_stride, step.head_stride = windows.stride(1), windows.stride(2)
        step.groups, step.group = len(groups.table), groups.table
        step.threads = torch.get_num_threads()
        step.failed = 0
        if self.kernels[0](ctypes.byref(step), self.table) is None:
            raise _failure(step.failed, rows, slots)

    def _lay_out_scratch(self, rows: int, width: int) -> None:
        """Point the step's scratch parts at a buffer for ``rows`` rows and a history ``width``
        wide, kept for the steps after (grown, never shrunk: steps take turns in it)."""
        embed = self.embed
        sizes = [embed, embed, embed, embed, 3 * embed, embed, embed, self.hidden, width]
        if self._scratch.numel() < rows * sum(sizes):
            self._scratch = self._scratch.new_empty(rows * sum(sizes))
        at = self._scratch.data_ptr()
        for name, size in zip(_SCRATCH, sizes, strict=True):  # float32: 4 bytes each
            setattr(self.step, name, at)
            at += 4 * rows * size
        self._scratch_rows = (rows, width)

    def _check(self, tokens: Tensor, windows: Tensor, sources: Tensor) -> None:
        """A ValueError where the step's inputs are not what the C code reads."""
        layers, heads, head_dim = len(self.layers), self.heads, self.head_dim
        slots, width = windows.size(1), sources.size(1)
        if tokens.dtype != torch.int64 or tokens.stride(1) != 1 or tokens.size(1) > width:
            raise ValueError(f"tokens must be int64 [rows, at most {width}], steps consecutive")
        if windows.shape != (2 * layers, slots, heads, width, head_dim) or windows.stride()[3:] != (
            head_dim, 1,
        ):  # fmt: skip
            raise ValueError(f"the history window {tuple(windows.shape)} is not this model's")
        rows = tokens.size(0)
        if sources.dtype != torch.int64 or not sources.is_contiguous() or sources.size(0) != rows:
            raise ValueError("sources must be [rows, width] contiguous int64")
        if windows.dtype != torch.float32 or not windows.is_cpu:
            raise ValueError("the history must be float32 on the CPU")


# the step's scratch, rows wide each, in the order of DecoderStep._lay_out_scratch's sizes
_SCRATCH = ("x", "a", "b", "normed", "qkv", "context", "query", "inner", "bias")


def _failure(failed: int, rows: int, slots: int) -> Exception:
    """What a step's ``failed`` code means."""
    if failed == 2:
        return MemoryError(f"no memory to quantize {rows} rows")
    if failed == 3:
        return ValueError("a token outside the embedding, or a position outside its table")
    return ValueError(f"sources must be slots 0 to {slots - 1}, and rows {slots} at most")


class Groups:
    """Groups of rows (:class:`Group`) as the C step reads them: checked once, for all the
    steps that read the same memory views."""

    def __init__(self, groups: list[Group], layers: int, heads: int, head_dim: int) -> None:
        self.rows = sum(group.rows for group in groups)
        self.widest = max(group.bias.size(3) for group in groups)
        self.table = table = (_Group * len(groups))()  # its entries keep their pointer arrays
        for entry, group in zip(table, groups, strict=True):
            sentences, _, _, src = group.keys[0].shape
            for k, v in zip(group.keys, group.values, strict=True):
                if k.shape != (sentences, heads, head_dim, src) or k.stride(3) != 1 or (
                    v.shape != (sentences, heads, src, head_dim) or v.stride()[2:] != (head_dim, 1)
                ):  # fmt: skip
                    raise ValueError("a group's keys or values are not attention.c's layout")
                if k.stride() != group.keys[0].stride() or v.stride() != group.values[0].stride():
                    raise ValueError("a group's layers must share their strides")
            if group.bias.shape != (sentences, 1, 1, src) or group.bias.stride(3) != 1:
                raise ValueError("a group's bias must be [sentences, 1, 1, src]")
            if len(group.keys) != layers or group.rows % sentences:
                raise ValueError("a group needs every layer's memory, as many rows a sentence")
            key_pointers = (_P * layers)(*(k.data_ptr() for k in group.keys))
            value_pointers = (_P * layers)(*(v.data_ptr() for v in group.values))
            entry.keys, entry.values = key_pointers, value_pointers
            entry.k_sentence, entry.k_head, entry.k_dim = group.keys[0].stride()[:3]
            entry.v_sentence, entry.v_head = group.values[0].stride()[:2]
            entry.bias, entry.bias_sentence = group.bias.data_ptr(), group.bias.stride(0)
            entry.rows, entry.each, entry.src = group.rows, group.rows // sentences, src
        self.groups = groups  # keeps the tensors the pointers point into
