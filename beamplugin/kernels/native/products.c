/* Float32 matrix products for inference, y = x W^T + b (then relu, or plus a residual), on a
 * weight packed once into column panels: panel p holds W[32p : 32p + 32, :] transposed, K rows
 * of 32 floats, zero past W's last row. The same panels on every instruction set.
 *
 * Each output element is summed over k in order, one fused multiply-add at a time, whatever the
 * number of rows, the register tile, the panel or the thread that computes it: a row's result
 * has the same bits alone or among any rows, which is what lets a sentence decode the same
 * alone or batched, and the same bits on every set that fuses multiply-adds. The register tile
 * (TILE_ROWS rows x TILE_VECTORS vectors of a panel's columns) is the set's (isa/<set>.h), sized so
 * that no accumulator leaves its register. docs/speed.md has the measurements behind it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

#define PANEL 32
/* The tile's loops unrolled before GCC's scalar replacement: else (GCC 12 for AArch64) the
 * accumulators stay an array in memory, stored at every step of the inner loop. */
#define UNROLLED _Pragma("GCC unroll 16")
/* How far ahead a panel's first tile asks for the panel's rows: at a decoder step's few rows
 * the weights come from memory, and the hardware's own prefetch alone left a 3-layer
 * transformer's products 1.5x slower (docs/speed.md). Both cache lines of a 32-float row are
 * asked for, so a set whose tile is 16 columns wide finds the second half in cache. */
#define PREFETCH_ROWS 128

const char *instruction_set(void) { return ISA_NAME; }

/* The vectors of a tile of `rows` rows: up to WIDE_ROWS rows, the panel's whole width (more
 * independent chains of multiply-adds where few rows would leave them waiting on each other),
 * else the set's TILE_VECTORS. */
#define VECTORS_OF(rows) ((rows) <= WIDE_ROWS ? PANEL / LANES : TILE_VECTORS)

/* rows (at most TILE_ROWS) x `width` (at most the tile's columns) outputs from the tile's
 * columns of a panel (`panel` points at them; its rows are PANEL floats apart) */
static inline __attribute__((always_inline)) void tile(
    int rows, const float *x, int64_t ldx, const float *panel, int64_t k_len,
    const float *bias, const float *residual, int64_t ldr, float *y, int64_t ldy,
    int64_t width, int relu, int prefetch)
{
    const int vectors = VECTORS_OF(rows);
    width = width < vectors * LANES ? width : vectors * LANES; /* as it is: GCC learns the bound */
    vf acc[TILE_ROWS][PANEL / LANES];
    UNROLLED for (int i = 0; i < rows; i++)
        UNROLLED for (int v = 0; v < vectors; v++)
            acc[i][v] = vf_zero();
    for (int64_t k = 0; k < k_len; k++) {
        const float *w = panel + k * PANEL;
        if (prefetch) { /* past the panel's end: the next panel's rows */
            __builtin_prefetch(w + PREFETCH_ROWS * PANEL, 0, 3);
            __builtin_prefetch(w + PREFETCH_ROWS * PANEL + 16, 0, 3);
        }
        vf b[PANEL / LANES];
        UNROLLED for (int v = 0; v < vectors; v++)
            b[v] = vf_load(w + v * LANES);
        UNROLLED for (int i = 0; i < rows; i++) {
            vf a = vf_set1(x[i * ldx + k]);
            UNROLLED for (int v = 0; v < vectors; v++)
                acc[i][v] = vf_fma(a, b[v], acc[i][v]);
        }
    }
    UNROLLED for (int i = 0; i < rows; i++) {
        float out[PANEL];
        UNROLLED for (int v = 0; v < vectors; v++)
            vf_store(out + v * LANES, acc[i][v]);
        if (bias)
            for (int64_t j = 0; j < width; j++)
                out[j] += bias[j];
        if (relu)
            for (int j = 0; j < vectors * LANES; j++)
                out[j] = out[j] > 0 ? out[j] : 0;
        if (residual)
            for (int64_t j = 0; j < width; j++)
                out[j] += residual[i * ldr + j];
        memcpy(y + i * ldy, out, width * sizeof(float));
    }
}

