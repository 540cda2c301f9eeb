/* Any other CPU: portable C on GCC's 4-float vectors, compiled without target flags (SSE2 on
 * x86-64, where a multiply-add is two roundings, not one; NEON on AArch64). The float32
 * products' register tile is 2 rows x 16 columns: 8 accumulators, four weight vectors and a
 * broadcast row value, within the 16 registers of x86-64's baseline. */
#include <string.h>

#define ISA_NAME "generic"
#define FUSED 0 /* a multiply-add rounds once */
#define LANES 4
#define TILE_ROWS 2
#define WIDE_ROWS 0 /* tiles of as many rows or fewer span the panel's 32 columns */
#define TILE_VECTORS 4

typedef float vf __attribute__((vector_size(16)));

static inline vf vf_load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vf_store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vf_set1(float a) { return (vf){a, a, a, a}; }
static inline vf vf_zero(void) { return (vf){0}; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; }

/* a > b ? a : b, each lane (b where either is NaN) */
static inline vf vf_max(vf a, vf b)
{
    for (int i = 0; i < LANES; i++)
        a[i] = a[i] > b[i] ? a[i] : b[i];
    return a;
}
/* a < b ? a : b, each lane (b where either is NaN) */
static inline vf vf_min(vf a, vf b)
{
    for (int i = 0; i < LANES; i++)
        a[i] = a[i] < b[i] ? a[i] : b[i];
    return a;
}
/* a / b, each lane, correctly rounded */
static inline vf vf_div(vf a, vf b) { return a / b; }
/* yes where x >= 0, else no (no where x is NaN), each lane */
static inline vf vf_if_nonnegative(vf x, vf yes, vf no)
{
    for (int i = 0; i < LANES; i++)
        yes[i] = x[i] >= 0.0f ? yes[i] : no[i];
    return yes;
}
/* 2^n from t = n + POW2_BIAS (isa.h; n integral, -127 <= n <= 127, 2^-127 given as 0):
 * n + 127 is t's low mantissa bits, moved into the exponent */
static inline vf vf_pow2_biased(vf t)
{
    unsigned bits[LANES];
    memcpy(bits, &t, sizeof t);
    for (int i = 0; i < LANES; i++)
        bits[i] <<= 23;
    memcpy(&t, bits, sizeof t);
    return t;
}

/* whether any lane is >= least or NaN */
static inline int vf_any_not_below(vf v, float least)
{
    for (int i = 0; i < LANES; i++)
        if (!(v[i] < least))
            return 1;
    return 0;
}
