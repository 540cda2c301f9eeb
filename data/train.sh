#!/usr/bin/env bash
# Train the recipe's ConvS2S on $WORK/bin with our task; resume from checkpoint_last.pt if an
# earlier run stopped. Extra arguments go to fairseq-train (train_ddp_cpu.sh adds DDP options).
#
#   bash data/train.sh [FAIRSEQ_TRAIN_OPTION...]
#
# SAVE_DIR (default $WORK/checkpoints) and STEP_NAME (default train) let other scripts train
# beside the main run; DDP_CPU_PROCS=N trains with N CPU processes (see train_ddp_cpu.sh).
# Training stops after MAX_EPOCH epochs or TRAIN_MINUTES minutes of training (fairseq's
# --stop-time-hours, counted over resumed runs; 0: no time limit), whichever comes first. Raising
# either after a finished run trains on from where it stopped.
# shellcheck source=data/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SAVE_DIR="${SAVE_DIR:-$WORK/checkpoints}"
STEP_NAME="${STEP_NAME:-train}"
DDP_CPU_PROCS="${DDP_CPU_PROCS:-1}"
need_command fairseq-train
[[ -f "$WORK/done/binarize" ]] || die "no prepared data in $WORK: run data/prepare.sh first"
claim "$SAVE_DIR" "arch=$ARCH ${TRAIN_ARGS[*]} $* processes=$DDP_CPU_PROCS" \
  "$SAVE_DIR/checkpoint_last.pt"

marker="$WORK/done/$STEP_NAME"
limits="$MAX_EPOCH epochs, $TRAIN_MINUTES minutes"
if [[ -f "$marker" && "$(sed 's/ at most.*//' "$marker")" != "$limits" ]]; then
  STEP="$STEP_NAME" log "trained to at most $(sed 's/ at most.*//' "$marker") before; going on to $limits"
  rm "$marker"
fi
begin_step "$STEP_NAME" || exit 0

# Whether torch can read the checkpoint's archive and pickle (what it holds is checked on load).
readable_checkpoint() {
  "$PYTHON" -c 'import sys, torch
try:
    torch.serialization.get_unsafe_globals_in_checkpoint(sys.argv[1])
except Exception:
    sys.exit(1)' "$1"
}
last="$SAVE_DIR/checkpoint_last.pt" best="$SAVE_DIR/checkpoint_best.pt"
if [[ -f "$last" ]] && ! readable_checkpoint "$last"; then
  # fairseq writes its first checkpoint atomically but copies it to the others: a run stopped
  # during that copy leaves checkpoint_last.pt truncated, and checkpoint_best.pt, written just
  # before, holds the same state.
  mv "$last" "$last.unreadable"
  if [[ -f "$best" ]] && readable_checkpoint "$best"; then
    cp "$best" "$last"
    log "checkpoint_last.pt was cut short (kept as checkpoint_last.pt.unreadable); resuming from checkpoint_best.pt"
  else
    log "checkpoint_last.pt was cut short (kept as checkpoint_last.pt.unreadable); training from the start"
  fi
elif [[ -f "$last" ]]; then
  log "an earlier run stopped: resuming from $last"
fi

mkdir -p "$WORK/logs"
train=(fairseq-train "$WORK/bin" --user-dir "$ROOT/beamplugin" --task beam_translation
  --source-lang "$SRC" --target-lang "$TGT" --arch "$ARCH" "${TRAIN_ARGS[@]}"
  --max-epoch "$MAX_EPOCH" --stop-time-hours "$(awk "BEGIN { print $TRAIN_MINUTES / 60 }")"
  --save-dir "$SAVE_DIR" --no-epoch-checkpoints
  --log-format simple --log-interval 10 "$@")
# The whole output goes to the log; the terminal gets fairseq's progress lines.
progress() {
  tee -a "$WORK/logs/$STEP_NAME.log" | {
    grep --line-buffered -E '\| (train_inner|train|valid) \||Stopping training|done training|oaded checkpoint|Error' ||
      true
  }
}
start=$(date +%s)
status=0
if ((DDP_CPU_PROCS > 1)); then
  # fairseq spawns one process per GPU only, so on CPU we start the ranks ourselves; rank 0
  # logs and saves checkpoints, the others log warnings to logs/STEP.rankN.log. fairseq hands
  # torch's DistributedDataParallel a GPU device id, so on CPU we take fairseq's own legacy_ddp
  # wrapper (the same gradient all-reduce, over gloo). On resuming, each rank reads the
  # checkpoint file itself: fairseq's default broadcasts rank 0's loaded state with a plain
  # torch.load, whose weights_only unpickler refuses the omegaconf config inside.
  port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  ddp=(--cpu --distributed-backend gloo --ddp-backend legacy_ddp
    --distributed-world-size "$DDP_CPU_PROCS"
    --distributed-init-method "tcp://127.0.0.1:$port" --distributed-no-spawn
    --load-checkpoint-on-all-dp-ranks)
  log "training with fairseq's distributed data parallel: $DDP_CPU_PROCS CPU processes (gloo)"
  ranks=()
  for ((rank = 1; rank < DDP_CPU_PROCS; rank++)); do
    OMP_NUM_THREADS=1 "${train[@]}" "${ddp[@]}" --distributed-rank "$rank" \
      >"$WORK/logs/$STEP_NAME.rank$rank.log" 2>&1 &
    ranks+=($!)
  done
  OMP_NUM_THREADS=1 "${train[@]}" "${ddp[@]}" --distributed-rank 0 2>&1 | progress ||
    { status=$?; kill "${ranks[@]}" 2>/dev/null || true; }
  for pid in "${ranks[@]}"; do wait "$pid" || status=$((status ? status : 1)); done
else
  "${train[@]}" 2>&1 | progress || status=$?
fi
# Training time adds up over resumed runs.
seconds=$(( $(cat "$SAVE_DIR/train_seconds" 2>/dev/null || echo 0) + $(date +%s) - start ))
echo "$seconds" >"$SAVE_DIR/train_seconds"

# fairseq-train exits non-zero when stopped, so a zero status means it ran to MAX_EPOCH or
# stopped early by its own rule (--patience).
((status == 0)) || die "fairseq-train stopped (status $status); run again to resume. The end \
of $WORK/logs/$STEP_NAME.log:
$(tail -n 15 "$WORK/logs/$STEP_NAME.log")"
[[ -f "$SAVE_DIR/$EVAL_CHECKPOINT" ]] || die "fairseq-train saved no $EVAL_CHECKPOINT"
finish_step "$limits at most, $seconds s of training, checkpoints in $SAVE_DIR"
