/* The decoder's log-probabilities: each row of logits replaced, in place, by its log-softmax
 * x - max - log(sum of exp(x - max)), torch.log_softmax's formula and special cases (-inf gives
 * -inf; a row with NaN or +inf, or of -inf alone, gives NaN).
 *
 * One pass for the max, one for the sum of exps (the next row fetched meanwhile), one to write:
 * 16 floats at a time, the row's last width % 16 as a vector padded with -inf (an exp of
 * exactly 0), so a row of 1 or 3 columns takes the same path, and a row padded with -inf keeps
 * its bits. exp is isa.h's, on the set's vectors. The sum runs in 4 x 16 lanes,
 * folded in a fixed order (isa.h's lanes_sum): a row gets the same bits alone or batched, on any
 * thread, and on every set that fuses multiply-adds. log(sum) in double, rounded once: the same
 * float on every C library.
 */
#include <math.h>
#include <stdint.h>

#include "isa.h"

static inline v16 max16(v16 a, v16 b)
{
    for (int i = 0; i < PARTS; i++)
        a.part[i] = vf_max(a.part[i], b.part[i]);
    return a;
}

/* x: the row; next: the row after it (NULL: none), fetched into L2 during this row's exps, where
 * a large batch's logits (beyond L2) would stall the next row's max pass */
static void log_softmax_row(float *x, int64_t width, const float *next)
{
    int64_t full = width / 16 * 16, j;
    float tail[16];
    for (int i = 0; i < 16; i++)
        tail[i] = full + i < width ? x[full + i] : -INFINITY;

    /* four independent maxima: not one chain of 500 dependent ones (a NaN a max drops makes
     * its exp, so the sum, NaN) */
    v16 most0 = load16(tail), most1 = most0, most2 = most0, most3 = most0;
    for (j = 0; j + 64 <= full; j += 64) {
        most0 = max16(load16(x + j), most0);
        most1 = max16(load16(x + j + 16), most1);
        most2 = max16(load16(x + j + 32), most2);
        most3 = max16(load16(x + j + 48), most3);
    }
    for (; j < full; j += 16)
        most0 = max16(load16(x + j), most0);
    float lane[16], most = -INFINITY;
    store16(lane, max16(max16(most0, most1), max16(most2, most3)));
    for (int i = 0; i < 16; i++)
        most = lane[i] > most ? lane[i] : most;

    v16 sum0 = zero16(), sum1 = zero16(), sum2 = zero16(), sum3 = zero16();
    for (j = 0; j + 64 <= full; j += 64) {
        if (next)
            for (int line = 0; line < 64; line += 16)
                __builtin_prefetch(next + j + line, 0, 2);
        sum0 = add16(sum0, exp_minus16(load16(x + j), most));
        sum1 = add16(sum1, exp_minus16(load16(x + j + 16), most));
        sum2 = add16(sum2, exp_minus16(load16(x + j + 32), most));
        sum3 = add16(sum3, exp_minus16(load16(x + j + 48), most));
    }
    /* block b into sum b % 4 whatever the width: -inf columns after a row add exact zeros, so
     * a row padded with them (a shortlist's, beside a longer one) keeps its bits */
    v16 sums[4] = {sum0, sum1, sum2, sum3};
    int64_t block = j / 16;
    for (; j < full; j += 16, block++)
        sums[block % 4] = add16(sums[block % 4], exp_minus16(load16(x + j), most));
    sums[block % 4] = add16(sums[block % 4], exp_minus16(load16(tail), most));
    float sum = lanes_sum(add16(add16(sums[0], sums[1]), add16(sums[2], sums[3])));
    float log_sum = (float)log((double)sum);

    for (j = 0; j < full; j += 16)
        store16(x + j, minus16(minus16(load16(x + j), most), log_sum));
    for (; j < width; j++)
        x[j] = (x[j] - most) - log_sum;
}

/* rows: count rows of width floats, row i at rows + i x stride; each replaced by its
 * log-softmax */
void log_softmax(float *rows, int64_t count, int64_t width, int64_t stride, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < count; i++)
        log_softmax_row(rows + i * stride, width, i + 1 < count ? rows + (i + 1) * stride : 0);
}
