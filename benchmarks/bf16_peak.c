/* A core's bfloat16 multiply-add peak on AVX512-BF16: 12 independent chains of vdpbf16ps (each
 * 16 lanes x 2 products x 2 operations), as scripts/fma_peak.c measures float32's.
 * benchmarks/bf16.py builds it and divides our bfloat16 products' rates by it. */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define CHAINS 12

/* 64 x CHAINS x steps operations; returns a sum so none is dropped */
float dpbf16_chains(int64_t steps, float a)
{
    __m512 acc[CHAINS];
    __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(a), _mm512_set1_ps(a));
    for (int c = 0; c < CHAINS; c++)
        acc[c] = _mm512_set1_ps((float)c);
    for (int64_t s = 0; s < steps; s++)
        _Pragma("GCC unroll 12") for (int c = 0; c < CHAINS; c++)
            acc[c] = _mm512_dpbf16_ps(acc[c], x, x);
    float sum = 0.0f;
    for (int c = 0; c < CHAINS; c++)
        sum += _mm512_reduce_add_ps(acc[c]);
    return sum;
}
#else
float dpbf16_chains(int64_t steps, float a) { return (float)steps * a * 0.0f; }
#endif
