#!/usr/bin/env bash
# Translate raw sentences typed on stdin (one a line) with the trained model and our generator.
#
#   echo "Das ist ein Test." | bash data/translate.sh
#
# fairseq-interactive applies the sentencepiece model itself; we print the translations only.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CHECKPOINT="${CHECKPOINT:-$WORK/checkpoints/checkpoint_best.pt}"
need_command fairseq-interactive
[[ -f "$CHECKPOINT" ]] || die "no checkpoint $CHECKPOINT: run data/prepare.sh and data/train.sh"
[[ -t 0 ]] && echo "Type $SRC sentences, one a line (Ctrl-D ends):" >&2

fairseq-interactive "$WORK/bin" --user-dir "$ROOT/beamplugin" --task beam_translation \
  --source-lang "$SRC" --target-lang "$TGT" --path "$CHECKPOINT" \
  --bpe sentencepiece --sentencepiece-model "$WORK/spm/spm.model" \
  "${GEN_ARGS[@]}" --buffer-size 1 2>/dev/null | sed -n 's/^D-[0-9]*\t[^\t]*\t//p'
