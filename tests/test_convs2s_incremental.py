"""Incremental decoding of our ConvS2S decoder equals its full forward pass: for several layer
specs and every kernel width 1..5, after reorders that permute, repeat and drop rows, and after
the weights change (the folded-weight caches must follow)."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.optim.nag import NAG
from toy_sources import left_padded_sources

from beamplugin.models.convs2s import ConvS2SModel
from beamplugin.modules import parse_attention_spec, parse_layer_spec
from beamplugin.modules.packed_weights import uses_packed_products

pytestmark = pytest.mark.exact  # run again per instruction set by make test

# (encoder layers, decoder layers, decoder attention): widths 1..5, channel changes (residual
# projections), residual distances 0 and 2, layers without attention.
LAYER_SPECS = [
    ("[(16, 1)] * 2", "[(16, 1)] * 2", "True"),
    ("[(16, 2), (24, 3)]", "[(16, 2), (24, 3)]", "True"),
    ("[(16, 3)]", "[(16, 4), (16, 5, 2), (24, 3, 0)]", "[True, False, True]"),
    ("[(24, 5), (16, 4)]", "[(24, 5)] * 2 + [(16, 1)]", "[False, False, True]"),
]
SRC_LEN, TGT_LEN = 7, 9


def build_model(
    dictionary: Dictionary,
    encoder_layers: str,
    decoder_layers: str,
    attention: str,
    seed: int = 0,
    out_embed_dim: int = 10,
) -> ConvS2SModel:
    torch.manual_seed(seed)
    args = Namespace(
        encoder_embed_dim=12,
        decoder_embed_dim=12,
        decoder_out_embed_dim=out_embed_dim,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        decoder_attention=attention,
        max_source_positions=64,
        max_target_positions=64,
    )
    task = Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    model = ConvS2SModel.build_model(args, task)
    with torch.no_grad():  # random g too, so the weight normalisation is not an identity
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def target_prefixes(dictionary: Dictionary, rows: int, length: int) -> torch.Tensor:
    prev = torch.randint(dictionary.nspecial, len(dictionary), (rows, length))
    prev[:, 0] = dictionary.eos()
    return prev


def decode_steps(model, prev, encoder_out, state, first_step, last_step):
    """Logits and attention of steps first_step..last_step (1-based prefix lengths)."""
    outputs = [model.decoder(prev[:, :step], encoder_out, state) for step in
               range(first_step, last_step + 1)]
    return torch.cat([o[0] for o in outputs], 1), torch.cat([o[1] for o in outputs], 1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= tolerance


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec", LAYER_SPECS)
def test_incremental_equals_full_forward(toy_dictionary, spec, dtype):
    model = build_model(toy_dictionary, *spec).to(dtype).eval()
    src = left_padded_sources(toy_dictionary, [SRC_LEN, 4, 6])
    prev = target_prefixes(toy_dictionary, 3, TGT_LEN)
    with torch.no_grad():
        full_logits, full_attn = model(src, None, prev)
        encoder_out = model.encoder(src)
        logits, attn = decode_steps(model, prev, encoder_out, {}, 1, TGT_LEN)
    assert_close(logits, full_logits, TOLERANCE[dtype])
    assert_close(attn, full_attn, TOLERANCE[dtype])
    # attention never lands on source padding
    assert attn[1, :, : SRC_LEN - 4].abs().max().item() == 0.0


def test_incremental_equals_full_forward_with_the_onednn_output_projection():
    dictionary = Dictionary()
    for index in range(4096):
        dictionary.add_symbol(f"word{index}")
    model = build_model(dictionary, *LAYER_SPECS[2], out_embed_dim=64).eval()
    src = left_padded_sources(dictionary, [SRC_LEN, 4, 6])
    prev = target_prefixes(dictionary, 3, TGT_LEN)
    with torch.no_grad():
        assert uses_packed_products(prev.float(), model.decoder.fc3.weight)
        full_logits, _ = model(src, None, prev)
        logits, _ = decode_steps(model, prev, model.encoder(src), {}, 1, TGT_LEN)
    assert_close(logits, full_logits, 1e-5)
    with torch.enable_grad():  # training computes the same logits with F.linear
        assert_close(model(src, None, prev)[0].detach(), full_logits, 1e-5)


@pytest.mark.parametrize("spec", LAYER_SPECS)
def test_reorder_that_permutes_repeats_and_drops_rows(toy_dictionary, spec):
    model = build_model(toy_dictionary, *spec).double().eval()
    src = left_padded_sources(toy_dictionary, [SRC_LEN, 3, 5, 6])
    prev = target_prefixes(toy_dictionary, 4, TGT_LEN)
    orders = {3: torch.tensor([2, 0, 2]), 6: torch.tensor([1, 0])}  # after steps 3 and 6
    rows = torch.arange(4)
    state: dict = {}
    with torch.no_grad():
        encoder_out = model.encoder(src)
        done = 0
        for step in (*orders, TGT_LEN):
            logits, attn = decode_steps(model, prev, encoder_out, state, done + 1, step)
            # the reference: a full pass over these rows' sources and their whole prefixes
            full_logits, full_attn = model(src[rows], None, prev)
            assert_close(logits, full_logits[:, done:step], 1e-10)
            assert_close(attn, full_attn[:, done:step], 1e-10)
            if step in orders:
                new_order = orders[step]
                # fairseq's entry point: must reorder every buffer exactly once
                model.decoder.reorder_incremental_state_scripting(state, new_order)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
                rows = rows[new_order]
                # reordered rows continue with different tokens from here on
                prev = torch.cat(
                    (prev[new_order, :step], target_prefixes(toy_dictionary, len(rows),
                                                             TGT_LEN)[:, step:]), dim=1)
            done = step


@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, NAG])
def test_decoding_follows_weight_changes(toy_dictionary, optimizer_class):
    model = build_model(toy_dictionary, *LAYER_SPECS[2]).eval()
    src = left_padded_sources(toy_dictionary, [SRC_LEN, 5])
    prev = target_prefixes(toy_dictionary, 2, TGT_LEN)

    def incremental_logits(m: ConvS2SModel) -> torch.Tensor:
        with torch.no_grad():
            return decode_steps(m, prev, m.encoder(src), {}, 1, TGT_LEN)[0]

    def fresh_copy() -> ConvS2SModel:
        # new modules, so nothing cached: the reference for the current weights
        copy = build_model(toy_dictionary, *LAYER_SPECS[2], seed=1).eval()
        copy.load_state_dict(model.state_dict())
        return copy

    before = incremental_logits(model)  # fills the folded-weight caches
    model.train()
    # fairseq's NAG writes through p.data, which bumps no version counter (as fairseq's Adam)
    optimizer = optimizer_class(model.parameters(), lr=0.5)
    logits, _ = model(src, None, prev)
    logits.logsumexp(-1).sum().backward()
    optimizer.step()
    model.eval()
    after = incremental_logits(model)
    assert (after - before).abs().max().item() > 1e-3
    assert_close(after, incremental_logits(fresh_copy()), 1e-6)

    # loading other weights and casting the model must also reach the caches
    other = build_model(toy_dictionary, *LAYER_SPECS[2], seed=2)
    model.load_state_dict(other.state_dict())
    assert_close(incremental_logits(model), incremental_logits(fresh_copy()), 1e-6)
    model.double()
    prev_logits = incremental_logits(model)
    assert prev_logits.dtype == torch.float64
    assert_close(prev_logits, incremental_logits(fresh_copy().double()), 1e-12)


def test_weight_norm_parameters_get_gradients(toy_dictionary):
    model = build_model(toy_dictionary, *LAYER_SPECS[1]).train()
    src = left_padded_sources(toy_dictionary, [SRC_LEN, 5])
    logits, _ = model(src, None, target_prefixes(toy_dictionary, 2, TGT_LEN))
    logits.sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_layer_options_parse_fconv_notation():
    assert parse_layer_spec("[(256, 3)] * 2 + [(512, 1, 0)]", "--encoder-layers") == [
        (256, 3, 1), (256, 3, 1), (512, 1, 0)]
    assert parse_attention_spec("True", 3, "--decoder-attention") == [True] * 3
    assert parse_attention_spec("[True, False]", 2, "--decoder-attention") == [True, False]


@pytest.mark.parametrize(
    "text, problem",
    [
        ("__import__('os').system('true')", "only list/tuple literals"),
        ("[(256, 3)", "not a valid expression"),
        ("[]", "non-empty list"),
        ("[(256,)]", "layer 0"),
        ("[(256, 3), (256, 3, 3)]", "residual distance 0..2"),
        ("[(256, 0)]", "width >= 1"),
    ],
)
def test_bad_layer_options_are_refused_clearly(text, problem):
    with pytest.raises(ValueError, match="--decoder-layers") as error:
        parse_layer_spec(text, "--decoder-layers")
    assert problem in str(error.value)


def test_attention_option_must_match_layer_count():
    with pytest.raises(ValueError, match="list of 3 booleans"):
        parse_attention_spec("[True, False]", 3, "--decoder-attention")
