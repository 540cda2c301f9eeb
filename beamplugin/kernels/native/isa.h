/* The instruction set a build is for: one of isa/<set>.h, picked by the -DBEAMPLUGIN_ISA_<NAME>
 * that beamplugin/kernels/instruction_sets.py passes with the set's target flags (without
 * one, the best the compiler's target flags allow: a build by hand, or a check of the code).
 * Each header gives its float vector `vf` (LANES floats) with the same operations, and the
 * float32 products' register tile for its registers (TILE_ROWS x TILE_VECTORS vectors).
 *
 * On top of them, 16-float values (v16: one vector or several) whose lane sums fold in one
 * fixed order on every set, so that a kernel gives the same bits whichever set computes it
 * (where the set fuses multiply-adds: all but generic on x86-64). */
#ifndef BEAMPLUGIN_ISA_H
#define BEAMPLUGIN_ISA_H

#if !defined(BEAMPLUGIN_ISA_AVX512) && !defined(BEAMPLUGIN_ISA_AVX2) && \
    !defined(BEAMPLUGIN_ISA_NEON) && !defined(BEAMPLUGIN_ISA_GENERIC)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define BEAMPLUGIN_ISA_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define BEAMPLUGIN_ISA_AVX2
#elif defined(__aarch64__)
#define BEAMPLUGIN_ISA_NEON
#else
#define BEAMPLUGIN_ISA_GENERIC
#endif
#endif

#if defined(BEAMPLUGIN_ISA_AVX512)
#include "isa/avx512.h"
#elif defined(BEAMPLUGIN_ISA_AVX2)
#include "isa/avx2.h"
#elif defined(BEAMPLUGIN_ISA_NEON)
#include "isa/neon.h"
#elif defined(BEAMPLUGIN_ISA_GENERIC)
#include "isa/generic.h"
#endif

#define PARTS (16 / LANES)

/* 1.5 x 2^23 + 127: a float x (|x| < 2^22) plus this rounds to an integer n + POW2_BIAS, a
 * float whose low mantissa bits are n + 127 (vf_pow2_biased's 2^n) */
#define POW2_BIAS 12583039.0f

typedef struct {
    vf part[PARTS];
} v16;

static inline v16 load16(const float *p)
{
    v16 v;
    for (int i = 0; i < PARTS; i++)
        v.part[i] = vf_load(p + i * LANES);
    return v;
}

static inline void store16(float *p, v16 v)
{
    for (int i = 0; i < PARTS; i++)
        vf_store(p + i * LANES, v.part[i]);
}

static inline v16 zero16(void)
{
    v16 v;
    for (int i = 0; i < PARTS; i++)
        v.part[i] = vf_zero();
    return v;
}

static inline v16 add16(v16 a, v16 b)
{
    for (int i = 0; i < PARTS; i++)
        a.part[i] = vf_add(a.part[i], b.part[i]);
    return a;
}

/* a + s, each lane */
static inline v16 plus16(v16 a, float s)
{
    vf b = vf_set1(s);
    for (int i = 0; i < PARTS; i++)
        a.part[i] = vf_add(a.part[i], b);
    return a;
}

/* a - s, each lane */
static inline v16 minus16(v16 a, float s)
{
    vf b = vf_set1(s);
    for (int i = 0; i < PARTS; i++)
        a.part[i] = vf_sub(a.part[i], b);
    return a;
}

/* exp's lower clamp: from about -87.7 down (expf's subnormal results, and -inf) its 2^n is
 * 2^-127, whose exponent bits are 0: an exp of exactly 0 */
#define EXP_LOWEST -88.0f

/* exp(x) for x <= 0 (NaN stays NaN): Cephes' expf polynomial (within 2 ulp; torch's Sleef exp
 * differs from it as much), its 2^n put in the exponent bits */
static inline vf vf_exp_nonpositive(vf x)
{
    vf clamped = vf_max(vf_set1(EXP_LOWEST), x); /* x where NaN */
    vf biased = vf_fma(clamped, vf_set1(1.44269504088896341f), vf_set1(POW2_BIAS));
    vf n = vf_sub(biased, vf_set1(POW2_BIAS));
    vf r = vf_fma(n, vf_set1(-0.693359375f), clamped); /* ln 2 in two parts: r exact */
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_add(vf_fma(vf_mul(p, r), r, r), vf_set1(1.0f));
    return vf_mul(p, vf_pow2_biased(biased));
}

/* exp(x - most), each lane (x <= most, softmax's terms) */
static inline v16 exp_minus16(v16 x, float most)
{
    x = minus16(x, most);
    for (int i = 0; i < PARTS; i++)
        x.part[i] = vf_exp_nonpositive(x.part[i]);
    return x;
}

/* a b + c, one rounding each lane (two on generic x86-64) */
static inline v16 fma16(v16 a, v16 b, v16 c)
{
    for (int i = 0; i < PARTS; i++)
        c.part[i] = vf_fma(a.part[i], b.part[i], c.part[i]);
    return c;
}

/* s b + c */
static inline v16 scaled_fma16(float s, v16 b, v16 c)
{
    vf a = vf_set1(s);
    for (int i = 0; i < PARTS; i++)
        c.part[i] = vf_fma(a, b.part[i], c.part[i]);
    return c;
}

/* a b + c for one float: one rounding where the set fuses multiply-adds, as its vectors do */
static inline float fma1(float a, float b, float c)
{
#if FUSED
    return __builtin_fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* whether any lane is >= least, or NaN */
static inline int any_not_below16(v16 v, float least)
{
    int any = 0;
    for (int i = 0; i < PARTS; i++)
        any |= vf_any_not_below(v.part[i], least);
    return any;
}

/* the 16 lanes summed in halves, a fixed order whatever the data and the set: lanes i and
 * i + 8, then i and i + 4 of those, then (0 + 2) + (1 + 3) */
static inline float lanes_sum(v16 v)
{
    float lane[16], half[8], quarter[4];
    store16(lane, v);
    for (int i = 0; i < 8; i++)
        half[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; i++)
        quarter[i] = half[i] + half[i + 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

#endif
