/* What the float32 rows' bfloat16 products share (bf16_products.c's AVX512-BF16 kernel and
 * bf16_amx.c's AMX one): the rows rounded to bfloat16 once per product, and each output's
 * float32 sum finished (bias, then relu or the residual). Included where AVX512-BF16 is
 * compiled in. */
#ifndef BEAMPLUGIN_BF16_ROWS_H
#define BEAMPLUGIN_BF16_ROWS_H

#include <immintrin.h>
#include <stdint.h>

/* rows x k_len floats (row stride ldx) rounded to bfloat16 (to nearest even), `width` values a
 * row: zeros past k_len (a pair's partner past the end multiplies the panels' zeros) */
static void round_rows(const float *x, int64_t ldx, int64_t rows, int64_t k_len, int64_t width,
                       uint16_t *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * ldx;
        uint16_t *to = out + r * width;
        for (int64_t j = 0; j < width; j += 32) {
            int64_t left = k_len - j;
            __mmask16 lo = (__mmask16)(left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1);
            __mmask16 hi = (__mmask16)(left >= 32 ? 0xFFFF : left <= 16 ? 0
                                                                         : (1u << (left - 16)) - 1);
            __m512 a = _mm512_maskz_loadu_ps(lo, row + j), b = _mm512_maskz_loadu_ps(hi, row + j + 16);
            __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            int64_t count = width - j < 32 ? width - j : 32;
            _mm512_mask_storeu_epi16(to + j, (__mmask32)(count >= 32 ? 0xFFFFFFFFu
                                                                     : (1u << count) - 1), both);
        }
    }
}

/* the lanes of a panel's `width` (at most 32) outputs in its two halves of 16 */
static inline __mmask16 half_mask(int64_t width, int half)
{
    int64_t lanes = width - 16 * half;
    return (__mmask16)(lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (1u << lanes) - 1);
}

/* 16 outputs (lanes `mask`) of a row: its sums plus the bias, then relu or plus the residual
 * (NULL: none), stored to y */
static inline void finish16(__m512 sums, __m512 bias, __mmask16 mask, int relu,
                            const float *residual, float *y)
{
    __m512 v = _mm512_add_ps(sums, bias);
    if (relu)
        v = _mm512_max_ps(_mm512_setzero_ps(), v);
    if (residual)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, residual));
    _mm512_mask_storeu_ps(y, mask, v);
}

#endif
