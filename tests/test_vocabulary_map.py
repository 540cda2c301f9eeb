"""Vocabulary shortlists (``--vocabulary-map``, CTranslate2's ``use_vmap``): the map file read as
CTranslate2 reads it; each sentence takes only its shortlist's tokens, its scores normalised over
them, as fairseq's generator gives them with every other token's logit at -inf; a sentence gets
the same bits alone and in a stream; a shortlist of every token gives the bits of none."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from builders import (
    ORDERS,
    alone,
    assert_identical,
    assert_same,
    build_convs2s,
    build_transformer,
    stream,
)
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator

from beamplugin import SequenceGenerator
from beamplugin.fairseq_plugin import vocabulary_map_cli
from beamplugin.fairseq_plugin.precision import cast_for_decoding
from beamplugin.kernels import float_products, layouts
from beamplugin.modules import int8_weights
from beamplugin.modules.output_columns import OutputColumns, shortlist_columns
from beamplugin.search.vocabulary_map import VocabularyMap

# vocab, models, one_thread and sentences: conftest.py's module-scoped fixtures
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.exact]

MIXING = ["convs2s", "transformer"]


def write_map(path, vocab) -> str:
    """Each source word wi brings w(i), w(i + 1) and w(3i) (mod the words); the bigram "w1 w2"
    brings w20; every sentence may take w5. A rule of an unknown word and an unknown target
    token are left out."""
    words = len(vocab) - vocab.nspecial
    lines = ["\tw5 nosuchword"]
    for i in range(words):
        targets = {f"w{i}", f"w{(i + 1) % words}", f"w{(3 * i) % words}"}
        lines.append(f"w{i}\t{' '.join(sorted(targets))}")
    lines += ["w1 w2\tw20", "nosuchword\tw7"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def vocabulary_map(vocab, tmp_path_factory) -> VocabularyMap:
    path = write_map(tmp_path_factory.mktemp("vmap") / "map.txt", vocab)
    special = [vocab.bos(), vocab.pad(), vocab.eos(), vocab.unk()]
    return VocabularyMap.read(path, vocab.indices, vocab.indices, special)


def test_the_map_reads_ctranslate2s_format(vocab, vocabulary_map, tmp_path, caplog):
    w = vocab.index
    source = [w("w1"), w("w2"), vocab.eos()]
    expected = {vocab.bos(), vocab.pad(), vocab.eos(), vocab.unk(), w("w5"), w("w20")}
    expected |= {w("w1"), w("w2"), w("w3"), w("w6")}
    assert vocabulary_map.shortlist(source).tolist() == sorted(expected)
    # a forced prefix's tokens are in the shortlist; "w2 w1" is no bigram of the map
    shortlist = vocabulary_map.shortlist([w("w2"), w("w1")], prefix=[w("w9")])
    assert w("w9") in shortlist.tolist() and w("w20") not in shortlist.tolist()
    with caplog.at_level("WARNING"):
        VocabularyMap.read(write_map(tmp_path / "m.txt", vocab), vocab.indices, vocab.indices)
    assert "1 rules whose source n-gram is not in the source dictionary" in caplog.text
    assert vocab.index("w7") not in vocabulary_map.shortlist([vocab.index("w0")]).tolist()
    (tmp_path / "bad.txt").write_text("w1 w2\n")
    with pytest.raises(ValueError, match="bad.txt, line 1: .* no tab"):
        VocabularyMap.read(tmp_path / "bad.txt", vocab.indices, vocab.indices)


class MaskedLogits:
    """A model whose logits are -inf outside ``shortlist`` (for fairseq's own generator)."""

    def __init__(self, model: torch.nn.Module, shortlist: torch.Tensor) -> None:
        self.model, self.shortlist = model, shortlist
        self.original = model.get_normalized_probs

    def __enter__(self) -> torch.nn.Module:
        def masked(net_output, log_probs, sample=None):
            logits = net_output[0]
            out = torch.full_like(logits, -math.inf)
            out[..., self.shortlist] = logits[..., self.shortlist]
            return self.original((out, *net_output[1:]), log_probs, sample)

        self.model.get_normalized_probs = masked
        return self.model

    def __exit__(self, *exc: object) -> None:
        del self.model.get_normalized_probs


@pytest.mark.parametrize("arch", MIXING)
def test_each_sentence_gets_fairseqs_search_over_its_shortlist(
    vocab, models, sentences, vocabulary_map, arch
):
    model = models[arch][0]
    ours = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20, shortlist=vocabulary_map)
    ordinary = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
    changed = 0
    for sentence in sentences:
        shortlist = vocabulary_map.shortlist(sentence.tolist())
        with MaskedLogits(model, shortlist) as masked:
            expected = alone(FairseqGenerator([masked], vocab, beam_size=4, max_len_b=20), sentence)
        out = alone(ours, sentence)
        assert_same([expected], [out], check_attention=False)
        assert all(set(h["tokens"].tolist()) <= set(shortlist.tolist()) for h in out)
        changed += out[0]["tokens"].tolist() != alone(ordinary, sentence)[0]["tokens"].tolist()
    assert changed > len(sentences) // 2, "the shortlists should change most best hypotheses"


