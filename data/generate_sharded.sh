#!/usr/bin/env bash
# Translate a large set in SHARDS pieces (one per machine or GPU; JOBS of them at once here) and
# put the translations back in input order by their sentence ids. A finished shard is not
# translated again. fairseq-generate shards its batches by --distributed-world-size and
# --distributed-rank (fairseq_cli/generate.py passes those as num_shards/shard_id to the batch
# iterator and ignores --num-shards/--shard-id), so those are the options we give it.
#
#   bash data/generate_sharded.sh SHARDS [SUBSET [FAIRSEQ_GENERATE_OPTION...]]
#
# SUBSET: test (default), valid or train. Options add to the recipe's GEN_ARGS (e.g.
# --batch-size 8: fairseq shards whole batches, so small sets need small batches).
# Writes $WORK/sharded/SUBSET-SHARDS/{shardI.out,hyps.$TGT}: hyps holds line i's translation
# on line i, and the script fails unless every sentence of the set is translated exactly once.
# shellcheck source=data/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

shards="${1:-}"
subset="${2:-test}"
[[ "$shards" =~ ^[1-9][0-9]*$ ]] || die "usage: generate_sharded.sh SHARDS [SUBSET [OPTION...]]"
shift $(($# < 2 ? $# : 2))
JOBS="${JOBS:-1}"
CHECKPOINT="${CHECKPOINT:-$WORK/checkpoints/$EVAL_CHECKPOINT}"
need_command fairseq-generate
[[ -f "$WORK/split/$subset.$SRC" ]] || die "no $subset set in $WORK/split: run data/prepare.sh"
[[ -f "$CHECKPOINT" ]] || die "no checkpoint $CHECKPOINT: run data/train.sh first"

out="$WORK/sharded/$subset-$shards"
STEP="generate $subset in $shards shards"
claim "$out" "checkpoint=$CHECKPOINT ${GEN_ARGS[*]} $*" "$out/shard0.done"
for ((shard = 0; shard < shards; shard++)); do
  if [[ -f "$out/shard$shard.done" ]]; then
    log "shard $shard done already, skipping"
    continue
  fi
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  log "shard $shard of $shards"
  {
    fairseq-generate "$WORK/bin" --user-dir "$ROOT/beamplugin" --task beam_translation \
      --source-lang "$SRC" --target-lang "$TGT" --path "$CHECKPOINT" --gen-subset "$subset" \
      "${GEN_ARGS[@]}" "$@" --post-process sentencepiece \
      --distributed-world-size "$shards" --distributed-rank "$shard" \
      >"$out/shard$shard.out" 2>"$out/shard$shard.log" && touch "$out/shard$shard.done"
  } &
done
while (($(jobs -rp | wc -l) > 0)); do wait -n || true; done
for ((shard = 0; shard < shards; shard++)); do
  [[ -f "$out/shard$shard.done" ]] || die "shard $shard failed; see $out/shard$shard.log"
done
outputs=()
for ((shard = 0; shard < shards; shard++)); do outputs+=("$out/shard$shard.out"); done
"$PYTHON" "$DATA/gen_output.py" collect "${outputs[@]}" "$out/hyps.$TGT" \
  "$(count_lines "$WORK/split/$subset.$SRC")"
