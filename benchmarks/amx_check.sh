#!/usr/bin/env bash
# The AMX check, in one call of a machine whose CPU has amx_bf16 (a GPU machine's Sapphire Rapids
# host; under 5 minutes): the CPU's AMX features, the bfloat16 kernels' tests (AMX's tiles and
# AVX512-BF16's vdpbf16ps: bits against float64, alone = batched, tails, AMX's proof) and the
# instruction sets', then the kernel table on one thread: AMX, AVX512-BF16 and oneDNN's bf16 at
# a few shapes. Tables and logs go to $OUT (default /tmp/amx_check); the benchmark's rows to
# $OUT/amx.jsonl (the schema of benchmarks/results).
# Wheels the machine lacks (fairseq and what it needs), if carried in .whl/, are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/amx_check}
mkdir -p "$OUT"
source benchmarks/device_setup.sh
# a fresh kernel cache: the libraries and trial verdicts of this code on this CPU
export BEAMPLUGIN_CACHE=$OUT/cache
{ grep -m1 'model name' /proc/cpuinfo; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u; \
  cc --version | head -1; } 2>&1 | tee "$OUT/cpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/cpu.txt"
import logging
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from beamplugin.kernels import bf16_kernels
print("bf16 kernels here:", [n for n in (bf16_kernels.AVX512_BF16, bf16_kernels.AMX)
                             if bf16_kernels.named(n)], "chosen:", (bf16_kernels.chosen() or ["none"])[0])
PY
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_bf16_products.py \
    tests/test_instruction_sets.py -x 2>&1 | tail -30 | tee "$OUT/tests.txt"
timeout 120 python3 -m benchmarks.bf16 --parts kernels --threads 1 \
    --shapes 1024x256 2048x512 8000x256 --rows 1 5 64 320 --results "$OUT/amx.jsonl" 2>&1 \
    | grep -v "INFO\|DEBUG" | tee "$OUT/kernels.txt"
