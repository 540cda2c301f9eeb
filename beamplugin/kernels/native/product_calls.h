/* The products a layer calls through the pointers Python gives (products.c's float32 panels,
 * int8_products.c's int8 panels, bf16_products.c's float32 rows on bfloat16 weights), and one
 * dispatch by a weight's kind: shared by transformer_layers.c and convs2s_layers.c. */
#ifndef BEAMPLUGIN_PRODUCT_CALLS_H
#define BEAMPLUGIN_PRODUCT_CALLS_H

#include <stdint.h>

#define PARALLEL_WORK (1 << 17) /* native_library.PARALLEL_WORK */

typedef void (*products_fn)(const float *x, int64_t ldx, const float *panels, const float *bias,
                            const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t m,
                            int64_t n, int64_t k_len, int relu, const float *gamma,
                            const float *beta, float eps, int threads);
typedef int (*int8_products_fn)(const float *x, int64_t ldx, int64_t k, float smallest,
                                const void *panels, const int32_t *sums,
                                const float *channel_scales, const float *bias,
                                const float *residual, int64_t ldr, float *y, int64_t ldy,
                                int64_t m, int64_t n, int relu, int threads);
typedef int (*bf16_products_fn)(const float *x, int64_t ldx, const void *panels,
                                const float *bias, const float *residual, int64_t ldr, float *y,
                                int64_t ldy, int64_t m, int64_t n, int64_t k_len, int relu,
                                int threads);
typedef void (*norm_fn)(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t m, int64_t n,
                        const float *gamma, const float *beta, float eps, int threads);

struct product { /* a packed weight [out, in], its bias and a post-norm (gamma NULL: none) */
    const void *panels; /* float32, int8 where sums is not NULL, bfloat16 where bf16 */
    const int32_t *sums;
    const float *scales, *bias, *gamma, *beta;
    float eps;
    int64_t out, in;
    int bf16;
};

/* the kernels a product calls (in this order in each step's struct, as Python lays it out) */
struct product_kernels {
    products_fn products;
    int8_products_fn int8_products;
    bf16_products_fn bf16_products;
    float smallest; /* an int8 row scale's least */
    norm_fn norm;
};

/* `threads` where the work is large enough to share, else 1 */
static inline int threads_for_work(int threads, int64_t work)
{
    return work >= PARALLEL_WORK ? threads : 1;
}

/* y [rows, p->out] (row stride p->out) = x p^T + bias (+ residual, row stride p->out) (relu),
 * then p's post-norm: 0, or -1 if an int8 or bf16 product could not allocate its rounded
 * rows */
static inline int call_product(const struct product_kernels *k, int64_t rows, int threads,
                               const struct product *p, const float *x, int64_t ldx,
                               const float *residual, float *y, int relu)
{
    int t = threads_for_work(threads, rows * p->out * p->in);
    if (p->bf16) {
        if (k->bf16_products(x, ldx, p->panels, p->bias, residual, residual ? p->out : 0, y,
                             p->out, rows, p->out, p->in, relu, t))
            return -1;
    } else if (!p->sums) {
        k->products(x, ldx, p->panels, p->bias, residual, residual ? p->out : 0, y, p->out, rows,
                    p->out, p->in, relu, p->gamma, p->beta, p->eps, t);
        return 0;
    } else if (k->int8_products(x, ldx, p->in, k->smallest, p->panels, p->sums, p->scales,
                                p->bias, residual, residual ? p->out : 0, y, p->out, rows,
                                p->out, relu, t))
        return -1;
    if (p->gamma)
        k->norm(y, p->out, y, p->out, rows, p->out, p->gamma, p->beta, p->eps,
                threads_for_work(threads, rows * p->out * 64));
    return 0;
}

#endif
