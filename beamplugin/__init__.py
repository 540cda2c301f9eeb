"""beamplugin: a fairseq user dir (``--user-dir beamplugin``).

Registers the ``beam_translation`` task and the ``convs2s`` model, makes fairseq's checkpoint
loading safe under torch's ``weights_only`` unpickler, and exports our SequenceGenerator.
"""

from beamplugin import checkpoint_safety

checkpoint_safety.install()

from beamplugin import models, tasks  # noqa: E402  (registration side effects)
from beamplugin.sequence_generator import SequenceGenerator  # noqa: E402

__all__ = ["SequenceGenerator", "models", "tasks"]
