/* AVX-512 (x86-64-v4: AVX512F, BW, DQ, VL): one vector is 16 floats in a zmm register, and 32
 * of them. The float32 products' register tile is 8 rows x 32 columns: 16 accumulators, the two
 * weight vectors and a broadcast row value (broadcast from memory into the fused multiply-add). */
#include <immintrin.h>

#define ISA_NAME "avx512"
#define FUSED 1 /* a multiply-add rounds once */
#define LANES 16
#define TILE_ROWS 8
#define WIDE_ROWS 0 /* tiles of as many rows or fewer span the panel's 32 columns */
#define TILE_VECTORS 2

typedef __m512 vf;

static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a b + c */

/* a > b ? a : b, each lane (b where either is NaN) */
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
/* a < b ? a : b, each lane (b where either is NaN) */
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
/* a / b, each lane, correctly rounded */
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
/* yes where x >= 0, else no (no where x is NaN), each lane */
static inline vf vf_if_nonnegative(vf x, vf yes, vf no)
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), no, yes);
}
/* 2^n from t = n + POW2_BIAS (isa.h; n integral, -127 <= n <= 127, 2^-127 given as 0):
 * n + 127 is t's low mantissa bits, moved into the exponent */
static inline vf vf_pow2_biased(vf t)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23));
}

/* whether any lane is >= least or NaN */
static inline int vf_any_not_below(vf v, float least)
{
    return _mm512_cmp_ps_mask(v, _mm512_set1_ps(least), _CMP_NLT_UQ) != 0;
}
