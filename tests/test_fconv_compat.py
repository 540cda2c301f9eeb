"""fairseq's fconv and our convs2s are interchangeable: same parameter names and shapes for every
named architecture, an fconv state dict loads strictly and computes the same outputs bit for bit
(full pass and incremental), and fairseq's own SequenceGenerator finds the same translations
with the same scores with either model."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY
from fairseq.models.fconv import FConvModel
from fairseq.sequence_generator import SequenceGenerator
from toy_sources import left_padded_sources

from beamplugin.models.convs2s import ConvS2SModel

ARCHS = ["iwslt_de_en", "wmt_en_ro", "wmt_en_de", "wmt_en_fr"]
MODEL_OPTIONS = [
    "dropout", "encoder_embed_dim", "encoder_layers", "decoder_embed_dim", "decoder_layers",
    "decoder_out_embed_dim", "decoder_attention", "share_input_output_embed",
]
SMALL_SHAPES = {
    "plain": dict(encoder_layers="[(16, 3)] * 2", decoder_layers="[(16, 3)] * 2"),
    "widths_and_residuals": dict(
        encoder_layers="[(16, 2), (24, 4), (24, 5, 2)]",
        decoder_layers="[(16, 4), (24, 2), (24, 1, 0), (16, 5, 2)]",
        decoder_attention="[True, False, True, True]",
    ),
    "shared_output_embedding": dict(
        encoder_layers="[(16, 3)]", decoder_layers="[(16, 3), (16, 2)]",
        decoder_out_embed_dim=12, share_input_output_embed=True,
    ),
}


def build(model_class, arch: str, dictionary: Dictionary, **options):
    args = Namespace(max_source_positions=64, max_target_positions=64, **options)
    ARCH_CONFIG_REGISTRY[arch](args)
    task = Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return model_class.build_model(args, task), args


def fconv_with_random_weights(dictionary: Dictionary, std: float = 0.3, **options) -> FConvModel:
    torch.manual_seed(0)
    options = dict(encoder_embed_dim=12, decoder_embed_dim=12, decoder_out_embed_dim=10) | options
    fconv, _ = build(FConvModel, "fconv", dictionary, **options)
    with torch.no_grad():  # random g too, so the weight normalisation matters
        for name, param in fconv.named_parameters():
            if name != "decoder.version":
                param.normal_(0.0, std)
    return fconv.eval()


def convs2s_loaded_from(fconv: FConvModel, dictionary: Dictionary, **options) -> ConvS2SModel:
    options = dict(encoder_embed_dim=12, decoder_embed_dim=12, decoder_out_embed_dim=10) | options
    torch.manual_seed(1)
    ours, _ = build(ConvS2SModel, "convs2s", dictionary, **options)
    ours.load_state_dict(fconv.state_dict(), strict=True)
    return ours.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_named_architectures_have_fconvs_options_names_and_shapes(toy_dictionary, arch):
    with torch.device("meta"):  # shapes only: the wmt models are large
        fconv, fconv_args = build(FConvModel, f"fconv_{arch}", toy_dictionary)
        ours, our_args = build(ConvS2SModel, f"convs2s_{arch}", toy_dictionary)
    for option in MODEL_OPTIONS:
        assert getattr(our_args, option) == getattr(fconv_args, option), option
    expected = {name: tuple(t.shape) for name, t in fconv.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in ours.state_dict().items()} == expected
    assert ours.max_positions() == fconv.max_positions()


@pytest.mark.parametrize("source_lengths", [[9, 5, 7], [6, 6, 6]], ids=["padded", "unpadded"])
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_fconv_state_dict_gives_the_same_outputs(toy_dictionary, shape, source_lengths):
    """Up to float rounding, in the full pass and step by step: the weights mean the same in
    both models (a misplaced or mis-scaled weight moves outputs by far more). Not bit for bit:
    our inference products take packed weights, which give a row the same bits whatever rows
    share its product, where fconv's go through MKL (beamplugin.modules.packed_weights)."""
    fconv = fconv_with_random_weights(toy_dictionary, **SMALL_SHAPES[shape])
    ours = convs2s_loaded_from(fconv, toy_dictionary, **SMALL_SHAPES[shape])
    src = left_padded_sources(toy_dictionary, source_lengths)
    prev = torch.randint(toy_dictionary.nspecial, len(toy_dictionary), (3, 8))
    prev[:, 0] = toy_dictionary.eos()
    with torch.no_grad():
        expected_logits, expected_attn = fconv(src, None, prev)
        logits, attn = ours(src, None, prev)
        assert_rounding_apart(logits, expected_logits)
        assert_rounding_apart(attn, expected_attn)

        fconv_out, our_out = fconv.encoder(src, None), ours.encoder(src)
        fconv_state: dict = {}
        our_state: dict = {}
        for step in range(1, prev.size(1) + 1):
            expected_logits, expected_attn = fconv.decoder(prev[:, :step], fconv_out, fconv_state)
            logits, attn = ours.decoder(prev[:, :step], our_out, our_state)
            assert_rounding_apart(logits, expected_logits)
            assert_rounding_apart(attn, expected_attn)


