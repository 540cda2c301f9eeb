/* bfloat16 matrix products for inference, y = x W^T + b (then relu, or plus a residual), on
 * CPUs with AVX512-BF16: pairs of bfloat16 products summed into float32 with vdpbf16ps, the
 * bias, relu and residual added in float32. Two kinds:
 *  - bf16_products: x and y bfloat16 (a model cast to bfloat16), one rounding to bfloat16 at
 *    the end (as oneDNN's matmul with its post-ops);
 *  - bf16_weight_products (--bf16): x and y float32, the model's activations, each row of x
 *    rounded to bfloat16 once per product (vcvtne2ps2bf16, to nearest even), y the float32 sums
 *    plus bias (no rounding to bfloat16): half the weight bytes of float32 and twice the
 *    multiply-adds an instruction, while norms, attention and the residual stream stay float32.
 *
 * The weight is packed once into panels of 32 output channels: for each pair of inner
 * positions, 32 x 2 bfloat16 (vdpbf16ps' layout), zeros past the weight's end. Each output
 * element is summed pair after pair in order, whatever the rows beside it or the thread: a
 * row's bits do not depend on its batch. Without AVX512-BF16 this file exports only
 * bf16_kernel_available() = 0.
 */
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_rows.h"

#define NR 32
#define MR 8
#define WMR 12 /* bf16_weight_products' rows a tile: 24 accumulators of 32 registers */
#ifndef ROW_BLOCK
#define ROW_BLOCK 60 /* and its rows a block: 5 tiles */
#endif
#define LEAST_BLOCK 24 /* fewer rows than this are not a block of their own: 2 tiles */
#define PREFETCH_PAIRS 128 /* 16 KB ahead, as the float32 kernel's 128 rows */

int bf16_kernel_available(void) { return 1; }

static inline __m512 widen(const uint16_t *p, __mmask16 mask)
{
    __m256i half = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* acc[i] (two halves of a panel's 32 outputs) plus the first `pairs` pairs of row i of x
 * (bfloat16, row stride ldx) times the panel's: each output summed pair after pair in order,
 * whatever the rows beside it */
static inline __attribute__((always_inline)) void sum_pairs(
    int rows, const uint16_t *x, int64_t ldx, int64_t pairs, const uint16_t *panel,
    __m512 acc[][2], int prefetch)
{
    for (int64_t g = 0; g < pairs; g++) {
        const uint16_t *w = panel + g * 64;
        if (prefetch) {
            _mm_prefetch((const char *)(w + PREFETCH_PAIRS * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PREFETCH_PAIRS * 64 + 32), _MM_HINT_T0);
        }
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        for (int i = 0; i < rows; i++) {
            int32_t two;
            memcpy(&two, x + i * ldx + 2 * g, sizeof two);
            __m512bh a = (__m512bh)_mm512_set1_epi32(two);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
        }
    }
}

static inline __attribute__((always_inline)) void rows_of_panel(
    int rows, const uint16_t *x, int64_t ldx, int64_t k_len, const uint16_t *panel,
    const uint16_t *bias, const uint16_t *residual, int64_t ldr, uint16_t *y, int64_t ldy,
    int64_t width, int relu, int prefetch)
{
    __m512 acc[MR][2];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = _mm512_setzero_ps();
        acc[i][1] = _mm512_setzero_ps();
    }
    int64_t pairs = k_len / 2;
    sum_pairs(rows, x, ldx, pairs, panel, acc, prefetch);
    if (k_len % 2) { /* the last inner position alone: its pair's partner is zero */
        const uint16_t *w = panel + pairs * 64;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        for (int i = 0; i < rows; i++) {
            int32_t two = x[i * ldx + k_len - 1];
            __m512bh a = (__m512bh)_mm512_set1_epi32(two);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
        }
    }
    for (int c = 0; c < 2; c++) {
        __mmask16 mask = half_mask(width, c);
        if (!mask)
            continue;
        __m512 b = bias ? widen(bias + 16 * c, mask) : _mm512_setzero_ps();
        for (int i = 0; i < rows; i++) {
            __m512 v = _mm512_add_ps(acc[i][c], b);
            if (relu)
                v = _mm512_max_ps(_mm512_setzero_ps(), v);
            if (residual)
                v = _mm512_add_ps(v, widen(residual + i * ldr + 16 * c, mask));
            __m256i out = (__m256i)_mm512_cvtneps_pbh(v);
            _mm256_mask_storeu_epi16(y + i * ldy + 16 * c, mask, out);
        }
    }
}

/* x: m x k_len bfloat16 (row stride ldx); panels: ceil(n / 32) x ceil(k_len / 2) x 32 x 2;
 * bias: n or NULL; residual: m x n (row stride ldr) or NULL; y: m x n (row stride ldy). */
void bf16_products(const uint16_t *x, int64_t ldx, const uint16_t *panels, const uint16_t *bias,
                   const uint16_t *residual, int64_t ldr, uint16_t *y, int64_t ldy, int64_t m,
                   int64_t n, int64_t k_len, int relu, int threads)
{
    int64_t count = (n + NR - 1) / NR, pairs = (k_len + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < count; p++) {
        const uint16_t *panel = panels + p * pairs * 64;
        int64_t first = p * NR, width = n - first < NR ? n - first : NR;
        const uint16_t *b = bias ? bias + first : 0;
        int64_t r = 0;
        for (; r + MR <= m; r += MR)
            rows_of_panel(MR, x + r * ldx, ldx, k_len, panel, b,
                          residual ? residual + r * ldr + first : 0, ldr, y + r * ldy + first,
                          ldy, width, relu, r == 0);
        const uint16_t *xr = x + r * ldx;
        const uint16_t *rr = residual ? residual + r * ldr + first : 0;
        uint16_t *yr = y + r * ldy + first;
        switch (m - r) {
#define LAST(R) case R: rows_of_panel(R, xr, ldx, k_len, panel, b, rr, ldr, yr, ldy, width, relu, \
                                      r == 0); break;
        LAST(1) LAST(2) LAST(3) LAST(4) LAST(5) LAST(6) LAST(7)
        default: break;
        }
    }
}

