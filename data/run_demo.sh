#!/usr/bin/env bash
# The main job: real text to a trained ConvS2S, BLEU, and a speed comparison, in one command.
#
#   bash data/run_demo.sh [--files SOURCE_FILE TARGET_FILE | --tsv FILE]
#
# Default corpus: the Ding German-English example sentences (Debian's trans-de-en). Recipe:
# CONFIG (configs/demo.conf); work directory: WORK (data/work). Each step skips itself when its
# output is complete, so running this again after an interruption resumes where it stopped.
# shellcheck source=data/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bash "$DATA/prepare.sh" "$@"
bash "$DATA/train.sh"
bash "$DATA/evaluate.sh" ours
bash "$DATA/evaluate.sh" fairseq

STEP=interactive
samples="${DEMO_SENTENCES:-$ROOT/configs/demo_sentences.$SRC}"
if [[ -f "$samples" ]]; then
  log "fairseq-interactive with our generator, lines from $samples on stdin:"
  translations="$(bash "$DATA/translate.sh" <"$samples")"
  paste -d'\n' "$samples" - <<<"$translations" | sed '0~2s/^/  -> /'
fi

"$PYTHON" "$DATA/report.py" "$WORK" "$SRC" "$TGT" "$ARCH"
