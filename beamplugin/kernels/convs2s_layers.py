"""A ConvS2S decoder step in one call (``native/convs2s_layers.c``) on the CPU, after the
embedding: fc1, every layer's residual, convolution window, product and GLU, its attention over
the sentences' memory where it attends, fc2 and fc3, which Python called one by one (some 20 us
a product through the module, cache and ctypes layers at a beam's few rows, and some 25 small
torch ops a step). The products are the same kernels called on the same rows, so with the same
bits; GLU's sigmoid is our own (isa.h's exp), within a few ulp of torch's.

With a shortlist the call stops after fc2, and the decoder multiplies fc3's columns (their
bits those of the whole product).

The weights' pointers are set once per decoder (:func:`step_of`), made again when a parameter's
version or storage, or the int8 / bf16 switches, change; a step fills in its rows, the
convolutions' buffers and the memory groups.
"""

from __future__ import annotations

import ctypes
import operator
import threading
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from beamplugin.kernels import int8_products, native_library, sentence_attention
from beamplugin.kernels.product_calls import Product, ProductCall, product_call, product_kernels

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Kernels(ctypes.Structure):  # product_calls.h's struct product_kernels
    _fields_ = [("products", _P), ("int8_products", _P), ("bf16_products", _P),
                ("smallest", ctypes.c_float), ("norm", _P)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [(name, ProductCall) for name in ("residual", "conv", "in_projection",
                                              "out_projection")]  # fmt: skip
    _fields_ += [(name, _I) for name in ("in_channels", "channels", "kernel", "distance")]
    _fields_ += [("buffer", _P), ("buffer_stride", _I), ("order", _P), ("order_rows", _I)]
    _fields_ += [("window", _P)]


class _Group(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("keys", "values", "bias", "scale")]
    _fields_ += [(name, _I) for name in ("k_sentence", "k_dim", "v_sentence", "v_src",
                                         "bias_sentence", "scale_stride", "sentences", "rows",
                                         "src")]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("kernels", _Kernels), ("attention", _P)]
    _fields_ += [(name, ProductCall) for name in ("fc1", "fc2", "fc3")]
    _fields_ += [(name, _I) for name in ("layers", "rows", "embed", "attention_layers",
                                         "widest_channels", "out_embed", "groups")]  # fmt: skip
    _fields_ += [("group", ctypes.POINTER(_Group))]
    _fields_ += [(name, _P) for name in ("x", "target", "logits", "attn")]
    _fields_ += [("attn_width", _I)]
    _fields_ += [(name, _P) for name in ("outputs", "wide", "residual", "glued", "query",
                                         "context", "probs", "hidden")]  # fmt: skip
    _fields_ += [("threads", ctypes.c_int), ("failed", ctypes.c_int)]


@native_library.cached
def _kernels() -> tuple[Any, list[int | None]] | None:
    """convs2s_layers.c's entry and the addresses of the kernels it calls (None where any of
    them cannot be built)."""
    run = native_library.function("convs2s_layers", "convs2s_step", [_P, _P], _P)
    products = product_kernels()
    attention = native_library.address("attention", "sentence_attention")
    if run is None or products is None or attention is None:
        return None
    return run, [products.products, products.int8, products.bf16, products.norm, attention]


def available() -> bool:
    """Whether the step can run here (convs2s_layers.c and the kernels it calls built)."""
    return _kernels() is not None


def _kernel_product(prepared: Any) -> Product | None:
    """``prepared`` (a PreparedLinear) as the C step takes it, None where our kernels do not
    multiply it."""
    if prepared is None or not prepared.on_our_kernels():
        return None
    if prepared.int8 is not None:
        int8 = prepared.int8
        return Product(int8.panels, int8.bias, None, int8.scales)
    return Product(prepared.packed, prepared.bias, None)


