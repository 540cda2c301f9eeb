#!/usr/bin/env bash
# Translate raw sentences typed on stdin (one a line) with the trained model and our generator.
#
#   echo "Das ist ein Test." | bash data/translate.sh
#
# fairseq-interactive applies the sentencepiece model itself; we print the translations only
# (its log goes to $WORK/logs/interactive.log). Each line is translated as soon as it is read.
# Exactly one output line per input line, in order: a line the model cannot take (not valid
# UTF-8, empty, too long) gives an empty output line and "translate.sh: line N not translated:
# REASON" on stderr; the others are translated all the same. Exit status: 0 when every line was
# translated, 3 when some were not, 1 when fairseq-interactive failed.
# shellcheck source=data/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CHECKPOINT="${CHECKPOINT:-$WORK/checkpoints/$EVAL_CHECKPOINT}"
need_command fairseq-interactive
[[ -f "$CHECKPOINT" ]] || die "no checkpoint $CHECKPOINT: run data/prepare.sh and data/train.sh"
mkdir -p "$WORK/logs"
[[ -t 0 ]] && echo "Type $SRC sentences, one a line (Ctrl-D ends):" >&2

# fairseq-interactive's D-<id> (translation) and E-<id> (refused line) lines to one line per
# input line; with --nbest, only the first (best) translation of a line.
one_line_per_input() {
  local line id last=-1
  while IFS= read -r line; do
    [[ $line == [DE]-* ]] || continue
    id="${line%%$'\t'*}"
    id="${id#?-}"
    ((id != last)) || continue
    last=$id
    if [[ $line == D-* ]]; then
      printf '%s\n' "${line#*$'\t'*$'\t'}"
    else
      printf '\n'
      printf 'translate.sh: line %d not translated: %s\n' "$((id + 1))" "${line#*$'\t'}" >&2
    fi
  done
}

if fairseq-interactive "$WORK/bin" --user-dir "$ROOT/beamplugin" --task beam_translation \
  --source-lang "$SRC" --target-lang "$TGT" --path "$CHECKPOINT" \
  --bpe sentencepiece --sentencepiece-model "$WORK/spm/spm.model" \
  "${GEN_ARGS[@]}" --buffer-size 1 --batch-size 1 2>"$WORK/logs/interactive.log" |
  one_line_per_input; then
  exit 0
fi
# fairseq-interactive exits with 3 after translating all it could when it refused some lines.
[[ "${PIPESTATUS[0]}" == 3 ]] && exit 3
die "fairseq-interactive failed; the end of its log:
$(tail -n 5 "$WORK/logs/interactive.log")"
