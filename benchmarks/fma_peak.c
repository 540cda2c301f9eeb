/* A core's multiply-add peak on one instruction set (beamplugin/kernels/native/isa.h, picked by
 * the build's flags as our kernels' are): 12 independent chains of fused multiply-adds on the
 * set's vectors, enough to cover the latency of two pipes. benchmarks/kernels.py builds it
 * per set and divides our kernels' rates by it. */
#include <stdint.h>

#include "isa.h"

#define CHAINS 12

int lanes(void) { return LANES; }

/* 2 x CHAINS x LANES x steps floating-point operations; returns a sum so none is dropped */
float fma_chains(int64_t steps, float a, float b)
{
    vf acc[CHAINS], x = vf_set1(a), y = vf_set1(b);
    for (int c = 0; c < CHAINS; c++)
        acc[c] = vf_set1((float)c);
    for (int64_t s = 0; s < steps; s++)
        _Pragma("GCC unroll 12") for (int c = 0; c < CHAINS; c++)
            acc[c] = vf_fma(acc[c], x, y);
    float out[LANES], sum = 0.0f;
    for (int c = 0; c < CHAINS; c++) {
        vf_store(out, acc[c]);
        sum += out[0];
    }
    return sum;
}
