/* Float32 matrix products for inference, y = x W^T + b (then relu, or plus a residual), on a
 * weight packed once into column panels: panel p holds W[32p : 32p + 32, :] transposed, K rows
 * of 32 floats, zero past W's last row.
 *
 * Each output element is summed over k in order, one fused multiply-add at a time, whatever the
 * number of rows, the row blocking, the panel or the thread that computes it: a row's result
 * has the same bits alone or among any rows, which is what lets a sentence decode the same
 * alone or batched. Vectors are GCC's (compiled with -march for this CPU): 16 floats are one
 * AVX-512 register or two AVX2 ones. docs/speed.md has the measurements behind it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NR 32
/* How far ahead a panel's first row block asks for the panel's rows: at a decoder step's few
 * rows the weights come from memory, and the hardware's own prefetch alone left a 3-layer
 * transformer's products 1.5x slower (docs/speed.md). */
#define PREFETCH_ROWS 128
#ifdef __AVX512F__
#define MR 8 /* 16 accumulators of 32 registers */
#else
#define MR 3 /* 12 accumulators of 16 registers */
#endif

#include "vectors.h"

static inline __attribute__((always_inline)) void rows_of_panel(
    int rows, const float *x, int64_t ldx, const float *panel, int64_t k_len,
    const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
    int64_t width, int relu, int prefetch)
{
    v16 acc[MR][2];
    for (int i = 0; i < rows; i++) {
        acc[i][0] = (v16){0};
        acc[i][1] = (v16){0};
    }
    for (int64_t k = 0; k < k_len; k++) {
        if (prefetch) { /* past the panel's end: the next panel's rows */
            __builtin_prefetch(panel + (k + PREFETCH_ROWS) * NR, 0, 3);
            __builtin_prefetch(panel + (k + PREFETCH_ROWS) * NR + 16, 0, 3);
        }
        v16 b0 = load16(panel + k * NR), b1 = load16(panel + k * NR + 16);
        for (int i = 0; i < rows; i++) {
            float a = x[i * ldx + k];
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    for (int i = 0; i < rows; i++) {
        float out[NR];
        memcpy(out, &acc[i][0], sizeof(v16));
        memcpy(out + 16, &acc[i][1], sizeof(v16));
        if (bias)
            for (int64_t j = 0; j < width; j++) out[j] += bias[j];
        if (relu)
            for (int j = 0; j < NR; j++) out[j] = out[j] > 0 ? out[j] : 0;
        if (residual)
            for (int64_t j = 0; j < width; j++) out[j] += residual[i * ldr + j];
        memcpy(y + i * ldy, out, width * sizeof(float));
    }
}

/* layer norm of each row of y (n wide) in place: (y - mean) / sqrt(var + eps) * gamma + beta,
 * mean and variance over the row, the sums in a fixed order of 16 lanes */
static void normalize_rows(float *y, int64_t ldy, int64_t m, int64_t n, const float *gamma,
                           const float *beta, float eps, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 1)
    for (int64_t r = 0; r < m; r++) {
        float *row = y + r * ldy;
        v16 acc = {0};
        int64_t j = 0;
        for (; j + 16 <= n; j += 16)
            acc += load16(row + j);
        float sum = lanes_sum(acc);
        for (; j < n; j++)
            sum += row[j];
        float mean = sum / (float)n;
        v16 sq = {0};
        for (j = 0; j + 16 <= n; j += 16) {
            v16 d = load16(row + j) - mean;
            sq += d * d;
        }
        float squares = lanes_sum(sq);
        for (; j < n; j++)
            squares += (row[j] - mean) * (row[j] - mean);
        float rstd = 1.0f / sqrtf(squares / (float)n + eps);
        for (j = 0; j < n; j++)
            row[j] = (row[j] - mean) * rstd * gamma[j] + beta[j];
    }
}

/* x: m x k_len (row stride ldx); panels: ceil(n / 32) x k_len x 32; bias: n, or NULL;
 * residual: m x n (row stride ldr), or NULL; y: m x n (row stride ldy); gamma, beta: n, or
 * NULL: then each row of y layer-normed (after the residual). */
void products(const float *x, int64_t ldx, const float *panels, const float *bias,
              const float *residual, int64_t ldr, float *y, int64_t ldy,
              int64_t m, int64_t n, int64_t k_len, int relu, const float *gamma,
              const float *beta, float eps, int threads)
{
    int64_t count = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < count; p++) {
        const float *panel = panels + p * k_len * NR;
        int64_t first = p * NR, width = n - first < NR ? n - first : NR;
        int64_t r = 0;
        for (; r + MR <= m; r += MR)
            rows_of_panel(MR, x + r * ldx, ldx, panel, k_len, bias ? bias + first : 0,
                          residual ? residual + r * ldr + first : 0, ldr,
                          y + r * ldy + first, ldy, width, relu, r == 0);
        const float *xr = x + r * ldx;
        const float *rr = residual ? residual + r * ldr + first : 0;
        const float *br = bias ? bias + first : 0;
        float *yr = y + r * ldy + first;
        switch (m - r) { /* the last rows, each count its own unrolled loop */
#define LAST(R) case R: rows_of_panel(R, xr, ldx, panel, k_len, br, rr, ldr, yr, ldy, width, relu, r == 0); break;
        LAST(1) LAST(2)
#if MR > 3
        LAST(3) LAST(4) LAST(5) LAST(6) LAST(7)
#endif
        default: break;
        }
    }
    if (gamma)
        normalize_rows(y, ldy, m, n, gamma, beta, eps, threads);
}

/* y = x layer-normed row by row (normalize_rows' order and bits; x may be y): a pre-norm
 * sublayer's input, or an int8 product's post-norm */
void layer_norm_rows(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t m, int64_t n,
                     const float *gamma, const float *beta, float eps, int threads)
{
    for (int64_t r = 0; r < m && x != y; r++)
        memcpy(y + r * ldy, x + r * ldx, n * sizeof(float));
    normalize_rows(y, ldy, m, n, gamma, beta, eps, threads);
}
