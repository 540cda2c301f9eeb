"""fairseq's multilingual models (task translation_multi_simple_epoch: M2M-100, NLLB) through our
task beam_translation_multi, a stream and the server, on a tiny three-language model trained
here: fairseq's hypotheses on every pair; sentences to different target languages sharing the
engine's steps, each getting exactly what it gets alone; one server answering every pair of one
model, its page choosing the pair."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from pathlib import Path

import aiohttp
import pytest
import torch
from builders import assert_same, one_sentence
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.sequence_generator import SequenceGenerator as FairseqGenerator
from fairseq_tools import assert_same_lines, lines_by_sentence, run_in_process
from multilingual_tools import (
    LANGTOKS,
    PAIRS,
    SENTENCES,
    source_lines,
    task_options,
    trained_model,
)
from server_tools import Server, chromium, status_and_json

from beamplugin.fairseq_plugin.language_pairs import LanguagePairs
from beamplugin.streams import TranslationStream

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    return trained_model(tmp_path_factory.mktemp("multilingual"))


def _decoding(data: Path, ckpt: Path, langtoks: str, task: str, pair: str) -> list[str]:
    """The options of fairseq-generate and fairseq-interactive for ``pair``."""
    source, target = pair.split("-")
    return [*task_options(data, langtoks), "--user-dir", "beamplugin", "--task", task,
            "--path", str(ckpt), "-s", source, "-t", target, "--beam", "4", "--cpu",
            "--max-len-b", "30", "--batch-size", "3"]  # fmt: skip


@pytest.mark.parametrize(
    "langtoks, pairs",
    [("m2m", PAIRS), ("encoder-tgt", ["en-fr"]), ("replacing-bos-eos", ["fr-de"])],
)
def test_generate_prints_fairseqs_hypotheses_on_each_pair(model, langtoks, pairs, caplog):
    data, ckpt = model
    for pair in pairs:
        with caplog.at_level(logging.INFO, logger="beamplugin"):
            ours = run_in_process("generate", [
                *_decoding(data, ckpt, langtoks, "beam_translation_multi", pair),
                "--gen-subset", "test", "--nbest", "2",
            ])  # fmt: skip
        reference = run_in_process("generate", [
            *_decoding(data, ckpt, langtoks, "translation_multi_simple_epoch", pair),
            "--gen-subset", "test", "--nbest", "2",
        ])  # fmt: skip
        mine, theirs = lines_by_sentence(ours), lines_by_sentence(reference)
        assert sorted(mine) == list(range(SENTENCES["test"])), pair
        # fairseq's compiled batcher leaves out the last partial batch (our task's does not)
        assert len(theirs) >= SENTENCES["test"] - 3, pair
        for sentence_id in theirs:
            assert_same_lines(mine[sentence_id], theirs[sentence_id])
    joined = re.findall(r"(\d+) sentences joined others mid-search", caplog.text)
    assert len(joined) == len(pairs), caplog.text[-2000:]
    if langtoks == "m2m":  # as trained: hypotheses end at different steps, so sentences join
        assert all(int(n) > 0 for n in joined), joined


def test_interactive_prints_fairseqs_hypotheses(model, tmp_path):
    data, ckpt = model
    lines = tmp_path / "lines.de"
    lines.write_text("\n".join(source_lines("de-fr")) + "\n")
    interactive = ["--nbest", "2", "--buffer-size", "10", "--input", str(lines)]
    ours = run_in_process("interactive", [
        *_decoding(data, ckpt, "m2m", "beam_translation_multi", "de-fr"), *interactive,
    ])  # fmt: skip
    reference = run_in_process("interactive", [
        *_decoding(data, ckpt, "m2m", "translation_multi_simple_epoch", "de-fr"), *interactive,
    ])  # fmt: skip
    mine, theirs = lines_by_sentence(ours), lines_by_sentence(reference)
    assert sorted(mine) == sorted(theirs) == list(range(SENTENCES["test"]))
    for sentence_id in theirs:
        assert_same_lines(mine[sentence_id], theirs[sentence_id])


def _task(data: Path, ckpt: Path, langtoks: str, pair: str, task: str) -> tuple:
    """fairseq's task set up for ``pair`` as fairseq-generate sets it up, and its cfg."""
    parser = options.get_generation_parser()
    args = options.parse_args_and_arch(parser, _decoding(data, ckpt, langtoks, task, pair))
    cfg = convert_namespace_to_omegaconf(args)
    return tasks.setup_task(cfg.task), cfg


