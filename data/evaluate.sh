#!/usr/bin/env bash
# Translate the test set with the trained model, detokenize, and score it with sacrebleu.
#
#   bash data/evaluate.sh [ours|fairseq]
#
# ours: our generator (task beam_translation); fairseq: fairseq's own SequenceGenerator, which
# the plain translation task builds (the user dir still registers the model). Both run on the
# same checkpoint (CHECKPOINT, default the best one) and test set with the recipe's GEN_ARGS.
# Writes $WORK/eval/GENERATOR/{generate.out,hyps.$TGT,result.json}.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

generator="${1:-ours}"
case "$generator" in
  ours) task=beam_translation ;;
  fairseq) task=translation ;;
  *) die "unknown generator '$generator'; choose ours or fairseq" ;;
esac
CHECKPOINT="${CHECKPOINT:-$WORK/checkpoints/checkpoint_best.pt}"
need_command fairseq-generate
[[ -f "$WORK/done/binarize" ]] || die "no prepared data in $WORK: run data/prepare.sh first"
[[ -f "$CHECKPOINT" ]] || die "no checkpoint $CHECKPOINT: run data/train.sh first"

out="$WORK/eval/$generator"
if begin_step "evaluate-$generator" "$out"; then
  mkdir -p "$out"
  log "translating $(count_lines "$WORK/split/test.$SRC") test sentences with the $generator generator"
  fairseq-generate "$WORK/bin" --user-dir "$ROOT/beamplugin" --task "$task" \
    --source-lang "$SRC" --target-lang "$TGT" --path "$CHECKPOINT" --gen-subset test \
    "${GEN_ARGS[@]}" --post-process sentencepiece >"$out/generate.out" 2>"$out/generate.log" ||
    die "fairseq-generate failed; its log: $out/generate.log"
  "$PYTHON" "$DATA/score.py" "$out/generate.out" "$out/generate.log" "$WORK/split/test.$TGT" \
    "$out/hyps.$TGT" "$out/result.json"
  finish_step "$(grep -o '"bleu": [0-9.]*' "$out/result.json" | tr -d '"') on the test set"
fi
