"""Score one fairseq-generate run: translations in input order, BLEU, speed.

  score.py GENERATE_OUT GENERATE_LOG REFERENCE HYP_FILE RESULT_JSON
      GENERATE_OUT/_LOG: fairseq-generate's stdout/stderr. REFERENCE is the raw target side of
      the test set (one sentence a line). Writes the
      translations to HYP_FILE and {sentences, sentences_per_s, bleu, bleu_line, signature}
      to RESULT_JSON; prints the BLEU line with sacrebleu's signature.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gen_output import OutputError, merge, speed
from sacrebleu.metrics import BLEU


def score(
    generate_out: Path, generate_log: Path, reference: Path, hyp_file: Path
) -> dict[str, object]:
    references = reference.read_text(encoding="utf-8").splitlines()
    translations = merge([generate_out], len(references))
    hyp_file.write_text("".join(t + "\n" for t in translations), encoding="utf-8")
    # fairseq logs the speed line to stdout or stderr, depending on how logging was set up.
    logged = generate_out.read_text(encoding="utf-8") + generate_log.read_text(encoding="utf-8")
    sentences, per_second = speed(logged)
    if sentences != len(references):
        raise OutputError(
            f"generator reports {sentences} sentences, the test set has {len(references)}"
        )
    bleu = BLEU()
    result = bleu.corpus_score(translations, [references])
    return {
        "sentences": len(translations),
        "sentences_per_s": per_second,
        "bleu": round(result.score, 2),
        "bleu_line": str(result),
        "signature": str(bleu.get_signature()),
    }


def main(argv: list[str]) -> None:
    if len(argv) != 5:
        sys.exit(__doc__)
    result = score(*map(Path, argv[:4]))
    Path(argv[4]).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{result['bleu_line']}  (signature {result['signature']})")
    print(f"{result['sentences']} translations, {result['sentences_per_s']} sentences/s")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except OutputError as error:
        sys.exit(f"error: {error}")