@pytest.mark.parametrize("langtoks", LANGTOKS)
def test_language_tokens_of_any_pair_are_those_fairseq_puts_for_it(model, langtoks):
    """LanguagePairs, set up for one pair, gives every other pair the source tokens fairseq's
    datasets make for that pair, the prompt its inference_step gives and the symbols its
    generator strips."""
    data, ckpt = model
    languages = LanguagePairs.of(_task(data, ckpt, langtoks, "de-en", "beam_translation_multi")[0])
    assert languages.pairs == [tuple(pair.split("-")) for pair in PAIRS]
    for pair in PAIRS:
        fairseq, _ = _task(data, ckpt, langtoks, pair, "translation_multi_simple_epoch")
        lines = source_lines(pair)[:3]
        tokens = [fairseq.source_dictionary.encode_line(line, add_if_not_exist=False).long()
                  for line in lines]  # fmt: skip
        dataset = fairseq.build_dataset_for_inference(tokens, [len(t) for t in tokens])
        batch = dataset.collater([dataset[i] for i in range(len(tokens))])
        rows = batch["net_input"]["src_tokens"][batch["id"].argsort()]  # collated longest first
        expected = [row[row.ne(fairseq.source_dictionary.pad())] for row in rows]
        ours = [languages.source_tokens(tuple(pair.split("-")), t) for t in tokens]
        assert [t.tolist() for t in ours] == [t.tolist() for t in expected], pair
        target_token = fairseq.data_manager.get_decoder_langtok(pair[3:], "tgt")
        prefix, bos = languages.prompt(tuple(pair.split("-")))
        if "--lang-tok-replacing-bos-eos" in LANGTOKS[langtoks]:
            assert (prefix, bos) == (None, target_token)
        else:
            assert (prefix.tolist(), bos) == ([target_token], None)
        assert languages.output_tokens(tuple(pair.split("-"))) == {target_token}


@pytest.mark.parametrize("langtoks", ["m2m", "replacing-bos-eos"])
def test_a_stream_mixing_target_languages_gives_each_sentence_what_it_gets_alone(
    model, langtoks
):
    """Sentences of every pair in one stream, each with its own language tokens (a forced
    first token, or with --lang-tok-replacing-bos-eos its own BOS): each one's n-best is bit
    for bit what our generator gives it alone, and within rounding fairseq's generator's."""
    data, ckpt = model
    task, cfg = _task(data, ckpt, langtoks, "de-en", "beam_translation_multi")
    models, _ = checkpoint_utils.load_model_ensemble([str(ckpt)], task=task)
    ours = task.build_generator(models, cfg.generation)
    fairseq = FairseqGenerator(models, task.target_dictionary, beam_size=4, max_len_b=30)
    languages = task.languages
    sentences = [
        (languages.source_tokens(pair, task.source_dictionary.encode_line(
            line, add_if_not_exist=False).long()), languages.prompt(pair))
        for pair in languages.pairs for line in source_lines("-".join(pair))[:4]
    ]  # fmt: skip
    order = random.Random(5).sample(range(len(sentences)), len(sentences))
    stream = TranslationStream(ours, max_sentences=5)
    with stream:
        futures = {
            i: stream.submit(sentences[i][0], sentences[i][1].prefix, bos=sentences[i][1].bos)
            for i in order
        }
    assert stream.engine.refills > 0
    for i, (tokens, (prefix, bos)) in enumerate(sentences):
        prefix_tokens = None if prefix is None else prefix[None]
        alone = ours.generate(models, one_sentence(tokens), prefix_tokens, bos_token=bos)[0]
        mixed = futures[i].result()
        for theirs, mine in zip(alone, mixed, strict=True):
            for field in ("tokens", "score", "positional_scores"):
                assert torch.equal(mine[field], theirs[field]), (i, field)
        reference = fairseq.generate(models, one_sentence(tokens), prefix_tokens=prefix_tokens,
                                     bos_token=bos)[0]  # fmt: skip
        assert_same([reference[: len(mixed)]], [mixed], check_attention=False)  # its --nbest


