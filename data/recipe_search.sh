#!/usr/bin/env bash
# Rank demo recipes by test BLEU/chrF after the same number of epochs (the same training data
# seen, about the same work for one architecture), which does not depend on how busy the machine
# is, as a time budget does; the seconds per update, measured in the same run, tell what a time
# budget buys (noisy on a shared machine).
#
#   bash data/recipe_search.sh OUT EPOCHS VARIANT...
#   VARIANT = NAME[:VAR=value,VAR=value...], VAR one of the recipe's scalars (configs/demo.conf)
#   e.g. bash data/recipe_search.sh /tmp/search 4 base lr3:LR=0.003 v4k:SPM_VOCAB=4000
#
# Each variant trains from scratch in OUT/NAME on the default corpus, prepared once per
# sentencepiece vocabulary in OUT/prep-VOCAB; one line per variant is appended to
# OUT/results.tsv: name, settings, updates, training seconds, s/update, BLEU, chrF.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
(($# >= 3)) || { sed -n '2,13p' "$0"; exit 1; }
out="$(realpath -m "$1")" epochs="$2"
shift 2
mkdir -p "$out"
for variant in "$@"; do
  name="${variant%%:*}" settings=""
  [[ "$variant" == *:* ]] && settings="${variant#*:}"
  (
    IFS=, read -ra assignments <<<"$settings"
    for assignment in "${assignments[@]}"; do export "${assignment?}"; done
    vocab="${SPM_VOCAB:-8000}"
    prep="$out/prep-$vocab"
    # One preparation per vocabulary; a lock, since searches may run side by side.
    exec 9>"$out/prep-$vocab.lock"
    flock 9
    WORK="$prep" SPM_VOCAB="$vocab" bash "$ROOT/data/prepare.sh" >"$out/prep-$vocab.log"
    flock -u 9
    rm -rf "${out:?}/$name"
    cp -a "$prep" "$out/$name"
    export WORK="$out/$name" MAX_EPOCH="$epochs" TRAIN_MINUTES=0
    bash "$ROOT/data/train.sh" >"$out/$name.log" 2>&1
    bash "$ROOT/data/evaluate.sh" ours >>"$out/$name.log" 2>&1
    seconds=$(cat "$WORK/checkpoints/train_seconds")
    done_updates=$(grep -o 'num_updates [0-9]*' "$WORK/logs/train.log" | tail -n1 | cut -d' ' -f2)
    "${PYTHON:-python}" - "$WORK/eval/ours/result.json" "$name" "${settings:-recipe defaults}" \
      "$done_updates" "$seconds" >>"$out/results.tsv" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
name, settings, updates, seconds = sys.argv[2:]
per_update = int(seconds) / int(updates)
print(f"{name}\t{settings}\t{updates}\t{seconds}\t{per_update:.2f}\t{result['bleu']}\t{result['chrf']}")
EOF
    tail -n1 "$out/results.tsv"
  )
done
