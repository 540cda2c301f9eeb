#!/usr/bin/env bash
# The GPU check, in one call of a GPU machine (under 8 minutes on an H100): the CUDA tests, then
# the device engine's bits (alone = batched = streamed, graphs or not, per precision) and whether
# cuBLAS keeps a row's bits whatever the rows beside it, then transformers base and big in fp16
# at batch 1 and 64 and a convs2s of the demo's shape in float32: fairseq's generator, our other
# engine, the device engine without and with CUDA graphs, side by side. Tables and logs go to $OUT (default /tmp/gpu_check); the benchmark's
# rows to $OUT/gpu.jsonl (the schema of benchmarks/results).
# Wheels the machine lacks (fairseq and what it needs), if carried in .whl/, are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 \
    | tail -30 | tee "$OUT/tests.txt"
timeout 60 python3 -m benchmarks.gpu_step --checks --models tiny --batch-sizes 8 \
    --sentences 16 --rounds 1 --precision float32 2>&1 | grep -v "INFO\|DEBUG" | tee "$OUT/checks.txt"
timeout 200 python3 -m benchmarks.gpu_step --models base big --batch-sizes 1 64 \
    --precision fp16 --results "$OUT/gpu.jsonl" --profile "$OUT/profile.txt" 2>&1 \
    | grep -v "INFO\|DEBUG" | tee "$OUT/bench.txt"
# convs2s of the demo's shape (random weights) against fairseq's fconv, float32
timeout 100 python3 -m benchmarks.gpu_step --models convs2s --batch-sizes 1 64 \
    --precision float32 --batch-1-sentences 32 --sentences 512 --results "$OUT/gpu.jsonl" 2>&1 \
    | grep -v "INFO\|DEBUG" | tee -a "$OUT/bench.txt"
# float32: fairseq's outputs, and what the fixed-row-count products cost
timeout 80 python3 -m benchmarks.gpu_step --models base --batch-sizes 64 --precision float32 \
    --systems fairseq ours graphs --results "$OUT/gpu.jsonl" 2>&1 | grep -v "INFO\|DEBUG" \
    | tee -a "$OUT/bench.txt"