@pytest.fixture(scope="module")
def server(model):
    data, ckpt = model
    server = Server([*_decoding(data, ckpt, "m2m", "beam_translation_multi", "de-en"),
                     "--nbest", "2", "--batch-size", "4"])  # fmt: skip
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def interactive(model, tmp_path_factory) -> dict[str, dict[int, list[tuple[float, str]]]]:
    """fairseq-interactive's (fairseq's own task) D- lines of each pair's source lines: score
    and text by line, best first."""
    data, ckpt = model
    found = {}
    for pair in ("de-en", "de-fr", "fr-de"):
        lines = tmp_path_factory.mktemp("lines") / "lines"
        lines.write_text("\n".join(source_lines(pair)) + "\n")
        out = run_in_process("interactive", [
            *_decoding(data, ckpt, "m2m", "translation_multi_simple_epoch", pair),
            "--nbest", "2", "--buffer-size", "10", "--input", str(lines),
        ])  # fmt: skip
        found[pair] = {}
        for index, score, text in re.findall(r"^D-(\d+)\t(\S+)\t(.*)$", out, flags=re.M):
            found[pair].setdefault(int(index), []).append((float(score), text))
    return found


def test_one_server_answers_two_pairs_at_once_as_fairseq_interactive(server, interactive):
    lines = {pair: source_lines(pair) for pair in ("de-en", "de-fr")}

    async def ask_all() -> list:
        async with aiohttp.ClientSession() as session:
            def libre(pair: str, line: str):
                body = {"q": line, "source": pair[:2], "target": pair[3:]}
                return status_and_json(session.post(server.url + "/translate", json=body))

            nbest = {"sentences": lines["de-fr"], "target": "fr", "nbest": 2}  # source: -s
            return await asyncio.gather(
                *(libre(pair, line) for pair in lines for line in lines[pair]),
                status_and_json(session.post(server.url + "/v1/translate", json=nbest)),
            )

    *libre, (status, nbest) = asyncio.run(asyncio.wait_for(ask_all(), 120))
    expected = [(200, {"translatedText": interactive[pair][i][0][1]})
                for pair in lines for i in range(len(lines[pair]))]  # fmt: skip
    assert libre == expected
    assert status == 200
    for i, translation in enumerate(nbest["translations"]):
        ours = [(h["score"], h["text"]) for h in translation["hypotheses"]]
        assert [text for _, text in ours] == [text for _, text in interactive["de-fr"][i]]
        assert [score for score, _ in ours] == pytest.approx(
            [score for score, _ in interactive["de-fr"][i]], abs=1e-4
        )


def test_languages_and_the_pairs_a_request_may_ask_for(server):
    async def ask() -> list:
        async with aiohttp.ClientSession() as session:
            def libre(**pair: str):
                body = {"q": "de1 de2", **pair}
                return status_and_json(session.post(server.url + "/translate", json=body))

            return await asyncio.gather(
                status_and_json(session.get(server.url + "/languages")),
                libre(source="en", target="de"),
                libre(source="auto", target="en"),
                libre(source="de", target="xx"),
                libre(source="de", target=["en"]),
            )

    languages, unknown, auto, other, not_code = asyncio.run(asyncio.wait_for(ask(), 60))
    assert languages == (200, [
        {"code": "de", "name": "German", "targets": ["en", "fr"]},
        {"code": "en", "name": "English", "targets": ["fr"]},
        {"code": "fr", "name": "French", "targets": ["de"]},
    ])  # fmt: skip
    assert unknown == (400, {"error": "the model does not translate en to de "
                                      "(GET /languages lists what it does)"})  # fmt: skip
    # only German translates to English here: detected among those alone
    assert auto[0] == 200 and auto[1]["detectedLanguage"]["language"] == "de", auto
    assert other[0] == 400 and "does not translate de to xx" in other[1]["error"]
    assert not_code == (400, {"error": "'source' and 'target' are language codes (strings)"})


