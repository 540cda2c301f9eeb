/* int8 matrix products for inference (--int8), y = dequantized(q(x) W8^T) + b (then relu, or
 * plus a residual): each row of x quantized to int8 with its own scale (max |x| / 127),
 * products summed exactly in 32-bit integers, scaled back per output channel and per row, in
 * the order and roundings of beamplugin.modules.linear.int8_linear, so the results are that
 * function's bits on every instruction set.
 *
 * The weight is packed once into panels of 32 output channels: for each group of 4 inner
 * positions, 32 x 4 bytes (vpdpbusd's layout), zeros past the weight's end, and each channel's
 * values summed. The multiplying is the set's: int8/avx512_vnni.h (vpdpbusd), int8/avx2.h
 * (vpmaddubsw and vpmaddwd, on AVX2 and on AVX-512 CPUs without VNNI). Elsewhere this file
 * exports only int8_kernel_available() = 0, and torch's int8 path runs.
 */
#include <stdint.h>

/* int8_linear rounds the scaling back one operation at a time: no fused multiply-adds here */
#pragma GCC optimize("fp-contract=off")

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define INT8_KERNEL
#include <math.h>
#include <stdlib.h>
#include <string.h>
typedef uint8_t quantized;
#include "int8/avx512_vnni.h"
#elif defined(__AVX2__)
#define INT8_KERNEL
#include <math.h>
#include <stdlib.h>
#include <string.h>
typedef int8_t quantized;
#include "int8/avx2.h"
#endif

#ifdef INT8_KERNEL
#define NR 32

int int8_kernel_available(void) { return 1; }

const char *instruction_set(void) { return INT8_SET; }

/* x: m x k floats (row stride ldx), quantized here (scales at least `smallest`); panels:
 * ceil(n / 32) x (k4 / 4) x 32 x 4 bytes, k4 = k rounded up to 4; sums: each channel's weights
 * summed (n); channel_scales: n; bias: n or NULL; residual: m x n (row stride ldr) or NULL;
 * y: m x n (row stride ldy). Returns -1 if it could not allocate the quantized rows. */
int int8_products(const float *x, int64_t ldx, int64_t k, float smallest, const int8_t *panels,
                  const int32_t *sums, const float *channel_scales, const float *bias,
                  const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t m,
                  int64_t n, int relu, int threads)
{
    int64_t k4 = (k + 3) / 4 * 4;
    quantized *q = malloc(m * k4 + m * sizeof(float) + 64);
    if (!q)
        return -1;
    float *row_scales = (float *)((uint8_t *)q + (m * k4 + 3) / 4 * 4);
    quantize_rows(x, ldx, m, k, k4, smallest, q, row_scales);
    int64_t count = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < count; p++) {
        int64_t first = p * NR, width = n - first < NR ? n - first : NR;
        rows_of_panel(q, k4, panels + p * (k4 / 4) * 128, sums + first, channel_scales + first,
                      row_scales, bias ? bias + first : 0, residual ? residual + first : 0, ldr,
                      y + first, ldy, m, width, relu);
    }
    free(q);
    return 0;
}

#else
int int8_kernel_available(void) { return 0; }

const char *instruction_set(void) { return "none"; }
#endif
