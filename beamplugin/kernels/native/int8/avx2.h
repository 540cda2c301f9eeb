/* int8 products on AVX2 (x86-64-v3; also AVX-512 CPUs without VNNI): vpmaddubsw multiplies
 * unsigned by signed byte pairs into 16 bits with saturation, so each activation enters as its
 * magnitude (at most 127) and its sign moves onto the weight (vpsignb): a pair is at most
 * 2 x 127 x 127 = 32258 and never saturates, and vpmaddwd adds the pairs of each channel's 4
 * bytes into its 32-bit lane. The sums are exact, as vpdpbusd's: the bits of the AVX512-VNNI
 * kernel and of torch's int8 path. The panels are vpdpbusd's (32 channels x 4 bytes a group);
 * the tile is 2 rows x the panel's 32 channels (four ymm of 8), 8 accumulators: four
 * instructions a vector and row make 32 multiply-adds, as many as a float32 fused multiply-add
 * makes in 4, so int8 gains here from reading a quarter of the bytes, not from arithmetic
 * (docs/speed.md). */
#include <immintrin.h>

#define INT8_SET "avx2"
#define INT8_TILE_ROWS 2
#define VECTORS 4 /* of 8 channels: a panel's 32 */
#define PREFETCH_GROUPS 128 /* 16 KB ahead, as the float32 kernel's 128 rows */

/* x's rows as int8 (k4 bytes each, 0 past k) and their scales, as int8_linear makes them:
 * scale max |x| / 127 (at least smallest), values rounded half to even; division, rounding and
 * conversion the scalar ones' (x / scale correctly rounded, then rint): the same bytes. */
static void quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t k4,
                          float smallest, int8_t *q, float *scales)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * ldx;
        __m256 most8 = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= k; j += 8) /* a NaN is passed over, as a > most ? a : most */
            most8 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(row + j)), most8);
        float lanes[8];
        _mm256_storeu_ps(lanes, most8);
        float most = 0.0f;
        for (int i = 0; i < 8; i++)
            most = lanes[i] > most ? lanes[i] : most;
        for (; j < k; j++)
            most = fabsf(row[j]) > most ? fabsf(row[j]) : most;
        float scale = most / 127.0f;
        scale = scale < smallest ? smallest : scale;
        scales[r] = scale;
        const __m256 divisor = _mm256_set1_ps(scale);
        int8_t *out = q + r * k4;
        for (j = 0; j + 32 <= k; j += 32) {
            __m256i v[4];
            for (int part = 0; part < 4; part++) {
                __m256 d = _mm256_div_ps(_mm256_loadu_ps(row + j + 8 * part), divisor);
                d = _mm256_round_ps(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v[part] = _mm256_cvtps_epi32(d);
            }
            /* within +-127: the saturating packs keep each value; then back in order */
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                               _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i *)(out + j), _mm256_permutevar8x32_epi32(bytes, order));
        }
        for (; j < k; j++)
            out[j] = (int8_t)rintf(row[j] / scale);
        for (; j < k4; j++)
            out[j] = 0;
    }
}

static inline __attribute__((always_inline)) void tile(
    int rows, const int8_t *q, int64_t k4, const int8_t *panel, const float *channel_scales,
    const float *row_scales, const float *bias, const float *residual, int64_t ldr, float *y,
    int64_t ldy, int64_t width, int prefetch, int relu)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[INT8_TILE_ROWS][VECTORS];
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < VECTORS; v++)
            acc[i][v] = _mm256_setzero_si256();
    int64_t groups = k4 / 4;
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *w = panel + g * 128;
        if (prefetch) {
            _mm_prefetch((const char *)(w + PREFETCH_GROUPS * 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PREFETCH_GROUPS * 128 + 64), _MM_HINT_T0);
        }
        __m256i weights[VECTORS];
        for (int v = 0; v < VECTORS; v++)
            weights[v] = _mm256_loadu_si256((const __m256i *)(w + 32 * v));
        for (int i = 0; i < rows; i++) {
            int32_t four;
            memcpy(&four, q + i * k4 + g * 4, sizeof four);
            __m256i a = _mm256_set1_epi32(four), magnitude = _mm256_abs_epi8(a);
            for (int v = 0; v < VECTORS; v++) {
                __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(weights[v], a));
                acc[i][v] = _mm256_add_epi32(acc[i][v], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    /* scaled back as int8_linear does, one rounding an operation */
    for (int i = 0; i < rows; i++) {
        int32_t summed[8 * VECTORS];
        for (int v = 0; v < VECTORS; v++)
            _mm256_storeu_si256((__m256i *)(summed + 8 * v), acc[i][v]);
        float out[8 * VECTORS];
        for (int j = 0; j < 8 * VECTORS; j++) {
            float v = (float)summed[j] * channel_scales[j < width ? j : 0];
            out[j] = v * row_scales[i];
        }
        if (bias)
            for (int64_t j = 0; j < width; j++)
                out[j] += bias[j];
        if (relu) /* NaN stays NaN, as relu_ */
            for (int j = 0; j < 8 * VECTORS; j++)
                out[j] = out[j] < 0.0f ? 0.0f : out[j];
        if (residual)
            for (int64_t j = 0; j < width; j++)
                out[j] += residual[i * ldr + j];
        memcpy(y + i * ldy, out, width * sizeof(float));
    }
}

#define TILE(R, first) tile(R, q + (first) * k4, k4, panel, channel_scales, row_scales + (first), \
                            bias, residual ? residual + (first) * ldr : 0, ldr, \
                            y + (first) * ldy, ldy, width, (first) == 0, relu)

/* the m rows of one panel (its `width` channels, at most 32); the panel's sums are vpdpbusd's
 * correction, not needed here */
static void rows_of_panel(const int8_t *q, int64_t k4, const int8_t *panel, const int32_t *sums,
                          const float *channel_scales, const float *row_scales,
                          const float *bias, const float *residual, int64_t ldr, float *y,
                          int64_t ldy, int64_t m, int64_t width, int relu)
{
    (void)sums;
    int64_t r = 0;
    for (; r + INT8_TILE_ROWS <= m; r += INT8_TILE_ROWS)
        TILE(INT8_TILE_ROWS, r);
    if (r < m)
        TILE(1, r);
}
#undef TILE
#undef VECTORS
