"""Our attention kernel for a transformer decoder step (beamplugin/kernels/native/attention.c):
fairseq's softmax(bias + q . K) V up to rounding, this step's key and value written into the
history, each row's columns read from the slots its table of sources names, a row's bits
independent of the rows beside it, the masked columns before its own, the threads; and the
decoder taking torch's operations where it cannot be built."""

import math

import pytest
import torch
import torch.nn.functional as F

from beamplugin.kernels import float_attention

pytestmark = pytest.mark.exact  # run again per instruction set by make test

needs_compiler = pytest.mark.skipif(
    float_attention._kernels() is None,
    reason="not built here (no C compiler, or BEAMPLUGIN_ISA=off)",
)
HEADS, HEAD_DIM = 4, 64
EMBED = HEADS * HEAD_DIM


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor):
    """fairseq's attention in float64: query [n, head_dim], keys and values [n, width,
    head_dim], bias [n, width]."""
    scores = torch.einsum("nd,nwd->nw", query.double(), keys.double()) + bias.double()
    probs = F.softmax(scores, dim=-1)
    return torch.einsum("nw,nwd->nd", probs, values.double()), probs


def history(rows: int, width: int, columns: int = 64, seed: int = 0):
    """A layer's keys and values as the decoder's history holds them: the last ``width`` of a
    buffer's ``columns``."""
    torch.manual_seed(seed)
    buffer = torch.randn(2, rows, HEADS, columns, HEAD_DIM)
    return buffer[0, :, :, columns - width :], buffer[1, :, :, columns - width :]


def own_slots(rows: int, width: int) -> torch.Tensor:
    """Every column of row ``r`` in slot ``r``."""
    return torch.arange(rows).view(rows, 1).expand(rows, width).contiguous()


def own_steps_bias(steps: list[int], width: int) -> torch.Tensor:
    bias = torch.full((len(steps), width), -math.inf)
    for row, own in enumerate(steps):
        bias[row, width - own :] = 0.0
    return bias


@needs_compiler
def test_self_attention_writes_this_step_and_attends_over_the_columns_its_sources_name():
    rows, slots, width = 7, 10, 32
    keys, values = history(slots, width)
    qkv = torch.randn(rows, 3 * EMBED)
    steps = [1, 2, 5, 9, 17, 31, 32]
    bias = own_steps_bias(steps, width)
    torch.manual_seed(4)
    sources = torch.randint(0, slots, (rows, width))  # a reorder's ancestors, column by column
    sources[:, -1] = torch.arange(rows)
    before_keys, before_values = keys.clone(), values.clone()
    out = float_attention.self_attention(qkv, keys, values, sources, bias)
    split = qkv.view(rows, 3, HEADS, HEAD_DIM)
    assert torch.equal(keys[:rows, :, -1], split[:, 1])
    assert torch.equal(values[:rows, :, -1], split[:, 2])
    written = torch.zeros_like(keys, dtype=torch.bool)
    written[:rows, :, -1] = True
    assert torch.equal(keys[~written], before_keys[~written])  # nothing else written
    assert torch.equal(values[~written], before_values[~written])
    columns = torch.arange(width)
    own_keys = keys.transpose(1, 2)[sources, columns].transpose(1, 2)  # rows, heads, width, dim
    own_values = values.transpose(1, 2)[sources, columns].transpose(1, 2)
    expected, _ = reference(
        split[:, 0].reshape(-1, HEAD_DIM),
        own_keys.reshape(rows * HEADS, width, HEAD_DIM),
        own_values.reshape(rows * HEADS, width, HEAD_DIM),
        bias.repeat_interleave(HEADS, 0),
    )
    torch.testing.assert_close(out.double(), expected.view(rows, EMBED), rtol=1e-5, atol=1e-5)


@needs_compiler
def test_a_rows_self_attention_has_the_same_bits_alone_batched_wider_and_threaded():
    rows, width = 9, 32
    keys, values = history(rows, width, seed=1)
    qkv = torch.randn(rows, 3 * EMBED)
    steps = [3, 8, 1, 16, 20, 5, 32, 2, 11]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        everything = float_attention.self_attention(
            qkv, keys, values, own_slots(rows, 32), own_steps_bias(steps, 32)
        )
        torch.set_num_threads(2)
        for row, own in enumerate(steps):
            for wide in {lane for lane in (16, 32) if lane >= own}:
                k, v = keys[row : row + 1, :, 32 - wide :], values[row : row + 1, :, 32 - wide :]
                alone = float_attention.self_attention(
                    qkv[row : row + 1], k, v, own_slots(1, wide), own_steps_bias([own], wide)
                )
                assert torch.equal(alone[0], everything[row]), (row, wide)
    finally:
        torch.set_num_threads(threads)


