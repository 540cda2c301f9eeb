#!/usr/bin/env bash
# Translate the test set with the trained model, detokenize, and score it with sacrebleu.
#
#   bash data/evaluate.sh [ours|fairseq]
#
# ours: our generator (task beam_translation); fairseq: fairseq's own SequenceGenerator, which
# the plain translation task builds (the user dir still registers the model). Both run on the
# same checkpoint (CHECKPOINT, default the recipe's EVAL_CHECKPOINT) and test set, with GEN_ARGS.
# Writes $WORK/eval/GENERATOR/{generate.out,hyps.$TGT,result.json}. fairseq-generate shards the
# set by --distributed-world-size, whose default is the number of GPUs: we pin it to 1.
# shellcheck source=data/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

generator="${1:-ours}"
# fairseq's batching can drop the last partial batch: its generator may return fewer sentences.
case "$generator" in
  ours) task=beam_translation; partial=() ;;
  fairseq) task=translation; partial=(--partial-ok) ;;
  *) die "unknown generator '$generator'; choose ours or fairseq" ;;
esac
CHECKPOINT="${CHECKPOINT:-$WORK/checkpoints/$EVAL_CHECKPOINT}"
need_command fairseq-generate
[[ -f "$WORK/done/binarize" ]] || die "no prepared data in $WORK: run data/prepare.sh first"
[[ -f "$CHECKPOINT" ]] || die "no checkpoint $CHECKPOINT: run data/train.sh first"

out="$WORK/eval/$generator"
if begin_step "evaluate-$generator" "$out"; then
  mkdir -p "$out"
  log "translating $(count_lines "$WORK/split/test.$SRC") test sentences with the $generator generator"
  fairseq-generate "$WORK/bin" --user-dir "$ROOT/beamplugin" --task "$task" \
    --source-lang "$SRC" --target-lang "$TGT" --path "$CHECKPOINT" --gen-subset test \
    "${GEN_ARGS[@]}" --post-process sentencepiece --distributed-world-size 1 \
    >"$out/generate.out" 2>"$out/generate.log" ||
    die "fairseq-generate failed; its log: $out/generate.log"
  "$PYTHON" "$DATA/score.py" "${partial[@]}" "$out/generate.out" "$out/generate.log" "$WORK/split/test.$TGT" \
    "$out/hyps.$TGT" "$out/result.json"
  finish_step "$(grep -o '"bleu": [0-9.a-z]*' "$out/result.json" | tr -d '"') on the test set"
fi
