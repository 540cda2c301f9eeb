#!/usr/bin/env bash
# Compiles each C kernel of the project for every x86-64 instruction-set level users have
# (x86-64-v3 = AVX2 + FMA, x86-64-v4 = AVX-512 with VNNI and BF16) and counts, per kernel and
# level, the fused multiply-adds (and bfloat16 vdpbf16ps) whose operand or result lives on the
# stack: in an inner loop each one is a spilled accumulator (the kernel then runs at a fraction
# of the CPU's speed). It also shows GCC's -Wpsabi warning, which appears when a vector type
# is wider than the level's registers.
# Usage: benchmarks/isa_check.sh [PROJECT_ROOT], or make isa-check (a line per kernel and level; exits 0)
root=${1:-.}
src=$(find "$root/beamplugin" -path '*/native/*.c' 2>/dev/null | sort)
[ -n "$src" ] || exit 0
command -v gcc >/dev/null || { echo "  (no gcc: skipped)"; exit 0; }
t=$(mktemp -d)
for f in $src; do
  for level in x86-64-v3 x86-64-v4; do
    name=$(basename "$f" .c)
    # AVX-512 with the extensions our build adds where the CPU has them (instruction_sets.py)
    extra=$([ $level = x86-64-v4 ] && echo "-mavx512vnni -mavx512bf16")
    if ! gcc -O3 -march=$level $extra -ffp-contract=fast -fopenmp -fPIC -S -I"$(dirname "$f")" -o "$t/$name.s" "$f" 2> "$t/$name.err"; then
      echo "  $name  $level: does not compile ($(head -1 "$t/$name.err" | cut -c1-100))"; continue
    fi
    multiply_add='^\s*(v?fn?m(add|sub)[0-9]*[ps][sd]|vdpbf16ps)'  # float32's and bfloat16's
    fma=$(grep -cE "$multiply_add" "$t/$name.s")
    spilled=$(grep -E "$multiply_add" "$t/$name.s" | grep -c '(%rsp)')
    abi=$(grep -c 'changes the ABI' "$t/$name.err")
    printf '  %-22s %-10s %4d FMAs, %4d on the stack%s\n' "$name" "$level" "$fma" "$spilled" \
      "$([ "$abi" -gt 0 ] && echo ", gcc: vector wider than this level's registers")"
  done
done
rm -rf "$t"
