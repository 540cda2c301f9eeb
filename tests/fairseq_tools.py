"""Running fairseq's command-line tools from tests, on a toy corpus the tests write."""

import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
N_TEST = 100
WORDS = [f"w{i}" for i in range(40)]


def run_tool(tool: str, *args: str, stdin: str | None = None, check: bool = True, **env: str):
    """Run a fairseq console script from this venv, with ``env`` added to its environment; on
    failure show the end of its stderr. Lone surrogates in ``stdin`` go out as the bytes they
    stand for (surrogateescape), so a test can send bytes that are not UTF-8."""
    proc = subprocess.run(
        [str(BIN / tool), *args], input=stdin, capture_output=True, text=True,
        errors="surrogateescape", env=dict(os.environ, OMP_NUM_THREADS="1", **env), cwd=REPO,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def binarized_toy_corpus(root: Path) -> Path:
    """A learnable task (reverse the words), binarized with a joined dictionary."""
    rng = random.Random(0)
    for split, n in [("train", 400), ("valid", 20), ("test", N_TEST)]:
        src, tgt = [], []
        for _ in range(n):
            sent = [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
            src.append(" ".join(sent))
            tgt.append(" ".join(reversed(sent)))
        (root / f"{split}.de").write_text("\n".join(src) + "\n")
        (root / f"{split}.en").write_text("\n".join(tgt) + "\n")
    data = root / "bin"
    run_tool(
        "fairseq-preprocess", "--source-lang", "de", "--target-lang", "en",
        "--trainpref", str(root / "train"), "--validpref", str(root / "valid"),
        "--testpref", str(root / "test"), "--destdir", str(data),
        "--joined-dictionary", "--workers", "1",
    )  # fmt: skip
    return data
