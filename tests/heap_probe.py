"""Decodes a stream of random sentences six times with a random convs2s of a 4000-word
vocabulary (log-probs of a few MB per step, as a trained model's) and prints the minor page
faults of each pass after the first. Run by test_heap.py in a fresh process."""

import random
import resource

import torch
from builders import build_convs2s
from fairseq.data import Dictionary

from beamplugin import SequenceGenerator
from beamplugin.streams import translate

torch.set_num_threads(1)
vocab = Dictionary()
for i in range(4000):
    vocab.add_symbol(f"w{i}")
vocab.finalize(padding_factor=1)
generator = SequenceGenerator([build_convs2s(vocab, 1)], vocab, beam_size=5, max_len_b=60)
rng = random.Random(0)
sentences = [
    torch.tensor([rng.randrange(vocab.nspecial, len(vocab)) for _ in range(rng.randrange(2, 40))]
                 + [vocab.eos()])
    for _ in range(150)
]
for _ in translate(generator, sentences, 64):
    pass
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in translate(generator, sentences, 64):
        pass
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
