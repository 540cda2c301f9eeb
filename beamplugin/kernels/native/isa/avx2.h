/* AVX2 + FMA (x86-64-v3): one vector is 8 floats in a ymm register, and 16 of them. The float32
 * products' register tile is 6 rows x 16 columns (half of a 32-wide panel at a time): 12
 * accumulators, the two weight vectors and a broadcast row value, 15 registers. A 16-float value
 * (the order of the lane sums shared by every set) is two vectors here. */
#include <immintrin.h>

#define ISA_NAME "avx2"
#define FUSED 1 /* a multiply-add rounds once */
#define LANES 8
#define TILE_ROWS 6
#define WIDE_ROWS 2 /* tiles of as many rows or fewer span the panel's 32 columns */
#define TILE_VECTORS 2

typedef __m256 vf;

static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); } /* a b + c */

/* a > b ? a : b, each lane (b where either is NaN) */
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
/* a < b ? a : b, each lane (b where either is NaN) */
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
/* a / b, each lane, correctly rounded */
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
/* yes where x >= 0, else no (no where x is NaN), each lane */
static inline vf vf_if_nonnegative(vf x, vf yes, vf no)
{
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
/* 2^n from t = n + POW2_BIAS (isa.h; n integral, -127 <= n <= 127, 2^-127 given as 0):
 * n + 127 is t's low mantissa bits, moved into the exponent */
static inline vf vf_pow2_biased(vf t)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23));
}

/* whether any lane is >= least or NaN */
static inline int vf_any_not_below(vf v, float least)
{
    return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(least), _CMP_NLT_UQ)) != 0;
}
