#!/usr/bin/env bash
# The same training, unchanged, under fairseq's distributed data parallel: PROCS CPU processes
# (default 2) on this machine talking over gloo. Checkpoints go to $WORK/checkpoints-ddp, beside
# those of data/train.sh; resumes like it. Extra arguments go to fairseq-train.
#
#   bash data/train_ddp_cpu.sh [FAIRSEQ_TRAIN_OPTION...]
DDP_CPU_PROCS="${PROCS:-2}" SAVE_DIR="${SAVE_DIR:-${WORK:-$(dirname "$0")/work}/checkpoints-ddp}" \
  STEP_NAME=train-ddp exec bash "$(dirname "${BASH_SOURCE[0]}")/train.sh" "$@"
