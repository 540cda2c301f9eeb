/* beamplugin/kernels/native/bf16_amx.c on a CPU without AMX: its tile intrinsics done in C as
 * Intel's pseudocode defines them (TDPBF16PS: each pair's products added to the float32 sum one
 * at a time, the even position's first), so that the kernel's layouts, tails and tile rows are
 * tested wherever AVX512-BF16 runs (tests/test_bf16_products.py builds this with
 * -D__AMX_TILE__ -D__AMX_BF16__ and no AMX flags). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static _Thread_local struct {
    int rows, colsb;
    uint8_t data[16 * 64];
} tiles[8];

static void load_config(const void *config)
{
    const uint8_t *p = config;
    for (int t = 0; t < 8; t++) {
        uint16_t colsb;
        memcpy(&colsb, p + 16 + 2 * t, sizeof colsb);
        tiles[t].colsb = colsb;
        tiles[t].rows = p[48 + t];
    }
}

static void zero(int t) { memset(tiles[t].data, 0, sizeof tiles[t].data); }

static void load(int t, const void *base, long stride)
{
    for (int r = 0; r < tiles[t].rows; r++)
        memcpy(tiles[t].data + r * 64, (const char *)base + r * stride, tiles[t].colsb);
}

static void store(int t, void *base, long stride)
{
    for (int r = 0; r < tiles[t].rows; r++)
        memcpy((char *)base + r * stride, tiles[t].data + r * 64, tiles[t].colsb);
}

static float widen(uint16_t v)
{
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void dpbf16ps(int c, int a, int b)
{
    for (int m = 0; m < tiles[c].rows; m++) {
        float *sums = (float *)(tiles[c].data + m * 64);
        const uint16_t *row = (const uint16_t *)(tiles[a].data + m * 64);
        for (int k = 0; k < tiles[a].colsb / 4; k++) {
            const uint16_t *pairs = (const uint16_t *)(tiles[b].data + k * 64);
            for (int n = 0; n < tiles[c].colsb / 4; n++) {
                sums[n] += widen(row[2 * k]) * widen(pairs[2 * n]);
                sums[n] += widen(row[2 * k + 1]) * widen(pairs[2 * n + 1]);
            }
        }
    }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig load_config
#define _tile_release() ((void)0)
#define _tile_loadd load
#define _tile_stored store
#define _tile_zero zero
#define _tile_dpbf16ps dpbf16ps
#define syscall(...) 0 /* the tile data granted */
#include "../beamplugin/kernels/native/bf16_amx.c"
