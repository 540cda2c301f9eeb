"""Importing beamplugin imports fairseq without scikit-learn and SciPy
(beamplugin.runtime.lean_fairseq_import): fairseq's names from them call the real functions
when used, and later imports of either library get the real one."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import beamplugin  # noqa: F401
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("sklearn", "scipy"))
from fairseq.criterions.sentence_prediction import f1_score, spearmanr
from fairseq.tasks.audio_classification import sklearn_metrics
deferred = [f1_score([0, 1, 1, 0], [0, 1, 0, 0]),
            float(spearmanr([1, 2, 3, 4], [1, 3, 2, 4])[0]),
            sklearn_metrics.roc_curve([0, 1, 1], [0.1, 0.7, 0.4])[1].tolist()]
import scipy.stats, sklearn.metrics
real = [sklearn.metrics.f1_score([0, 1, 1, 0], [0, 1, 0, 0]),
        float(scipy.stats.spearmanr([1, 2, 3, 4], [1, 3, 2, 4])[0]),
        sklearn.metrics.roc_curve([0, 1, 1], [0.1, 0.7, 0.4])[1].tolist()]
real_modules = hasattr(scipy.stats, "__file__") and hasattr(sklearn, "__file__")
print(json.dumps({"loaded": loaded, "deferred": deferred, "real": real,
                  "real modules": real_modules}))
"""


def probe(first: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", first + PROBE], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def test_fairseq_imported_through_beamplugin_loads_neither_library_until_used():
    report = probe()
    assert report["loaded"] == []
    assert report["deferred"] == report["real"]
    assert report["real modules"]


def test_fairseq_imported_first_is_left_as_it_is():
    report = probe("import fairseq\n")
    assert "sklearn.metrics" in report["loaded"] and "scipy.stats" in report["loaded"]
    assert report["deferred"] == report["real"]
