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

/* whether any lane is >= least or NaN (a NaN lane is not below: !(v < least)) */
static inline int vf_any_not_below(vf v, float least)
{
    uint32x4_t below = vcltq_f32(v, vdupq_n_f32(least));
    return vminvq_u32(below) == 0;
}