def assert_rounding_apart(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_fairseq_sequence_generator_finds_the_same_translations(toy_dictionary):
    shape = SMALL_SHAPES["widths_and_residuals"]
    # larger weights make the translations depend more on the source
    fconv = fconv_with_random_weights(toy_dictionary, std=1.0, **shape)
    with torch.no_grad():  # make eos likely, so sentences finish (and leave the batch) early
        fconv.decoder.fc3.bias[toy_dictionary.eos()] += 4.0
    ours = convs2s_loaded_from(fconv, toy_dictionary, **shape)
    src = left_padded_sources(toy_dictionary, [9, 5, 7, 3, 8, 6])
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(1).sum(1)}}

    def translate(model):
        generator = SequenceGenerator([model], toy_dictionary, beam_size=3, max_len_b=12)
        return generator.generate([model], sample)

    expected, found = translate(fconv), translate(ours)
    lengths = set()
    for expected_hypos, hypos in zip(expected, found, strict=True):
        assert len(hypos) == len(expected_hypos) == 3
        for expected_hypo, hypo in zip(expected_hypos, hypos, strict=True):
            assert torch.equal(hypo["tokens"], expected_hypo["tokens"])
            assert float(hypo["score"]) == pytest.approx(float(expected_hypo["score"]), abs=1e-5)
            assert_rounding_apart(hypo["positional_scores"], expected_hypo["positional_scores"])
            assert_rounding_apart(hypo["attention"], expected_hypo["attention"])
            lengths.add(len(hypo["tokens"]))
    assert len(lengths) > 1  # sentences finished at different steps


def test_version_1_fconv_state_dict_is_upgraded(toy_dictionary):
    """fconv checkpoints before decoder version 2 normalised conv weights over dim 0."""
    shape = SMALL_SHAPES["widths_and_residuals"]
    fconv = fconv_with_random_weights(toy_dictionary, **shape)
    old = fconv.state_dict()
    del old["decoder.version"]
    for index in range(4):
        prefix = f"decoder.convolutions.{index}."
        weight = torch._weight_norm(old[prefix + "weight_v"], old[prefix + "weight_g"], 2)
        old[prefix + "weight_v"] = weight * 2.0  # any v works: only its direction counts
        old[prefix + "weight_g"] = torch.norm_except_dim(weight, 2, 0)
    torch.manual_seed(1)
    ours, _ = build(ConvS2SModel, "convs2s", toy_dictionary, encoder_embed_dim=12,
                    decoder_embed_dim=12, decoder_out_embed_dim=10, **shape)
    ours.load_state_dict(old, strict=True)
    assert ours.decoder.version.item() == 2
    src = left_padded_sources(toy_dictionary, [6, 4])
    prev = torch.randint(toy_dictionary.nspecial, len(toy_dictionary), (2, 5))
    with torch.no_grad():
        expected = fconv(src, None, prev)[0]
        assert (ours.eval()(src, None, prev)[0] - expected).abs().max().item() <= 1e-5
