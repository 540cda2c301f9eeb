/* bf16_weight_products (bf16_products.c) on AMX tiles: float32 rows rounded to bfloat16 once
 * per product, summed into float32 by TDPBF16PS on the same bfloat16 weight panels, the bias,
 * relu and residual added in float32 after. Built with -mamx-tile -mamx-bf16 only where the CPU
 * has amx_bf16 (beamplugin.kernels.instruction_sets.source_flags); elsewhere, or where the
 * compiler refuses those flags, this file exports only amx_kernel_available() = 0.
 *
 * The panels' layout is already AMX's: a panel's pair g holds 32 channels x 2 bfloat16, so a
 * B tile of 16 pairs x 16 channels is read with a 128-byte stride from channel 0 or 16. Each
 * output element is summed 16 pairs (one tile) after another in order, its row alone in its
 * tile row: a row's bits do not depend on the rows beside it. Rows are rounded into a buffer
 * of whole tiles (16 rows, 16 pairs; zeros past the end), and a panel's last pairs are copied
 * into a zero-padded tile, so that tails multiply zeros, never memory past the weight's end.
 */
#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_rows.h"

#define NR 32     /* a panel's channels */
#define TR 16     /* a tile's rows */
#define TP 16     /* a tile's pairs: 64 bytes of bfloat16 a row */
#define BLOCK 32  /* rows a pass: two A tiles, four accumulators */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux gives a process AMX's tile data only once it asks (since 5.16); asked once. */
int amx_kernel_available(void)
{
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* every tile 16 rows of 64 bytes: 0-3 the sums (2 row tiles x 2 channel halves), 4-5 A, 6-7 B */
static void configure(void)
{
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = TR;
    }
    _tile_loadconfig(&config);
}

/* the sums of `rows` (at most 16) rows of a tile buffer out to y: bias, relu, residual */
static void finish(const float *sums, int64_t rows, const float *bias, const float *residual,
                   int64_t ldr, float *y, int64_t ldy, int64_t width, int relu)
{
    for (int c = 0; c < 2; c++) {
        __mmask16 mask = half_mask(width, c);
        if (!mask)
            continue;
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * c) : _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; i++)
            finish16(_mm512_loadu_ps(sums + i * NR + 16 * c), b, mask, relu,
                     residual ? residual + i * ldr + 16 * c : 0, y + i * ldy + 16 * c);
    }
}

/* bf16_weight_products' arguments and result (bf16_products.c) */
int bf16_amx_weight_products(const float *x, int64_t ldx, const uint16_t *panels,
                             const float *bias, const float *residual, int64_t ldr, float *y,
                             int64_t ldy, int64_t m, int64_t n, int64_t k_len, int relu,
                             int threads)
{
    int64_t count = (n + NR - 1) / NR, pairs = (k_len + 1) / 2;
    int64_t tiles = (pairs + TP - 1) / TP, width = tiles * TP * 2;
    int64_t padded = (m + BLOCK - 1) / BLOCK * BLOCK;
    if (m == 0)
        return 0;
    uint16_t *xb = aligned_alloc(64, padded * width * sizeof *xb);
    if (!xb)
        return -1;
    round_rows(x, ldx, m, k_len, width, xb);
    memset(xb + m * width, 0, (padded - m) * width * sizeof *xb);
    int64_t whole = pairs / TP, tail = pairs - whole * TP;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        configure(); /* a thread's own tile configuration */
        uint16_t last[TP * NR * 2] __attribute__((aligned(64)));
        float sums[BLOCK * NR] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const uint16_t *panel = panels + p * pairs * NR * 2;
            int64_t first = p * NR, columns = n - first < NR ? n - first : NR;
            if (tail) { /* the panel's last pairs, zeros after them */
                memset(last, 0, sizeof last);
                memcpy(last, panel + whole * TP * NR * 2, tail * NR * 2 * sizeof *last);
            }
            for (int64_t r = 0; r < m; r += BLOCK) {
                const uint16_t *a = xb + r * width;
                int64_t rows = m - r < BLOCK ? m - r : BLOCK;
                int second = rows > TR; /* the second row tile: only where it has rows (a step's
                                         * few rows take half the work); each row's sums alike */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t t = 0; t < tiles; t++) {
                    const uint16_t *b = t < whole ? panel + t * TP * NR * 2 : last;
                    _tile_loadd(6, b, NR * 2 * sizeof *b);
                    _tile_loadd(7, b + 32, NR * 2 * sizeof *b);
                    _tile_loadd(4, a + t * TP * 2, width * sizeof *a);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (second) {
                        _tile_loadd(5, a + TR * width + t * TP * 2, width * sizeof *a);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, sums, NR * sizeof *sums);
                _tile_stored(1, sums + 16, NR * sizeof *sums);
                _tile_stored(2, sums + TR * NR, NR * sizeof *sums);
                _tile_stored(3, sums + TR * NR + 16, NR * sizeof *sums);
                finish(sums, rows, bias ? bias + first : 0,
                       residual ? residual + r * ldr + first : 0, ldr, y + r * ldy + first, ldy,
                       columns, relu);
            }
        }
        _tile_release();
    }
    free(xb);
    return 0;
}

#else
int amx_kernel_available(void) { return 0; }
#endif