def test_page_chooses_the_pair_from_languages_and_swaps_it(server, interactive, tmp_path):
    """Headless chromium: the selectors hold /languages' sources and the source's targets, the
    default pair chosen; swap is offered only where the model translates the other way; a line
    sent after a swap comes back in the swapped pair."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser = chromium(tmp_path)
    wait = WebDriverWait(browser, 60)

    def chosen() -> tuple[str, list[str], str, list[str], bool]:
        source, target = (Select(browser.find_element(By.ID, name)) for name in ("source",
                                                                                 "target"))
        return (source.first_selected_option.get_attribute("value"),
                [o.get_attribute("value") for o in source.options],
                target.first_selected_option.get_attribute("value"),
                [o.get_attribute("value") for o in target.options],
                browser.find_element(By.ID, "swap").is_enabled())  # fmt: skip

    try:
        browser.get(server.url + "/")
        wait.until(lambda b: b.find_element(By.ID, "target").get_attribute("value"))
        at_start = chosen()
        names = [o.text for o in Select(browser.find_element(By.ID, "source")).options]
        Select(browser.find_element(By.ID, "target")).select_by_value("fr")
        to_french = chosen()
        browser.find_element(By.ID, "swap").click()
        swapped = chosen()
        line = source_lines("fr-de")[0]
        browser.find_element(By.ID, "text").send_keys(line, Keys.CONTROL, Keys.ENTER)
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "tr.sentence"))
        best = browser.find_element(By.CSS_SELECTOR, "tr.sentence tr.hypothesis td.text").text
        error = browser.find_element(By.ID, "error").text
    finally:
        browser.quit()
    assert at_start == ("de", ["de", "en", "fr"], "en", ["en", "fr"], False)
    assert names == ["German", "English", "French"]
    assert to_french == ("de", ["de", "en", "fr"], "fr", ["en", "fr"], True)
    assert swapped == ("fr", ["de", "en", "fr"], "de", ["de"], True)
    assert (best, error) == (interactive["fr-de"][0][0][1], "")


def test_auto_source_and_detect_route_a_request_to_its_language(server):
    """Real sentences (the toy words tell no language): /detect ranks the model's source
    languages, and ``source: "auto"`` translates in the pair of the language detected among
    those that translate to the target, as that pair named would."""
    texts = {"de": "Guten Morgen, wie geht es Ihnen heute?",
             "en": "Good morning, how are you today?",
             "fr": "Bonjour, comment allez-vous aujourd'hui ?"}  # fmt: skip

    async def ask() -> list:
        async with aiohttp.ClientSession() as session:
            def post(path: str, body: dict):
                return status_and_json(session.post(server.url + path, json=body))

            return await asyncio.gather(
                *(post("/detect", {"q": text}) for text in texts.values()),
                post("/translate", {"q": texts["en"], "source": "auto", "target": "fr"}),
                post("/translate", {"q": texts["en"], "source": "en", "target": "fr"}),
                post("/translate", {"q": texts["de"], "source": "auto", "target": "fr"}),
                post("/translate", {"q": texts["de"], "source": "de", "target": "fr"}),
                post("/detect", {"q": " "}),
            )

    *detected, auto_en, named_en, auto_de, named_de, empty = asyncio.run(
        asyncio.wait_for(ask(), 60)
    )
    for language, (status, ranked) in zip(texts, detected, strict=True):
        assert status == 200 and sorted(r["language"] for r in ranked) == ["de", "en", "fr"]
        assert ranked[0]["language"] == language and ranked[0]["confidence"] > 50, ranked
        assert [r["confidence"] for r in ranked] == sorted((r["confidence"] for r in ranked),
                                                           reverse=True)  # fmt: skip
    assert auto_en[1]["detectedLanguage"]["language"] == "en"
    assert auto_en[1]["translatedText"] == named_en[1]["translatedText"]
    assert auto_de[1]["detectedLanguage"]["language"] == "de"
    assert auto_de[1]["translatedText"] == named_de[1]["translatedText"]
    assert empty == (400, {"error": "'q' is required: a text"})
