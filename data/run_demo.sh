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
# The interactive step types configs/demo_sentences.SRC, or else this many test-set sources.
DEMO_TEST_LINES="${DEMO_TEST_LINES:-3}"

bash "$DATA/prepare.sh" "$@"
bash "$DATA/train.sh"
bash "$DATA/evaluate.sh" ours
bash "$DATA/evaluate.sh" fairseq

STEP=interactive
samples="${DEMO_SENTENCES:-$ROOT/configs/demo_sentences.$SRC}"
if [[ ! -f "$samples" ]]; then
  # No demo sentences for this source language: a few test-set sources instead.
  mkdir -p "$WORK/interactive"
  head -n "$DEMO_TEST_LINES" "$WORK/split/test.$SRC" >"$WORK/interactive/test-lines.$SRC"
  samples="$WORK/interactive/test-lines.$SRC"
fi
log "fairseq-interactive with our generator, lines from $samples on stdin:"
translations="$(bash "$DATA/translate.sh" <"$samples")"
paste -d'\n' "$samples" - <<<"$translations" | sed '0~2s/^/  -> /'

"$PYTHON" "$DATA/report.py" "$WORK" "$SRC" "$TGT" "$ARCH" "$TRAIN_MINUTES"