def _prepared(module: nn.Module, probe: Tensor, name: str = "weight") -> Any:
    """The PreparedLinear ``module``'s product takes for float32 rows (its cache's)."""
    if name == "linearized":
        weight = module.derived_weight("linearized", module._linearize)
    else:
        weight = module.weight
    return module._prepared(probe, weight, module.bias, name)


class ConvS2SStep:
    """A decoder's weights as the C step reads them (pointers into its modules' prepared
    weights, which this keeps)."""

    def __init__(self, decoder: nn.Module) -> None:
        kernels = _kernels()
        assert kernels is not None, "check available() first"
        self.run, addresses = kernels
        probe = torch.empty(0)
        int8_kernel = addresses[1]
        kept: list[Any] = []  # the prepared weights the pointers point into

        def product(module: nn.Module | None, name: str = "weight") -> ProductCall:
            if module is None:
                return ProductCall()
            prepared = _prepared(module, probe, name)
            kernel_product = _kernel_product(prepared)
            if kernel_product is None:
                raise ValueError("a product that is not on our kernels")
            kept.append(prepared)
            return product_call(kernel_product, int8_kernel)

        self.layers = len(decoder.convolutions)
        self.table = table = (_Layer * self.layers)()
        self.kernel_sizes: list[int] = []
        channels = []
        for entry, projection, conv, attention, distance in zip(
            table, decoder.projections, decoder.convolutions, decoder.attention,
            decoder.residuals, strict=True,
        ):  # fmt: skip
            entry.residual = product(projection)
            entry.conv = product(conv, "linearized")
            entry.in_projection = product(None if attention is None else attention.in_projection)
            entry.out_projection = product(None if attention is None else attention.out_projection)
            entry.in_channels, entry.channels = conv.in_channels, conv.out_channels // 2
            if distance > len(self.kernel_sizes) + 1:  # the C step reads layer outputs back
                raise ValueError("a residual from before the first layer's input")
            entry.kernel, entry.distance = conv.kernel_size, distance
            self.kernel_sizes.append(conv.kernel_size)
            channels.append(conv.out_channels // 2)
        self.in_channels = [conv.in_channels for conv in decoder.convolutions]
        self.embed = decoder.fc1.in_features
        self.widest = max([decoder.fc1.out_features, *channels])
        self.out_embed = decoder.fc2.out_features
        self.vocab = decoder.fc3.out_features
        self.step = _Step(
            kernels=_Kernels(addresses[0], addresses[1], addresses[2],
                             int8_products.SMALLEST_SCALE, addresses[3]),
            attention=addresses[4], fc1=product(decoder.fc1), fc2=product(decoder.fc2),
            fc3=product(decoder.fc3), layers=self.layers, embed=self.embed,
            attention_layers=len(decoder.attention), widest_channels=self.widest,
            out_embed=self.out_embed,
        )  # fmt: skip
        self.kept = kept
        self._turn = threading.Lock()
        self._scratch = torch.empty(0)

    def __call__(
        self,
        decoder: nn.Module,
        x: Tensor,
        target: Tensor,
        groups: list[tuple[dict, int]],
        incremental_state: dict,
        need_attn: bool,
        output_columns: Any = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The logits ``[rows, 1, vocab]`` after ``x`` (the embedded tokens ``[rows, 1,
        embed]``, also the attention's target) and the attention averaged over layers ``[rows,
        1, widest src]`` (None unless ``need_attn``); the convolutions' buffers read and
        written in ``incremental_state`` as CausalConvolution.forward does. With
        ``output_columns`` (a shortlist), fc3's product is the decoder's own of those columns
        (its bits for each: a shortlist of every word gives those of none)."""
        rows = x.size(0)
        x = x.reshape(rows, self.embed).contiguous()
        target = x if target is x else target.reshape(rows, self.embed).contiguous()
        step = self.step
        # the memory groups' table, kept in the batch's state while its groups are the same list
        # (no sentence came or went): with the batch, not the step, as the memory it points into
        cached = incremental_state.get("kernel_groups")
        if cached is None or cached[0] is not groups or cached[1] != rows:
            cached = incremental_state["kernel_groups"] = groups, rows, *_group_table(groups, rows)
        _, _, group_table, widest_src = cached
        logits = x.new_empty((rows, self.vocab if output_columns is None else self.out_embed))
        attn = x.new_empty((rows, widest_src)) if need_attn else None
        with self._turn:  # the layers' table and the step's struct are filled in for this step
            states = self._lay_out_windows(decoder, incremental_state, x)
            self._lay_out_scratch(rows, widest_src)
            step.rows, step.groups, step.group = rows, len(groups), group_table
            step.x, step.target = x.data_ptr(), target.data_ptr()
            if output_columns is None:
                step.logits = logits.data_ptr()
            else:  # fc2's rows into logits, fc3's columns below
                step.logits, step.hidden = None, logits.data_ptr()
            step.attn = None if attn is None else attn.data_ptr()
            step.attn_width = widest_src
            step.threads = torch.get_num_threads()
            step.failed = 0
            done = self.run(ctypes.byref(step), self.table)
            failed = step.failed
        if done is None:
            if failed == 4:
                raise ValueError("a beam order outside the convolution's buffer")
            raise MemoryError(f"no memory to quantize {rows} rows")
        for conv, window, _, _ in states:
            k = conv.kernel_size
            view = window.view(rows, k, conv.in_channels)
            conv.set_incremental_state(incremental_state, "input_buffer", view[:, 1:])
            conv.set_incremental_state(incremental_state, "order", None)
        if output_columns is not None:
            logits = decoder._output_columns(logits, output_columns)
        return logits.unsqueeze(1), None if attn is None else attn.unsqueeze(1)

    def _lay_out_windows(self, decoder: nn.Module, incremental_state: dict, x: Tensor) -> list:
        """Point each convolution's entry at its buffer and pending beam order in
        ``incremental_state`` and at this step's window (whose last frames are its next
        buffer); the tensors read, kept alive through the call: (conv, window, buffer, order)
        per convolution wider than one frame."""
        rows = x.size(0)
        sizes = [rows * k * c if k > 1 else 0
                 for k, c in zip(self.kernel_sizes, self.in_channels, strict=True)]  # fmt: skip
        windows = x.new_empty(sum(sizes)).split(sizes)
        states = []
        for entry, conv, window in zip(self.table, decoder.convolutions, windows, strict=True):
            if conv.kernel_size == 1:
                continue
            buffer = conv.get_incremental_state(incremental_state, "input_buffer")
            order = conv.get_incremental_state(incremental_state, "order")
            if buffer is None:
                entry.buffer, entry.buffer_stride = None, 0
            else:
                if buffer.stride()[1:] != (conv.in_channels, 1):  # frames consecutive
                    buffer = buffer.contiguous()
                entry.buffer, entry.buffer_stride = buffer.data_ptr(), buffer.stride(0)
                entry.order_rows = buffer.size(0)
                if order is None and buffer.size(0) != rows:
                    raise ValueError("a convolution's buffer has other rows than the step")
            if order is not None:
                order = order.to(torch.int64).contiguous()
            entry.order = None if order is None else order.data_ptr()
            entry.window = window.data_ptr()
            states.append((conv, window, buffer, order))
        return states

    def _lay_out_scratch(self, rows: int, width: int) -> None:
        """Point the step's scratch at a buffer for ``rows`` rows and attention ``width``."""
        c, e = self.widest, self.embed
        sizes = [(self.layers + 1) * c, 2 * c, c, c, e, e, width, self.out_embed]
        if self._scratch.numel() < rows * sum(sizes):
            self._scratch = torch.empty(rows * sum(sizes))
        at = self._scratch.data_ptr()
        for name, size in zip(_SCRATCH, sizes, strict=True):
            setattr(self.step, name, at)
            at += 4 * rows * size


def _group_table(groups: list[tuple[dict, int]], rows: int) -> tuple[Any, int]:
    """The memory groups (each a pool's memory and its rows) as the C step reads them, and the
    widest group's source width."""
    table = (_Group * len(groups))()
    widest_src, first = 0, 0
    for entry, (memory, group_rows) in zip(table, groups, strict=True):
        keys, values, bias, scale = (memory[k] for k in ("keys", "values", "bias", "scale"))
        sentences, _, src = keys.shape
        if (
            keys.stride(2) != 1
            or values.stride(2) != 1
            or group_rows % sentences
            or (keys.dtype != torch.float32 or values.dtype != torch.float32)
        ):
            raise ValueError("a memory group is not sentence_attention's layout")
        entry.keys, entry.values, entry.scale = keys.data_ptr(), values.data_ptr(), scale.data_ptr()
        entry.k_sentence, entry.k_dim = keys.stride(0), keys.stride(1)
        entry.v_sentence, entry.v_src = values.stride(0), values.stride(1)
        entry.scale_stride = scale.stride(0)
        if bias is not None:
            if bias.stride(2) != 1:
                raise ValueError("a memory bias's positions must be consecutive")
            entry.bias, entry.bias_sentence = bias.data_ptr(), bias.stride(0)
        entry.sentences, entry.rows, entry.src = sentences, group_rows, src
        widest_src = max(widest_src, src)
        first += group_rows
    if first != rows:
        raise ValueError("the groups' rows must add up to the step's")
    return table, widest_src


_SCRATCH = ("outputs", "wide", "residual", "glued", "query", "context", "probs", "hidden")

# each decoder's (key, step, checked), the step None where it does not serve; the key checked
# again after each encoder forward (recheck); dropped with the kernels
_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
native_library.on_forget(_steps.clear)


_version, _data_ptr = operator.attrgetter("_version"), torch.Tensor.data_ptr


def _key(decoder: nn.Module) -> tuple:
    """What the step's pointers depend on: the int8 / bf16 switches, the parameters' versions
    and storage (a parameter replaced is another storage)."""
    parameters = list(decoder.parameters())
    return (
        bool(decoder.fc1.int8_products),
        bool(decoder.fc1.bf16_products),
        tuple(map(_version, parameters)),
        tuple(map(_data_ptr, parameters)),
    )


def recheck(decoder: nn.Module) -> None:
    """Check ``decoder``'s parameters against its step's key at its next step (called at each
    encoder forward, as TransformerWeights.current is: not at every step, some 10 us for 40
    parameters)."""
    kept = _steps.get(decoder)
    if kept is not None:
        _steps[decoder] = (*kept[:2], False)


def forget(decoder: nn.Module) -> None:
    """Drop ``decoder``'s step (its parameters may change behind their version counters: fairseq's
    optimizers write through ``p.data`` between ``train()`` and ``eval()``, which call this)."""
    _steps.pop(decoder, None)


def step_of(decoder: nn.Module, x: Tensor, groups: list[tuple[dict, int]]) -> ConvS2SStep | None:
    """The decoder's step in one call for float32 rows like ``x`` over the memory ``groups``
    where it serves them (CPU, float32, plain tensors, no autograd, inference, the kernels built,
    every product on our kernels, our sentence attention taken at the embedding's width), else
    None. A tensor subclass (a device's stand-in, a wrapper whose torch functions mean more)
    keeps the calls one at a time: the step's C code would pass it by."""
    if (
        type(x) is not Tensor
        or any(type(memory["keys"]) is not Tensor for memory, _ in groups)
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
        or decoder.training
        or not available()
    ):
        return None
    kept = _steps.get(decoder)
    if kept is not None and kept[2]:  # checked since the last encoder forward
        return kept[1]
    key = _key(decoder)
    if kept is not None and kept[0] == key:
        _steps[decoder] = (key, kept[1], True)
        return kept[1]
    step = None
    if sentence_attention.taken(decoder.fc1.in_features):
        try:
            step = ConvS2SStep(decoder)
        except (ValueError, AttributeError):
            step = None
    _steps[decoder] = (key, step, True)
    return step
