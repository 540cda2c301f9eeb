"""Keep Python's garbage collector off the objects a decoding process holds for good.

A decoder step makes thousands of small Python objects (each finished hypothesis is five tensor
views), so CPython's collector runs, and about once per thousand sentences it makes a full
collection, which walks every object alive: some 300,000 once torch, fairseq and a model are
loaded, 140 ms each on the CPU the product was measured on (docs/memory.md). Objects alive when
the first engine starts (modules, the model, the task) are moved into the permanent generation,
which collections skip, as vLLM does once its engine is up (``vllm/utils/gc_utils.py``,
``freeze_gc_heap``). Reference cycles made later are collected as before; only cycles among the
frozen objects are never freed.
"""

from __future__ import annotations

import functools
import gc


@functools.cache
def freeze_startup_objects() -> int:
    """Collect once, then exempt every object alive now from later collections (once per
    process); returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