/* rows (at most WMR) x `width` (at most 32) float32 outputs of a panel, from rows of x already
 * in bfloat16 pairs: each output summed pair after pair in order, whatever the rows beside it */
static inline __attribute__((always_inline)) void weight_tile(
    int rows, const uint16_t *xb, int64_t pairs, const uint16_t *panel, const float *bias,
    const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t width, int relu,
    int prefetch)
{
    __m512 acc[WMR][2];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = _mm512_setzero_ps();
        acc[i][1] = _mm512_setzero_ps();
        /* the outputs' lines asked for while the sums run: a batch's wide output (320 rows of
         * an 8000-word projection, 10 MB) is not in cache, and its stores waited on them */
        __builtin_prefetch(y + i * ldy, 1, 3);
        __builtin_prefetch(y + i * ldy + 16, 1, 3);
        if (residual) {
            __builtin_prefetch(residual + i * ldr, 0, 3);
            __builtin_prefetch(residual + i * ldr + 16, 0, 3);
        }
    }
    sum_pairs(rows, xb, 2 * pairs, pairs, panel, acc, prefetch);
    for (int c = 0; c < 2; c++) {
        __mmask16 mask = half_mask(width, c);
        if (!mask)
            continue;
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * c) : _mm512_setzero_ps();
        for (int i = 0; i < rows; i++)
            finish16(acc[i][c], b, mask, relu, residual ? residual + i * ldr + 16 * c : 0,
                     y + i * ldy + 16 * c);
    }
}

/* Each row count's tile a function of its own (as products.c's: no accumulator on the stack) */
#define WEIGHT_TILE(R)                                                                          \
    static __attribute__((noinline)) void weight_tile##R(                                       \
        const uint16_t *xb, int64_t pairs, const uint16_t *panel, const float *bias,           \
        const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t width, int relu,    \
        int prefetch)                                                                           \
    {                                                                                           \
        weight_tile(R, xb, pairs, panel, bias, residual, ldr, y, ldy, width, relu, prefetch);  \
    }
WEIGHT_TILE(1)
WEIGHT_TILE(2)
WEIGHT_TILE(3)
WEIGHT_TILE(4)
WEIGHT_TILE(5)
WEIGHT_TILE(6)
WEIGHT_TILE(7)
WEIGHT_TILE(8)
WEIGHT_TILE(9)
WEIGHT_TILE(10)
WEIGHT_TILE(11)
WEIGHT_TILE(12)

typedef void (*weight_tile_fn)(const uint16_t *, int64_t, const uint16_t *, const float *,
                               const float *, int64_t, float *, int64_t, int64_t, int, int);
static const weight_tile_fn weight_tiles[WMR + 1] = {
    0, weight_tile1, weight_tile2, weight_tile3, weight_tile4, weight_tile5, weight_tile6,
    weight_tile7, weight_tile8, weight_tile9, weight_tile10, weight_tile11, weight_tile12,
};

/* x: m x k_len floats (row stride ldx); panels as bf16_products'; bias: n floats or NULL;
 * residual: m x n floats (row stride ldr) or NULL; y: m x n floats (row stride ldy). Returns
 * -1 if it could not allocate x's bfloat16 rows. */
int bf16_weight_products(const float *x, int64_t ldx, const uint16_t *panels, const float *bias,
                         const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t m,
                         int64_t n, int64_t k_len, int relu, int threads)
{
    int64_t count = (n + NR - 1) / NR, pairs = (k_len + 1) / 2;
    uint16_t *xb = malloc((m * 2 * pairs + 32) * sizeof *xb);
    if (!xb)
        return -1;
    round_rows(x, ldx, m, k_len, 2 * pairs, xb);
    /* a block of rows across every panel, then the next: the outputs a panel writes stay a few
     * rows (a block's) apart in cache, not a whole batch's (a 320-row output projection ran at
     * half the rate of a 64-row one) */
    for (int64_t block = 0, end; block < m; block = end) {
        /* a few rows left over join the last block: a block of their own would stream every
         * panel again for them (a 32000x512 product at 64 rows ran 9% slower) */
        end = m - block < ROW_BLOCK + LEAST_BLOCK ? m : block + ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < count; p++) {
            const uint16_t *panel = panels + p * pairs * 64;
            int64_t first = p * NR, width = n - first < NR ? n - first : NR;
            for (int64_t r = block; r < end; r += WMR) {
                int rows = end - r < WMR ? (int)(end - r) : WMR;
                weight_tiles[rows](xb + r * 2 * pairs, pairs, panel, bias ? bias + first : 0,
                                   residual ? residual + r * ldr + first : 0, ldr,
                                   y + r * ldy + first, ldy, width, relu, r == block);
            }
        }
    }
    free(xb);
    return 0;
}

#else
int bf16_kernel_available(void) { return 0; }
#endif
