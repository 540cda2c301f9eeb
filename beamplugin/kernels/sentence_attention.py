"""Attention of each sentence's rows (its beams) over the sentence's one memory, one head, in one
call for every sentence: float32 on the CPU, through our kernel (``native/attention.c``'s
``sentence_attention``).

torch's batched products take a sentence's few rows at a fraction of the multiply-add rate
(``baddbmm`` and ``bmm`` of ``[sentences, 5, 256]`` by ``[sentences, 256, 48]``: a few GFLOPS),
and a softmax and a scaling each go over memory again. The kernel reads a sentence's keys and
values once for all its rows, in register tiles as the products', the softmax and the scale in
the same call. Each row is computed alone, in an order that does not depend on the rows beside
it, the tile, the vector width or the padding before its source, so a sentence gets the same
bits alone or batched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from beamplugin.kernels import native_library, trials
from beamplugin.kernels.native_library import INT, POINTER, SIZE, threads_for
from beamplugin.kernels.trials import Trial


@native_library.cached
def _kernel() -> Callable[..., Any] | None:
    """attention.c's ``sentence_attention`` (None where it cannot be built)."""
    signature = [POINTER, SIZE, POINTER, SIZE, SIZE, POINTER, SIZE, SIZE, POINTER, SIZE]
    signature += [POINTER, SIZE, POINTER, SIZE, POINTER, SIZE, SIZE, SIZE, SIZE, INT]
    return native_library.function("attention", "sentence_attention", signature)


def serves(query: Tensor) -> bool:
    """Whether attention of ``query`` (``[..., embed]``) runs here: float32, on the CPU, without
    autograd, and :func:`taken` at its width."""
    return (
        query.dtype == torch.float32
        and query.device.type == "cpu"
        and not torch.is_grad_enabled()
        and taken(query.size(-1))
    )


def taken(embed: int) -> bool:
    """Whether our kernel is built and faster than torch's for ``embed``-wide attention
    (beamplugin.kernels.trials)."""
    return _kernel() is not None and trials.ours_is_faster(
        "sentence attention", (embed,), lambda: trial(embed)
    )


def trial(embed: int, sentences: int = 16, rows: int = 5, src: int = 32) -> Trial:
    """A beam's rows of ``sentences`` sentences over ``src`` source positions, by our kernel
    against torch's batched products, softmax and scaling."""
    query = torch.randn(sentences, rows, embed)
    keys, values = torch.randn(sentences, embed, src), torch.randn(sentences, src, embed)
    bias, scale = torch.zeros(sentences, 1, src), torch.ones(sentences, 1, 1)
    out = torch.empty(sentences * rows, embed)

    def torchs() -> None:
        attn = torch.softmax(torch.baddbmm(bias, query, keys), -1)
        torch.mul(torch.bmm(attn, values), scale)

    return Trial(lambda: attend(query, keys, values, bias, scale, out, False), torchs, [()])


def attend(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    out: Tensor,
    need_weights: bool,
) -> Tensor | None:
    """The context of ``query`` ``[sentences, rows, embed]`` (each sentence's rows over its own
    memory) into ``out`` ``[sentences x rows, embed]`` (contiguous rows): ``softmax(bias + q
    keys) values x scale`` for ``keys`` ``[sentences, embed, src]``, ``values`` ``[sentences,
    src, embed]`` (source positions consecutive), ``bias`` ``[sentences, 1, src]`` (0 or -inf;
    None: no padding) and ``scale`` ``[sentences, 1, 1]``. Returns the weights ``[sentences,
    rows, src]`` if ``need_weights``."""
    kernel = _kernel()
    assert kernel is not None, "check serves() first"
    sentences, rows, embed = query.shape
    src = keys.size(2)
    if keys.shape != (sentences, embed, src) or values.shape != (sentences, src, embed):
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} do not "
                         f"fit {sentences} sentences of {embed}-wide queries")  # fmt: skip
    if bias is not None and (bias.shape != (sentences, 1, src) or bias.stride(2) != 1):
        raise ValueError(f"the bias must be [{sentences}, 1, {src}], positions consecutive")
    if scale.numel() != sentences or keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError("a scale a sentence; keys' positions and values' dims consecutive")
    tensors = (query, keys, values, scale, out) + (() if bias is None else (bias,))
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("float32 tensors on the CPU only")
    if query.stride(2) != 1 or (sentences > 1 and query.stride(0) != rows * query.stride(1)):
        raise ValueError("the query's rows must be evenly spaced, dims consecutive")
    if out.shape != (sentences * rows, embed) or out.stride(1) != 1:
        raise ValueError(f"out must be [{sentences * rows}, {embed}], dims consecutive")
    probs = query.new_empty((sentences, rows, src)) if need_weights else None
    kernel(
        query.data_ptr(),
        query.stride(1),
        keys.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        values.data_ptr(),
        values.stride(0),
        values.stride(1),
        None if bias is None else bias.data_ptr(),
        0 if bias is None else bias.stride(0),
        scale.data_ptr(),
        scale.stride(0),
        out.data_ptr(),
        out.stride(0),
        None if probs is None else probs.data_ptr(),
        sentences,
        rows,
        embed,
        src,
        threads_for(sentences * rows * src * embed * 2),
    )
    return probs
