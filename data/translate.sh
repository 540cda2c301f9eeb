#!/usr/bin/env bash
# Translate raw sentences typed on stdin (one a line) with the trained model and our generator.
#
#   echo "Das ist ein Test." | bash data/translate.sh
#
# fairseq-interactive applies the sentencepiece model itself; we print the translations only
# (its log goes to $WORK/logs/interactive.log). Each line is translated as soon as it is read.
# shellcheck source=data/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CHECKPOINT="${CHECKPOINT:-$WORK/checkpoints/$EVAL_CHECKPOINT}"
need_command fairseq-interactive
[[ -f "$CHECKPOINT" ]] || die "no checkpoint $CHECKPOINT: run data/prepare.sh and data/train.sh"
mkdir -p "$WORK/logs"
[[ -t 0 ]] && echo "Type $SRC sentences, one a line (Ctrl-D ends):" >&2

fairseq-interactive "$WORK/bin" --user-dir "$ROOT/beamplugin" --task beam_translation \
  --source-lang "$SRC" --target-lang "$TGT" --path "$CHECKPOINT" \
  --bpe sentencepiece --sentencepiece-model "$WORK/spm/spm.model" \
  "${GEN_ARGS[@]}" --buffer-size 1 --batch-size 1 2>"$WORK/logs/interactive.log" |
  sed -n 's/^D-[0-9]*\t[^\t]*\t//p' ||
  die "fairseq-interactive failed; the end of its log:
$(tail -n 5 "$WORK/logs/interactive.log")"