/* Each row count's tile a function of its own: inlined into one, GCC for AArch64 spilled the
 * accumulators of the smaller tiles to the stack. */
#define TILE_OF(R)                                                                              \
    static __attribute__((noinline)) void tile##R(                                              \
        const float *x, int64_t ldx, const float *panel, int64_t k_len, const float *bias,     \
        const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t width, int relu,    \
        int prefetch)                                                                           \
    {                                                                                           \
        tile(R, x, ldx, panel, k_len, bias, residual, ldr, y, ldy, width, relu, prefetch);     \
    }
TILE_OF(1)
TILE_OF(2)
#if TILE_ROWS >= 3
TILE_OF(3)
#endif
#if TILE_ROWS >= 4
TILE_OF(4)
#endif
#if TILE_ROWS >= 5
TILE_OF(5)
#endif
#if TILE_ROWS >= 6
TILE_OF(6)
#endif
#if TILE_ROWS >= 7
TILE_OF(7)
#endif
#if TILE_ROWS >= 8
TILE_OF(8)
#endif
_Static_assert(TILE_ROWS >= 2 && TILE_ROWS <= 8, "tiles of 2 to 8 rows");

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const float *,
                        const float *, int64_t, float *, int64_t, int64_t, int, int);
/* tiles[r]: the tile of r rows */
static const tile_fn tiles[TILE_ROWS + 1] = {
    0, tile1, tile2,
#if TILE_ROWS >= 3
    tile3,
#endif
#if TILE_ROWS >= 4
    tile4,
#endif
#if TILE_ROWS >= 5
    tile5,
#endif
#if TILE_ROWS >= 6
    tile6,
#endif
#if TILE_ROWS >= 7
    tile7,
#endif
#if TILE_ROWS >= 8
    tile8,
#endif
};

/* The m rows of a panel's `columns` (at most 32): tiles of TILE_ROWS rows, then the rest (each
 * row count its own unrolled code), each tile across the panel in as many passes as it needs.
 * The first tile asks for the panel's rows ahead. */
static void rows_of_panel(const float *x, int64_t ldx, const float *panel, int64_t k_len,
                          const float *bias, const float *residual, int64_t ldr, float *y,
                          int64_t ldy, int64_t m, int64_t columns, int relu)
{
    for (int64_t r = 0; r < m; r += TILE_ROWS) {
        int rows = m - r < TILE_ROWS ? (int)(m - r) : TILE_ROWS;
        int64_t step = VECTORS_OF(rows) * LANES;
        for (int64_t c = 0; c < columns; c += step)
            tiles[rows](x + r * ldx, ldx, panel + c, k_len, bias ? bias + c : 0,
                        residual ? residual + r * ldr + c : 0, ldr, y + r * ldy + c, ldy,
                        columns - c < step ? columns - c : step, relu, r == 0 && c == 0);
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
        v16 acc = zero16();
        int64_t j = 0;
        for (; j + 16 <= n; j += 16)
            acc = add16(acc, load16(row + j));
        float sum = lanes_sum(acc);
        for (; j < n; j++)
            sum += row[j];
        float mean = sum / (float)n;
        v16 sq = zero16();
        for (j = 0; j + 16 <= n; j += 16) {
            v16 d = minus16(load16(row + j), mean);
            sq = fma16(d, d, sq);
        }
        float squares = lanes_sum(sq);
        for (; j < n; j++)
            squares = fma1(row[j] - mean, row[j] - mean, squares);
        float rstd = 1.0f / sqrtf(squares / (float)n + eps);
        for (j = 0; j < n; j++)
            row[j] = fma1((row[j] - mean) * rstd, gamma[j], beta[j]);
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
    int64_t count = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < count; p++) {
        const float *panel = panels + p * k_len * PANEL;
        int64_t first = p * PANEL, columns = n - first < PANEL ? n - first : PANEL;
        rows_of_panel(x, ldx, panel, k_len, bias ? bias + first : 0,
                      residual ? residual + first : 0, ldr, y + first, ldy, m, columns, relu);
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
