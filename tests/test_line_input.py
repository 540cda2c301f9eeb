"""beamplugin.fairseq_plugin.line_input: a line of text to source tokens, or a refusal saying
why."""

import pytest
import sentencepiece as spm
import torch

from beamplugin.fairseq_plugin.line_input import LineEncoder, RefusedLine

# What stdin read with surrogateescape hands over for the bytes "word1 \xff\xfe word2".
UNDECODABLE = b"word1 \xff\xfe word2".decode("utf-8", errors="surrogateescape")


@pytest.fixture(scope="module")
def sentencepiece_encode(tmp_path_factory):
    """Sentencepiece as fairseq's --bpe sentencepiece applies it (pieces joined by spaces)."""
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    text = ["der rote hund schläft hier.", "die kleine katze singt dort."] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_prefix=str(prefix), vocab_size=40,
        hard_vocab_limit=False, model_type="bpe", minloglevel=2,
    )  # fmt: skip
    processor = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    return lambda line: " ".join(processor.encode(line, out_type=str))


def test_a_line_becomes_the_tokens_fairseq_would_give_it(toy_dictionary):
    encoder = LineEncoder(toy_dictionary, max_positions=10)
    tokens = encoder.encode("  word1 word25 unheard-of\t")
    expected = toy_dictionary.encode_line("word1 word25 unheard-of", add_if_not_exist=False)
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert tokens.tolist() == expected.tolist()
    assert tokens.tolist()[-2:] == [toy_dictionary.unk(), toy_dictionary.eos()]


def test_a_line_of_exactly_the_limit_passes_one_token_more_is_refused(toy_dictionary):
    encoder = LineEncoder(toy_dictionary, max_positions=4)
    assert len(encoder.encode("word1 word2 word3")) == 4  # with its end of sentence
    with pytest.raises(RefusedLine) as refused:
        encoder.encode("word1 word2 word3 word4")
    assert refused.value.reason == (
        "too long: 5 tokens (end of sentence included), the model accepts at most 4; split the line"
    )
    assert len(LineEncoder(toy_dictionary, max_positions=None).encode("word1 " * 500)) == 501


@pytest.mark.parametrize("line", ["", "   ", " \t "])
def test_empty_lines_are_refused(toy_dictionary, line):
    with pytest.raises(RefusedLine, match="^empty line$"):
        LineEncoder(toy_dictionary, max_positions=10).encode(line)


def test_undecodable_bytes_are_refused_naming_them_before_sentencepiece_sees_them(
    toy_dictionary, sentencepiece_encode
):
    # Sentencepiece itself cannot take the line: this is the crash the check prevents.
    with pytest.raises(RuntimeError, match="Unable to cast"):
        sentencepiece_encode(UNDECODABLE)
    for encode_fn in (None, sentencepiece_encode):
        encoder = LineEncoder(toy_dictionary, max_positions=10, encode_fn=encode_fn)
        with pytest.raises(RefusedLine) as refused:
            encoder.encode(UNDECODABLE)
        assert refused.value.reason == "not valid UTF-8: 0xff 0xfe at character 7"
    with pytest.raises(RefusedLine, match="^not valid UTF-8: U[+]D800 at character 2$"):
        encoder.encode("a\ud800")  # a lone surrogate that is no escaped byte


def test_a_line_sentencepiece_reduces_to_nothing_is_refused(toy_dictionary, sentencepiece_encode):
    encoder = LineEncoder(toy_dictionary, max_positions=10, encode_fn=sentencepiece_encode)
    with pytest.raises(RefusedLine, match="^nothing left to translate after tokenization$"):
        encoder.encode("\u200b\x01")  # a zero-width space and a control character
    assert len(encoder.encode("\u200b hund")) > 1
