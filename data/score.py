"""Score one fairseq-generate run: translations in input order, BLEU, chrF, speed.

  score.py [--partial-ok] GENERATE_OUT GENERATE_LOG REFERENCE HYP_FILE RESULT_JSON
      GENERATE_OUT/_LOG: fairseq-generate's stdout/stderr. REFERENCE is the raw target side of
      the test set (one sentence a line). Writes the translations to HYP_FILE (line i for
      sentence i) and {sentences, missing, sentences_per_s, bleu, bleu_line, signature} to
      RESULT_JSON (with chrf, chrf_line, chrf_signature); prints the BLEU and chrF lines with
      sacrebleu's signatures. A missing translation is an
      error, unless --partial-ok (for fairseq's own generator, whose batching can drop the last
      partial batch): then its line stays empty and there is no BLEU (it would not compare).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gen_output import OutputError, merge, speed
from sacrebleu.metrics import BLEU, CHRF


def score(
    generate_out: Path, generate_log: Path, reference: Path, hyp_file: Path, partial_ok: bool
) -> dict[str, object]:
    references = reference.read_text(encoding="utf-8").splitlines()
    translations = merge([generate_out], len(references), allow_missing=partial_ok)
    hyp_file.write_text("".join(f"{t or ''}\n" for t in translations), encoding="utf-8")
    found = [t for t in translations if t is not None]
    # fairseq logs the speed line to stdout or stderr, depending on how logging was set up.
    logged = generate_out.read_text(encoding="utf-8") + generate_log.read_text(encoding="utf-8")
    sentences, per_second = speed(logged)
    if sentences != len(found):
        raise OutputError(f"generator reports {sentences} sentences, its output holds {len(found)}")
    result = {
        "sentences": len(found),
        "missing": len(references) - len(found),
        "sentences_per_s": per_second,
        "bleu": None,
        "bleu_line": "no BLEU: translations are missing",
        "signature": "",
        "chrf": None,
        "chrf_line": "no chrF: translations are missing",
        "chrf_signature": "",
    }
    if not result["missing"]:
        bleu = BLEU()
        corpus_score = bleu.corpus_score(found, [references])
        result.update(
            bleu=round(corpus_score.score, 2),
            bleu_line=str(corpus_score),
            signature=str(bleu.get_signature()),
        )
        chrf = CHRF()
        chrf_score = chrf.corpus_score(found, [references])
        result.update(
            chrf=round(chrf_score.score, 2),
            chrf_line=str(chrf_score),
            chrf_signature=str(chrf.get_signature()),
        )
    return result


def main(argv: list[str]) -> None:
    partial_ok = argv[:1] == ["--partial-ok"]
    argv = argv[partial_ok:]
    if len(argv) != 5:
        sys.exit(__doc__)
    result = score(*map(Path, argv[:4]), partial_ok=partial_ok)
    Path(argv[4]).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{result['bleu_line']}  (signature {result['signature']})")
    print(f"{result['chrf_line']}  (signature {result['chrf_signature']})")
    print(
        f"{result['sentences']} translations, {result['missing']} missing, "
        f"{result['sentences_per_s']} sentences/s"
    )


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except OutputError as error:
        sys.exit(f"error: {error}")
