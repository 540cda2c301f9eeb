/* NEON (AArch64 Advanced SIMD, every ARMv8-A CPU): one vector is 4 floats in a q register, and
 * 32 of them. The float32 products' register tile is 5 rows x 16 columns: 20 accumulators, the
 * four weight vectors and the five rows' values (multiplied by lane), 29 registers. */
#include <arm_neon.h>

#define ISA_NAME "neon"
#define FUSED 1 /* a multiply-add rounds once */
#define LANES 4
#define TILE_ROWS 5
#define WIDE_ROWS 2 /* tiles of as many rows or fewer span the panel's 32 columns */
#define TILE_VECTORS 4

typedef float32x4_t vf;

static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vf v) { vst1q_f32(p, v); }
static inline vf vf_set1(float a) { return vdupq_n_f32(a); }
static inline vf vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); } /* a b + c, fused */

/* a > b ? a : b, each lane (b where either is NaN: not fmax's NaN) */
static inline vf vf_max(vf a, vf b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
/* a < b ? a : b, each lane (b where either is NaN: not fmin's NaN) */
static inline vf vf_min(vf a, vf b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
/* a / b, each lane, correctly rounded */
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
/* yes where x >= 0, else no (no where x is NaN), each lane */
static inline vf vf_if_nonnegative(vf x, vf yes, vf no)
{
    return vbslq_f32(vcgeq_f32(x, vdupq_n_f32(0.0f)), yes, no);
}
/* 2^n from t = n + POW2_BIAS (isa.h; n integral, -127 <= n <= 127, 2^-127 given as 0):
 * n + 127 is t's low mantissa bits, moved into the exponent */
static inline vf vf_pow2_biased(vf t)
{
    return vreinterpretq_f32_s32(vshlq_n_s32(vreinterpretq_s32_f32(t), 23));
}

/* whether any lane is >= least or NaN (a NaN lane is not below: !(v < least)) */
static inline int vf_any_not_below(vf v, float least)
{
    uint32x4_t below = vcltq_f32(v, vdupq_n_f32(least));
    return vminvq_u32(below) == 0;
}
