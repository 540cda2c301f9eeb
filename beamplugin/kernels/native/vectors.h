/* The 16-float vectors our float kernels compute with: GCC's vector extension, one AVX-512
 * register or two AVX2 ones (compiled with -march for this CPU). */
#ifndef BEAMPLUGIN_VECTORS_H
#define BEAMPLUGIN_VECTORS_H

#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* the 16 lanes summed in halves: a fixed order, whatever the data */
static inline float lanes_sum(v16 v)
{
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
            + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3)
               + __builtin_shufflevector(half, half, 4, 5, 6, 7);
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

#endif
