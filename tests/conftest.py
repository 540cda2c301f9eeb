"""Shared pytest fixtures (keep each small and clearly named)."""

import os

import pytest
import torch
from builders import BUILDERS, STREAM_SENTENCES, VOCAB_WORDS, word_dictionary
from fairseq.data import Dictionary

from beamplugin.kernels import instruction_sets, native_library


def pytest_configure(config: pytest.Config) -> None:
    # Our kernels pinned to the best set this CPU runs (unless make test pins another): the
    # trials against torch's kernels, timed on a machine as busy as a test run makes it, could
    # pick torch's for some shape and change what a test exercises. tests/test_instruction_sets.py
    # tests the trials themselves.
    if not instruction_sets.pinned():
        best = next(isa for isa in instruction_sets.SETS if instruction_sets.runs_here(isa))
        # on a CPU with AMX the best is AVX-512 with its bfloat16 products on AMX's tiles
        # (BEAMPLUGIN_ISA=avx512 would rule them out)
        amx = best == instruction_sets.AVX512 and (
            instruction_sets.AMX_FEATURES <= instruction_sets.cpu_features()
        )
        os.environ[instruction_sets.CHOICE] = instruction_sets.AMX if amx else best.name
    config.addinivalue_line(
        "markers",
        "exact: bit-for-bit tests of our kernels and of decoding, which make test runs again "
        "with the AVX2 kernels and with torch's (BEAMPLUGIN_ISA=avx2, =off)",
    )


@pytest.fixture
def toy_dictionary() -> Dictionary:
    """fairseq's four special symbols (bos=0, pad=1, eos=2, unk=3) and 26 words."""
    dictionary = Dictionary()
    for index in range(26):
        dictionary.add_symbol(f"word{index}")
    return dictionary


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: extra threads only add synchronisation (and contention on a shared machine).
    A module takes it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vocab() -> Dictionary:
    """The random models' vocabulary: VOCAB_WORDS words."""
    return word_dictionary(VOCAB_WORDS)


@pytest.fixture(scope="module")
def models(vocab: Dictionary) -> dict[str, list[torch.nn.Module]]:
    """Two sharpened random models (seeds 1 and 2) of each architecture of BUILDERS."""
    return {name: [build(vocab, 1), build(vocab, 2)] for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def sentences(vocab: Dictionary) -> list[torch.Tensor]:
    """Sources of 1 to 15 words, each ending in EOS: they finish at very different steps, so
    slots of a stream really refill."""
    g = torch.Generator().manual_seed(11)
    lengths = [1, 15, 3, 9, 2, 12, 6, 1, 14, 4, 8, 2, 11, 5][:STREAM_SENTENCES]
    return [
        torch.cat([torch.randint(vocab.nspecial, len(vocab), (n,), generator=g),
                   torch.tensor([vocab.eos()])])
        for n in lengths
    ]


@pytest.fixture
def kernels_for(monkeypatch):
    """``kernels_for("avx2")`` (or "off", "generic", ...): our kernels of that set for the rest
    of a test, as ``BEAMPLUGIN_ISA`` gives them a process (every kernel looked up again, and
    again after the test). Models whose weights were prepared before keep their layouts: build
    them after the switch."""

    def switch(name: str) -> None:
        monkeypatch.setenv(instruction_sets.CHOICE, name)
        native_library.forget()

    yield switch
    monkeypatch.undo()
    native_library.forget()