def pool_memory(sentences: int, src: int, pool_width: int, seed: int = 2):
    """Keys [sentences, heads, head_dim, src] and values [sentences, heads, src, head_dim] as a
    memory pool's views give them (the last ``src`` of ``pool_width`` positions), left-padded
    sources: the bias [sentences, 1, 1, src]."""
    torch.manual_seed(seed)
    keys = torch.randn(sentences, HEADS, HEAD_DIM, pool_width)[..., pool_width - src :]
    values = torch.randn(sentences, HEADS, pool_width, HEAD_DIM)[:, :, pool_width - src :]
    lengths = torch.randint(1, src + 1, (sentences,))
    bias = torch.zeros(sentences, 1, 1, pool_width)[..., pool_width - src :]
    for sentence, length in enumerate(lengths.tolist()):
        bias[sentence, ..., : src - length] = -math.inf
    return keys, values, bias


@needs_compiler
def test_cross_attention_reads_each_sentences_memory():
    sentences, each, src = 3, 5, 20
    keys, values, bias = pool_memory(sentences, src, pool_width=48)
    query = torch.randn(sentences * each, EMBED)
    out = torch.empty_like(query)
    mean = float_attention.cross_attention(query, keys, values, bias, out, need_weights=True)
    sentence = torch.arange(sentences).repeat_interleave(each)
    expected, expected_probs = reference(
        query.view(-1, HEADS, HEAD_DIM).reshape(-1, HEAD_DIM),
        keys[sentence].transpose(2, 3).reshape(-1, src, HEAD_DIM),
        values[sentence].reshape(-1, src, HEAD_DIM),
        bias[sentence].view(-1, 1, src).expand(-1, HEADS, src).reshape(-1, src),
    )
    torch.testing.assert_close(out.double(), expected.view(-1, EMBED), rtol=1e-5, atol=1e-5)
    expected_probs = expected_probs.view(-1, HEADS, src)
    torch.testing.assert_close(mean.double(), expected_probs.mean(1), rtol=1e-5, atol=1e-6)
    assert mean[bias[sentence].view(-1, src).isinf()].eq(0).all()
    again = torch.empty_like(query)
    assert float_attention.cross_attention(query, keys, values, bias, again, False) is None
    assert torch.equal(again, out)


@needs_compiler
def test_a_sentences_cross_attention_has_the_same_bits_alone_and_batched():
    sentences, each, src = 6, 5, 32
    keys, values, bias = pool_memory(sentences, src, pool_width=64, seed=3)
    query = torch.randn(sentences * each, EMBED)
    everything = torch.empty_like(query)
    float_attention.cross_attention(query, keys, values, bias, everything, False)
    for s in range(sentences):
        rows = slice(s * each, (s + 1) * each)
        alone = torch.empty(each, EMBED)
        float_attention.cross_attention(
            query[rows], keys[s : s + 1], values[s : s + 1], bias[s : s + 1], alone, False
        )
        assert torch.equal(alone, everything[rows])


@needs_compiler
def test_bad_layouts_are_refused():
    keys, values = history(2, 16)
    qkv, bias = torch.randn(2, 3 * EMBED), own_steps_bias([1, 2], 16)
    sources = own_slots(2, 16)
    strided = torch.randn(2, 2, HEADS, 16, 2 * HEAD_DIM)[..., ::2]  # dimensions 2 floats apart
    with pytest.raises(ValueError, match="head_dim floats apart"):
        float_attention.self_attention(qkv, strided[0], strided[1], sources, bias)
    with pytest.raises(ValueError, match="contiguous"):
        float_attention.self_attention(qkv, keys, values, sources, bias.t().contiguous().t())
    with pytest.raises(ValueError, match="differ"):
        float_attention.self_attention(qkv[:, :-1], keys, values, sources, bias)
    with pytest.raises(ValueError, match="int64"):
        float_attention.self_attention(qkv, keys, values, sources.int(), bias)
    for outside in (2, -1):  # no slot: the kernel would read outside the history
        bad = sources.clone()
        bad[1, 3] = outside
        with pytest.raises(ValueError, match="must be slots"):
            float_attention.self_attention(qkv, keys, values, bad, bias)
    with pytest.raises(ValueError, match="rows 2 at most"):  # more rows than slots to write
        float_attention.self_attention(
            torch.randn(3, 3 * EMBED),
            keys,
            values,
            own_slots(3, 16) % 2,
            own_steps_bias([1] * 3, 16),
        )
    k, v, b = pool_memory(2, 8, 16)
    with pytest.raises(ValueError, match="as many for each sentence"):
        float_attention.cross_attention(torch.randn(3, EMBED), k, v, b, torch.empty(3, EMBED), 0)
    with pytest.raises(ValueError, match="other shapes"):
        float_attention.cross_attention(torch.randn(4, EMBED), k, v[:, :, 1:], b,
                                        torch.empty(4, EMBED), 0)  # fmt: skip


@needs_compiler
def test_without_the_kernel_the_attention_is_not_served(kernels_for):
    heads = (HEADS, EMBED // HEADS)
    with torch.no_grad():
        assert float_attention.serves(torch.zeros(2, EMBED), *heads)
        assert not float_attention.serves(torch.zeros(2, EMBED, dtype=torch.bfloat16), *heads)
    assert not float_attention.serves(torch.zeros(2, EMBED), *heads)  # autograd on
    kernels_for("off")
    with torch.no_grad():
        assert not float_attention.serves(torch.zeros(2, EMBED), *heads)
