"""beamplugin: a fairseq user dir (``--user-dir beamplugin``).

Registers the ``beam_translation`` and ``beam_translation_multi`` tasks and the ``convs2s``
model, makes fairseq's checkpoint loading safe under torch's ``weights_only`` unpickler and
its loads to decode map the checkpoint's file, and exports our SequenceGenerator.
The layers, from the bottom: runtime, modules and models, search, engine, streams, the
fairseq plugin, serving, corpus (docs/architecture.md).
"""

from beamplugin.runtime.lean_fairseq_import import import_fairseq

import_fairseq()  # before any module of ours imports it: without scikit-learn and SciPy

from beamplugin.fairseq_plugin import (  # noqa: E402
    checkpoint_safety,
    mapped_checkpoints,
)

checkpoint_safety.install()
mapped_checkpoints.install()

from beamplugin import models  # noqa: E402  (registers the model and its archs)
from beamplugin.fairseq_plugin import (  # noqa: E402, F401  (register the tasks)
    beam_translation,
    beam_translation_multi,
)
from beamplugin.fairseq_plugin.generator import SequenceGenerator  # noqa: E402

__all__ = ["SequenceGenerator", "models"]
