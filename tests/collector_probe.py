"""Decodes a stream twice with a random convs2s and prints, as JSON, what Python's garbage
collector tracks before and after. Run by test_collector.py in a fresh process (the first
engine of a process freezes what is alive)."""

import gc
import json
import random

import torch
from builders import build_convs2s
from fairseq.data import Dictionary

from beamplugin import SequenceGenerator
from beamplugin.streams import translate

torch.set_num_threads(1)
vocab = Dictionary()
for i in range(500):
    vocab.add_symbol(f"w{i}")
vocab.finalize(padding_factor=1)
model = build_convs2s(vocab, 1)
generator = SequenceGenerator([model], vocab, beam_size=4, max_len_b=20)
rng = random.Random(0)
sentences = [
    torch.tensor([rng.randrange(vocab.nspecial, len(vocab)) for _ in range(rng.randrange(2, 20))]
                 + [vocab.eos()])
    for _ in range(40)
]


def tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


gc.collect()
report = {"before": {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
                     "model tracked": tracked(model)}}
first = [h[0]["tokens"].tolist() for _, h in translate(generator, sentences, 16)]
report["after one"] = {"frozen": gc.get_freeze_count(), "model tracked": tracked(model)}
second = [h[0]["tokens"].tolist() for _, h in translate(generator, sentences, 16)]
gc.collect()
report["after two"] = {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
                       "same results": first == second}
print(json.dumps(report))
