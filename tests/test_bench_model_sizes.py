"""benchmarks/models.py's transformers of the deployed sizes, built tiny: fairseq loads them,
ours decodes them as fairseq does, CTranslate2 converts them and decodes as many steps as
fairseq."""

import argparse
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

from beamplugin import SequenceGenerator
from benchmarks import generate, models

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN_B = 12  # a random model decodes to the limit: keep it short
SENTENCES = 4


def built(name: str, cache: Path) -> tuple[Path, Path, object, object]:
    """(checkpoint, data, model, task) of the tiny ``name`` built into ``cache``."""
    checkpoint, data = models.build(name, "tiny", cache)
    loaded, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data)}
    )
    return checkpoint, data, loaded[0].eval(), task


def test_build_writes_the_shape_and_test_split_and_is_reused(tmp_path):
    checkpoint, _, model, task = built("nllb-600m", tmp_path)
    layers, width, ffn, heads = models.TINY_SIZES
    assert len(task.source_dictionary) == len(task.target_dictionary)
    assert len(task.target_dictionary) == models.TINY_WORDS
    assert len(model.encoder.layers) == len(model.decoder.layers) == layers
    assert model.encoder.layers[0].normalize_before and model.decoder.layers[0].normalize_before
    assert model.encoder.layers[0].fc1.weight.shape == (ffn, width)
    assert model.decoder.layers[0].self_attn.num_heads == heads
    assert model.decoder.output_projection.weight is model.encoder.embed_tokens.weight
    task.load_dataset("test")
    dataset = task.dataset("test")
    assert len(dataset) == models.TEST_SENTENCES
    shortest, longest = models.SENTENCE_WORDS
    lengths = {len(dataset[i]["source"]) for i in range(len(dataset))}
    assert min(lengths) == shortest + 1 and max(lengths) == longest + 1  # EOS included
    written = checkpoint.stat().st_mtime_ns
    assert models.build("nllb-600m", "tiny", tmp_path)[0] == checkpoint
    assert checkpoint.stat().st_mtime_ns == written  # reused, not built again


@pytest.mark.parametrize("name", list(models.SHAPES))
def test_ours_gives_fairseqs_best_hypotheses(name, tmp_path):
    _, _, model, task = built(name, tmp_path)
    task.load_dataset("test")
    dataset = task.dataset("test")
    batch = dataset.collater([dataset[i] for i in range(SENTENCES)])
    options = dict(beam_size=generate.BEAM, max_len_a=0, max_len_b=MAX_LEN_B)
    dictionary = task.target_dictionary
    with torch.inference_mode():
        theirs = FairseqGenerator([model], dictionary, **options).generate([model], batch)
        ours = SequenceGenerator([model], dictionary, **options).generate([model], batch)
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine[0]["tokens"].tolist() == reference[0]["tokens"].tolist()
        assert float(mine[0]["score"]) == pytest.approx(float(reference[0]["score"]), abs=1e-4)


def test_ctranslate2_converts_and_decodes_as_many_steps_as_fairseq(tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    checkpoint, data, model, task = built("nllb-600m", tmp_path)
    converted = generate.ct2_model(str(checkpoint), str(data), None, tmp_path)
    task.load_dataset("test")
    dataset = task.dataset("test")
    dictionary = task.target_dictionary
    batch = dataset.collater([dataset[i] for i in range(SENTENCES)])
    generator = FairseqGenerator([model], dictionary, beam_size=generate.BEAM,
                                 max_len_a=0, max_len_b=MAX_LEN_B)  # fmt: skip
    with torch.inference_mode():
        fairseq_best = [h[0]["tokens"].tolist() for h in generator.generate([model], batch)]
    translator = ctranslate2.Translator(str(converted), device="cpu", intra_threads=1)
    words = [[dictionary[t] for t in dataset[i]["source"][:-1]] for i in batch["id"].tolist()]
    results = translator.translate_batch(
        words, beam_size=generate.BEAM, length_penalty=1.0,
        max_decoding_length=generate.ct2_decoding_length(MAX_LEN_B),
    )  # fmt: skip
    ct2_words = [r.hypotheses[0] for r in results]
    ct2_best = generate.ct2_tokens(ct2_words, dictionary, MAX_LEN_B)
    # Where both found the same best hypothesis and fairseq's ran to the limit (its last step
    # forced to EOS), CTranslate2 decoded that last step too: one word more than fairseq.
    at_limit = [len(w) for w, ct2, ours in zip(ct2_words, ct2_best, fairseq_best, strict=True)
                if ct2 == ours and len(ours) == MAX_LEN_B + 1]  # fmt: skip
    assert at_limit, "no sentence where both decoded the same to the limit: nothing compared"
    assert at_limit == [MAX_LEN_B + 1] * len(at_limit)


def test_half_precisions_are_refused_on_the_cpu_before_anything_is_loaded(tmp_path):
    parser = argparse.ArgumentParser()
    generate.test_set_options(parser)
    generate.timing_options(parser, MAX_LEN_B)
    parsed = parser.parse_args(["--precision", "fp16"])
    # nothing at "none": a check after loading would fail on the missing checkpoint instead
    with pytest.raises(SystemExit, match="--device cuda"):
        generate.measure(str(tmp_path / "none.pt"), str(tmp_path), parsed)
