"""Import fairseq without scikit-learn and SciPy, which translation never calls.

fairseq imports every task and criterion it ships when it is imported. Two of them,
``tasks/audio_classification`` and ``criterions/sentence_prediction``, import metrics from
scikit-learn and SciPy at module level. Those libraries then hold 77 MiB of resident memory in
every process that imports fairseq (docs/memory.md). ``importlib.util.LazyLoader`` cannot defer
them: ``from sklearn.metrics import f1_score`` reads ``sklearn.__path__``, which runs
``sklearn/__init__``, which imports SciPy.

So, while fairseq is first imported, those four modules are stand-ins. A name that fairseq takes
from one becomes a function that imports the real module at its first call. Afterwards the
stand-ins leave ``sys.modules``, so any other import of scikit-learn or SciPy gets the real
libraries.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Any

# What those two fairseq modules import at module level.
DEFERRED_MODULES = ("sklearn", "sklearn.metrics", "scipy", "scipy.stats")


class _DeferredModule(types.ModuleType):
    """A module that is not imported yet: its submodules are stand-ins too, and its other names
    import the real module when called."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # no hasattr(module, "__file__") etc. imports the real one
            raise AttributeError(name)
        submodule = f"{self.__name__}.{name}"
        if submodule in DEFERRED_MODULES:
            return sys.modules.get(submodule) or importlib.import_module(submodule)
        return _deferred_function(self.__name__, name)


def _deferred_function(module: str, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__module__ = module
    return call


def import_fairseq() -> None:
    """Import fairseq, with scikit-learn and SciPy deferred as above unless fairseq or either
    library is already imported."""
    names = {name.partition(".")[0] for name in DEFERRED_MODULES}
    if "fairseq" in sys.modules or any(name in sys.modules for name in names):
        import fairseq  # noqa: F401
        return
    stand_ins = {}
    for name in DEFERRED_MODULES:
        module = _DeferredModule(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        stand_ins[name] = module
    sys.modules.update(stand_ins)
    try:
        import fairseq  # noqa: F401
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