@pytest.mark.parametrize("arch", MIXING)
@pytest.mark.parametrize("kernels", ["ours", "torch's"])
def test_a_stream_gives_each_sentence_its_bits_alone(
    vocab, models, sentences, vocabulary_map, arch, kernels, kernels_for, monkeypatch
):
    if kernels == "torch's":
        kernels_for("off")  # then a model built afresh: weights prepared for torch's kernels
    model = {"convs2s": build_convs2s, "transformer": build_transformer}[arch](vocab, 1)
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20, shortlist=vocabulary_map)
    narrow = OutputColumns.narrow
    seen = set()

    def spied(self, vocabulary: int) -> bool:
        seen.add(narrow(self, vocabulary))
        return narrow(self, vocabulary)

    monkeypatch.setattr(OutputColumns, "narrow", spied)
    expected = [alone(gen, s) for s in sentences]
    out, engine = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=5)
    assert_identical(expected, out)
    assert engine.refills > 0
    # some steps multiplied the shortlists' columns alone, others every column (the same bits)
    assert seen == {True, False}


def in_int8(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """A copy of ``model`` with every product in int8 (the output projection's columns alone
    included)."""
    monkeypatch.setattr(int8_weights, "INT8_MIN_WEIGHTS", 0)
    model = copy.deepcopy(model)
    cast_for_decoding([model], "int8")
    return model


@pytest.mark.parametrize("arch", MIXING)
@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_a_shortlist_of_every_token_gives_the_bits_of_none(
    vocab, models, sentences, tmp_path, arch, precision, monkeypatch
):
    words = " ".join(vocab.symbols[vocab.nspecial :])
    (tmp_path / "all.txt").write_text(f"\t{words}\n")
    special = [vocab.bos(), vocab.pad(), vocab.eos(), vocab.unk()]
    everything = VocabularyMap.read(tmp_path / "all.txt", vocab.indices, vocab.indices, special)
    model = models[arch][0]
    if precision == "int8":
        model = in_int8(model, monkeypatch)
    options = dict(beam_size=4, max_len_b=20)
    ours = SequenceGenerator([model], vocab, shortlist=everything, **options)
    plain = SequenceGenerator([model], vocab, **options)
    assert_identical([alone(plain, s) for s in sentences], [alone(ours, s) for s in sentences])


@pytest.mark.parametrize("length", [1, 7, 15, 16, 17, 63, 64, 65, 300, 3000])
def test_a_rows_log_probs_are_its_own_whatever_shortlists_share_its_step(length):
    """A row normalised over its own shortlist gets the same bits alone and beside a longer
    shortlist (its row padded further), short shortlists included, from the logits of the
    columns alone or of every token."""
    vocab = 5000
    g = torch.Generator().manual_seed(length)
    own = torch.randperm(vocab, generator=g)[:length].sort().values
    longer = torch.randperm(vocab, generator=g)[:4000].sort().values
    logits = torch.randn(1, vocab, generator=g) * 4

    def log_probs(shortlists: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
        columns = shortlist_columns(shortlists, None).for_rows(torch.tensor(rows))
        every_token = columns.log_softmax(logits.expand(len(rows), vocab), vocab).clone()
        of_columns = logits[:, columns.columns].expand(len(rows), -1)
        assert torch.equal(columns.log_softmax(of_columns, vocab), every_token)
        return every_token

    alone_row = log_probs([own], [0, 0])[1]
    assert torch.equal(alone_row, log_probs([longer, own], [0, 1, 1, 0])[2])
    assert alone_row.isfinite().sum() == length
    assert float(alone_row[own].exp().sum()) == pytest.approx(1.0, abs=1e-5)
    expected = torch.log_softmax(logits[0, own], 0)
    torch.testing.assert_close(alone_row[own], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", MIXING)
def test_a_stream_in_int8_gives_each_sentence_its_bits_alone(
    vocab, models, sentences, vocabulary_map, arch, monkeypatch
):
    model = in_int8(models[arch][0], monkeypatch)
    gen = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20, shortlist=vocabulary_map)
    expected = [alone(gen, s) for s in sentences]
    out, _ = stream(gen, sentences, ORDERS["shuffled"], window=4, max_sentences=5)
    assert_identical(expected, out)


def test_the_map_builder_lists_each_source_tokens_most_frequent_partners(tmp_path, capsys):
    (tmp_path / "src").write_text("a b\na c\na b\nb\n")
    (tmp_path / "tgt").write_text("x y\nx z\nx y\ny\n")
    out = tmp_path / "map.txt"
    args = ["--source", str(tmp_path / "src"), "--target", str(tmp_path / "tgt"),
            "--output", str(out), "--per-token", "1", "--frequent", "1", "--min-count", "2"]
    assert vocabulary_map_cli.cli_main(args) == 0
    # x and y are in 3 pairs each: x, first in order, on every sentence's line; then the best
    # partner of a is y (2 pairs), of b y (3 pairs); c shares no target twice
    assert out.read_text().splitlines() == ["\tx", "a\ty", "b\ty"]
    (tmp_path / "short").write_text("x\n")
    assert vocabulary_map_cli.cli_main([*args[:2], "--target", str(tmp_path / "short"),
                                        *args[4:]]) == 2  # fmt: skip
    assert "must have as many lines" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_the_panels_of_a_shortlists_columns_are_those_of_its_rows(dtype):
    """Columns taken from a packed weight (not from its paged-out rows) are packed as the rows
    would be, and multiply to the bits of the whole product's columns."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 37, generator=g)
    if dtype == torch.int8:
        weight = weight.mul(40).round().to(torch.int8)
    columns = torch.tensor([0, 3, 31, 32, 33, 64, 99])
    group = 4 if dtype == torch.int8 else 1
    laid = layouts.panels(weight, group)
    expected = layouts.panels(weight[columns], group)
    assert torch.equal(layouts.panel_columns(laid, columns), expected)
    if dtype == torch.float32 and float_products.available(torch.float32):
        x = torch.randn(5, 37, generator=g)
        whole = float_products.product(x, float_products.pack(weight), None)
        picked = float_products.columns(float_products.pack(weight), columns)
        assert torch.equal(float_products.product(x, picked, None), whole[:, columns])
