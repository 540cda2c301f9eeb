"""Checkpoints loaded to decode are mapped from their files (the weights are the file's pages),
decode the same bits as a copied load, and hand back the pages our kernels do not read."""

from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils
from test_pages import resident_pages

from beamplugin import SequenceGenerator
from beamplugin.fairseq_plugin.precision import cast_for_decoding
from beamplugin.models import transformer_weights
from beamplugin.models.transformer_weights import TransformerWeights
from beamplugin.runtime import pages
from beamplugin.runtime.pages import FileMappings
from benchmarks.models import build

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """A pre-norm transformer with shared embeddings (an NLLB-shaped model, tiny)."""
    return build("nllb-600m", "tiny", tmp_path_factory.mktemp("models"))


def load(checkpoint: tuple[Path, Path], monkeypatch, mapped: bool):
    monkeypatch.setenv("BEAMPLUGIN_MMAP", "1" if mapped else "0")
    path, data = checkpoint
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides={"data": str(data)}
    )
    return models[0].eval(), task


def in_the_file(tensor: torch.Tensor) -> bool:
    start = tensor.data_ptr()
    return FileMappings().backs(start, start + tensor.numel() * tensor.element_size())


def test_a_load_to_decode_maps_the_weights_and_keeps_the_models_ties(checkpoint, monkeypatch):
    mapped, _ = load(checkpoint, monkeypatch, mapped=True)
    copied, _ = load(checkpoint, monkeypatch, mapped=False)
    theirs = copied.state_dict()
    assert mapped.state_dict().keys() == theirs.keys()
    for name, tensor in mapped.state_dict().items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    for model, file_backed in ((mapped, True), (copied, False)):
        assert model.decoder.output_projection.weight is model.encoder.embed_tokens.weight
        assert model.decoder.embed_tokens.weight is model.encoder.embed_tokens.weight
        assert in_the_file(model.decoder.layers[0].fc1.weight) is file_backed
    # the one shared embedding is listed once, as fairseq built it
    assert sum(p.numel() for p in mapped.parameters()) == sum(
        p.numel() for p in copied.parameters()
    )
    # fairseq-train's loads (which write the weights) read the file into memory as before
    state = checkpoint_utils.load_checkpoint_to_cpu(str(checkpoint[0]))
    assert not in_the_file(state["model"]["decoder.layers.0.fc1.weight"])


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_a_mapped_model_decodes_the_same_bits_and_hands_back_what_the_kernels_carry(
    checkpoint, monkeypatch, precision
):
    results, models, asked = {}, {}, []

    def paging_out(weight: torch.Tensor, mappings: FileMappings) -> int:
        asked.append(weight.data_ptr())
        return pages.page_out(weight, mappings)

    monkeypatch.setattr(transformer_weights, "page_out", paging_out)
    for mapped in (False, True):
        model, task = load(checkpoint, monkeypatch, mapped)
        cast_for_decoding([model], precision)
        task.load_dataset("test")
        dataset = task.dataset("test")
        batch = dataset.collater([dataset[i] for i in range(4)])
        generator = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=10)
        results[mapped], models[mapped] = generator.generate([model], batch), model
    for ours, copied in zip(results[True], results[False], strict=True):
        for hypothesis, reference in zip(ours, copied, strict=True):
            assert torch.equal(hypothesis["tokens"], reference["tokens"])
            assert torch.equal(hypothesis["positional_scores"], reference["positional_scores"])
    # the weights our kernels multiply are not read again: their pages went back to the file
    # (where torch's kernels multiply a weight, its pages stay; the copied model says which)
    model, prepared = models[True], TransformerWeights(models[False]).current()
    layer, weights = model.decoder.layers[0], prepared.decoder_layers[0]
    carried = [(layer.fc1, weights.fc1), (layer.fc2, weights.fc2),
               (layer.self_attn.q_proj, weights.self_qkv),
               (model.encoder.layers[0].fc1, prepared.encoder_layers[0].fc1)]  # fmt: skip
    ours = [module.weight for module, product in carried if product.on_our_kernels()]
    for module, _ in carried:
        assert in_the_file(module.weight)
    assert all(weight.data_ptr() in asked for weight in ours)
    # Linux reclaims on a best-effort basis (pages faulted in moments before, on another CPU,
    # may stay once): asked again, none stays, and decoding again reads none back
    for weight in ours:
        pages.page_out(weight, FileMappings())
    generator.generate([model], batch)
    for weight in ours:
        assert resident_pages(weight) == 0


def test_a_float16_checkpoint_loads_as_fairseq_loads_it(checkpoint, monkeypatch, tmp_path):
    path, data = checkpoint
    state = torch.load(path, weights_only=False)
    weights = state["model"]
    state["model"] = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
    half = tmp_path / "half.pt"
    torch.save(state, half)
    model, _ = load((half, data), monkeypatch, mapped=True)
    weight = model.decoder.layers[0].fc1.weight
    assert weight.dtype == torch.float32 and not in_the_file(weight)
    assert torch.equal(weight, state["model"]["decoder.layers.0.fc1.weight"].float())
