/* bfloat16 matrix products for inference (--bf16), y = x W^T + b (then relu, or plus a
 * residual), on CPUs with AVX512-BF16: pairs of bfloat16 products summed into float32 with
 * vdpbf16ps, the bias, relu and residual added in float32, one rounding to bfloat16 at the end
 * (as oneDNN's matmul with its post-ops).
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
#include <string.h>

#define NR 32
#define MR 8
#define PREFETCH_PAIRS 128 /* 16 KB ahead, as the float32 kernel's 128 rows */

int bf16_kernel_available(void) { return 1; }

static inline __m512 widen(const uint16_t *p, __mmask16 mask)
{
    __m256i half = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
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
    __mmask16 masks[2] = {
        (__mmask16)(width >= 16 ? 0xFFFF : (1u << width) - 1),
        (__mmask16)(width >= 32 ? 0xFFFF : width <= 16 ? 0 : (1u << (width - 16)) - 1),
    };
    for (int c = 0; c < 2; c++) {
        __mmask16 mask = masks[c];
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

#else
int bf16_kernel_available(void) { return 0; }
#endif
