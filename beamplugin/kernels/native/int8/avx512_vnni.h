/* int8 products on AVX512-VNNI: vpdpbusd multiplies 4 unsigned by 4 signed bytes and adds them
 * to a 32-bit lane, so activations enter shifted by 128 (unsigned) and 128 x each channel's sum
 * of weights is taken back. Tile: 8 rows x 32 channels, 16 zmm accumulators. */
#include <immintrin.h>

#define INT8_SET "avx512_vnni"
#define INT8_TILE_ROWS 8
#define PREFETCH_GROUPS 128 /* 16 KB ahead, as the float32 kernel's 128 rows */

/* the first n lanes of 16 (all of them from 16 on) */
static inline __mmask16 first_lanes(int64_t n)
{
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* x's rows as int8 + 128 (k4 bytes each, 128 past k) and their scales, as int8_linear makes
 * them: scale max |x| / 127 (at least smallest), values rounded half to even. Written with
 * intrinsics: GCC's own vectorization of the scalar loops took 2 cycles a value, more than the
 * products of a 256-channel weight (docs/speed.md). Division, rounding and conversion are the
 * scalar ones' (x / scale correctly rounded, then rint): the same bytes. */
static void quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t k4,
                          float smallest, uint8_t *q, float *scales)
{
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i offset = _mm512_set1_epi32(128);
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * ldx;
        __m512 most16 = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 16) {
            __mmask16 mask = first_lanes(k - j);
            __m512 a = _mm512_andnot_ps(sign, _mm512_maskz_loadu_ps(mask, row + j));
            most16 = _mm512_max_ps(a, most16); /* a NaN is passed over, as a > most ? a : most */
        }
        float most = _mm512_reduce_max_ps(most16);
        float scale = most / 127.0f;
        scale = scale < smallest ? smallest : scale;
        scales[r] = scale;
        const __m512 divisor = _mm512_set1_ps(scale);
        uint8_t *out = q + r * k4;
        for (int64_t j = 0; j < k; j += 16) {
            __mmask16 mask = first_lanes(k - j);
            __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, row + j), divisor);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(v), offset);
            _mm_mask_storeu_epi8(out + j, mask, _mm512_cvtepi32_epi8(shifted));
        }
        for (int64_t j = k; j < k4; j++)
            out[j] = 128;
    }
}

static inline __attribute__((always_inline)) void tile(
    int rows, const uint8_t *q, int64_t k4, const int8_t *panel, const int32_t *sums,
    const float *channel_scales, const float *row_scales, const float *bias,
    const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t width, int relu,
    int prefetch)
{
    __m512i acc[INT8_TILE_ROWS][2];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = _mm512_setzero_si512();
        acc[i][1] = _mm512_setzero_si512();
    }
    int64_t groups = k4 / 4;
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *w = panel + g * 128;
        if (prefetch) {
            _mm_prefetch((const char *)(w + PREFETCH_GROUPS * 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PREFETCH_GROUPS * 128 + 64), _MM_HINT_T0);
        }
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        for (int i = 0; i < rows; i++) {
            int32_t four;
            memcpy(&four, q + i * k4 + g * 4, sizeof four);
            __m512i a = _mm512_set1_epi32(four);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], a, w0);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], a, w1);
        }
    }
    /* The sums to memory first: indexed by the runtime channel half below, the accumulators
     * themselves would be kept addressable, one spilled to the stack in the loop above (2.5x
     * slower at 320 rows than oneDNN's int8 products; docs/speed.md). */
    int32_t summed[INT8_TILE_ROWS][2][16];
    for (int i = 0; i < rows; i++) {
        _mm512_storeu_si512(summed[i][0], acc[i][0]);
        _mm512_storeu_si512(summed[i][1], acc[i][1]);
    }
    /* scaled back as int8_linear does, 16 channels at a time (masked past the weight's end) */
    __mmask16 masks[2] = {first_lanes(width), width <= 16 ? 0 : first_lanes(width - 16)};
    for (int c = 0; c < 2; c++) {
        if (!masks[c])
            continue;
        __mmask16 mask = masks[c];
        __m512i shift = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mask, sums + 16 * c),
                                           _mm512_set1_epi32(128));
        __m512 scales = _mm512_maskz_loadu_ps(mask, channel_scales + 16 * c);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * c) : _mm512_setzero_ps();
        for (int i = 0; i < rows; i++) {
            __m512i sums_of_row = _mm512_loadu_si512(summed[i][c]);
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums_of_row, shift));
            v = _mm512_mul_ps(v, scales);
            v = _mm512_mul_ps(v, _mm512_set1_ps(row_scales[i]));
            if (bias)
                v = _mm512_add_ps(v, b);
            if (relu)
                v = _mm512_max_ps(_mm512_setzero_ps(), v); /* NaN stays NaN, as relu_ */
            if (residual)
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, residual + i * ldr + 16 * c));
            _mm512_mask_storeu_ps(y + i * ldy + 16 * c, mask, v);
        }
    }
}

#define TILE(R, first) tile(R, q + (first) * k4, k4, panel, sums, channel_scales, \
                            row_scales + (first), bias, residual ? residual + (first) * ldr : 0, \
                            ldr, y + (first) * ldy, ldy, width, relu, (first) == 0)

/* the m rows of one panel (its `width` channels, at most 32) */
static void rows_of_panel(const uint8_t *q, int64_t k4, const int8_t *panel, const int32_t *sums,
                          const float *channel_scales, const float *row_scales,
                          const float *bias, const float *residual, int64_t ldr, float *y,
                          int64_t ldy, int64_t m, int64_t width, int relu)
{
    int64_t r = 0;
    for (; r + INT8_TILE_ROWS <= m; r += INT8_TILE_ROWS)
        TILE(INT8_TILE_ROWS, r);
    switch (m - r) {
    case 1: TILE(1, r); break;
    case 2: TILE(2, r); break;
    case 3: TILE(3, r); break;
    case 4: TILE(4, r); break;
    case 5: TILE(5, r); break;
    case 6: TILE(6, r); break;
    case 7: TILE(7, r); break;
    default: break;
    }
}
#undef TILE
