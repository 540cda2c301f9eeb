"""An existing fairseq fconv checkpoint runs unchanged as convs2s, through fairseq-generate."""

import argparse
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq_tools import binarized_toy_corpus, run_tool

from beamplugin.engine import DecodingEngine
from beamplugin.fairseq_plugin import fconv_checkpoints
from beamplugin.fairseq_plugin.fconv_checkpoints import fconv_as_convs2s
from beamplugin.models.convs2s import ConvS2SModel

FCONV_SMALL = [
    "--arch", "fconv_iwslt_de_en", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--decoder-out-embed-dim", "32", "--encoder-layers", "[(32, 3)] * 2",
    "--decoder-layers", "[(32, 3)] * 2",
]  # fmt: skip


@pytest.fixture(scope="module")
def fconv_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fconv")
    data = binarized_toy_corpus(root)
    # Plain fairseq training (fairseq's task and model); only loading needs the plugin.
    run_tool(
        "fairseq-train", str(data), "--user-dir", "beamplugin", *FCONV_SMALL,
        "--optimizer", "nag", "--lr", "0.25", "--clip-norm", "0.1", "--max-tokens", "2000",
        "--max-update", "6", "--save-dir", str(root / "ckpt"), "--cpu", "--no-progress-bar",
    )  # fmt: skip
    return data, root / "ckpt" / "checkpoint_last.pt"


def test_converted_checkpoint_builds_convs2s_and_translates_identically(fconv_checkpoint):
    data, fconv = fconv_checkpoint
    convs2s = fconv.with_name("convs2s.pt")
    subprocess.run(
        [
            sys.executable, "-m", "beamplugin.fairseq_plugin.fconv_checkpoints",
            str(fconv), str(convs2s),
        ],
        check=True,
    )
    models, _ = checkpoint_utils.load_model_ensemble([str(convs2s)])
    assert type(models[0]) is ConvS2SModel

    def generate(path):
        # fconv's BeamableMM rounds differently in the last bit; the plain product is fconv's.
        out = run_tool(
            "fairseq-generate", str(data), "--user-dir", "beamplugin",
            "--task", "beam_translation", "--path", str(path), "--beam", "4", "--cpu",
            "--batch-size", "16", "--no-beamable-mm",
        )  # fmt: skip
        return sorted(line for line in out.stdout.splitlines() if line[:2] in ("H-", "P-"))

    theirs, ours = generate(fconv), generate(convs2s)
    assert len(theirs) == 200 and len(ours) == 200
    # Same translations; scores equal up to float rounding (convs2s multiplies on oneDNN's
    # packed weights, attends with one product per sentence and decodes the first step on one
    # row per sentence), printed with 4 decimals: one unit of the last apart at most.
    for their_line, our_line in zip(theirs, ours, strict=True):
        their_fields, our_fields = their_line.split("\t"), our_line.split("\t")
        assert our_fields[0] == their_fields[0]
        if our_line.startswith("H-"):
            assert our_fields[2] == their_fields[2]
        their_scores = [float(x) for x in their_fields[1].split()]
        our_scores = [float(x) for x in our_fields[1].split()]
        assert our_scores == pytest.approx(their_scores, abs=1.5e-4)


def test_converted_checkpoint_translates_with_our_engine_through_from_pretrained(
    fconv_checkpoint, monkeypatch
):
    """The converted checkpoint records task beam_translation: fairseq's hub interface builds
    our generator, and its translations are fairseq-generate's."""
    data, fconv = fconv_checkpoint
    convs2s = fconv.with_name("convs2s-hub.pt")
    fconv_checkpoints.main([str(fconv), str(convs2s)])
    assert torch.load(convs2s, weights_only=False)["cfg"]["task"]["_name"] == "beam_translation"
    steps = []
    step = DecodingEngine.step
    monkeypatch.setattr(DecodingEngine, "step", lambda self: steps.append(1) or step(self))
    hub = ConvS2SModel.from_pretrained(
        str(convs2s.parent), checkpoint_file=convs2s.name, data_name_or_path=str(data)
    )
    lines = (data.parent / "test.de").read_text().splitlines()[:5]
    translations = hub.translate(lines, beam=4)
    assert steps, "our engine did not decode"
    generated = run_tool(
        "fairseq-generate", str(data), "--user-dir", "beamplugin", "--path", str(convs2s),
        "--beam", "4", "--cpu", "--batch-size", "1",
    )  # fmt: skip
    by_id = dict(
        line.split("\t")[0::2] for line in generated.stdout.splitlines() if line[:2] == "H-"
    )
    assert translations == [by_id[f"H-{i}"] for i in range(5)]


def test_other_architectures_are_refused_by_name():
    state = {"args": None, "cfg": {"model": argparse.Namespace(arch="transformer")}}
    with pytest.raises(ValueError, match="'transformer' is not an fconv translation model"):
        fconv_as_convs2s(state)
    state = {"cfg": {"model": {"_name": "fconv_wmt_en_de"}}, "model": {"w": torch.ones(1)}}
    assert fconv_as_convs2s(state)["cfg"]["model"]["_name"] == "convs2s_wmt_en_de"
