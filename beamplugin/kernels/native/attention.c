/* A transformer decoder step's attention, one query per row and head: fairseq's
 * softmax(bias + q . K) V (the query scaled already), for the self-attention over a row's
 * history (this step's key and value written into its last column first) and for the
 * cross-attention over a sentence's encoder keys and values; and ConvS2S's attention of each
 * sentence's rows over its memory, all of them at once (sentence_attention, at the end).
 *
 * Every (row, head) is computed alone, in the same order whatever the rows beside it, the width
 * of the buffers, the columns masked (-inf in the bias: skipped, as they weigh exactly 0) or the
 * thread: a row gets the same bits alone or batched. exp is isa.h's, as the log-softmax's.
 * Vectors are the instruction set's (isa.h), their sums in its fixed order: the same bits on
 * every set that fuses multiply-adds.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

/* scores (-inf where masked) to probabilities, in place: a vector at a time, the last ones as
 * a vector padded with -inf (an exp of exactly 0) */
static void softmax(float *s, int64_t width)
{
    float most = -INFINITY;
    for (int64_t j = 0; j < width; j++)
        most = s[j] > most ? s[j] : most;
    vf m = vf_set1(most);
    int64_t j = 0;
    for (; j + LANES <= width; j += LANES) /* a vector at a time: no registers spilled */
        vf_store(s + j, vf_exp_nonpositive(vf_sub(vf_load(s + j), m)));
    if (j < width) {
        float tail[LANES];
        for (int i = 0; i < LANES; i++)
            tail[i] = j + i < width ? s[j + i] : -INFINITY;
        vf_store(tail, vf_exp_nonpositive(vf_sub(vf_load(tail), m)));
        memcpy(s + j, tail, (size_t)(width - j) * sizeof *s);
    }
    float sum = 0.0f;
    for (j = 0; j < width; j++)
        sum += s[j];
    float inverse = 1.0f / sum;
    for (j = 0; j < width; j++)
        s[j] *= inverse;
}

/* a . b: 16 lanes of partial sums folded in halves, a fixed order */
static inline float dot(const float *a, const float *b, int64_t n)
{
    v16 acc = zero16();
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        acc = fma16(load16(a + d), load16(b + d), acc);
    float s = lanes_sum(acc);
    for (; d < n; d++)
        s = fma1(a[d], b[d], s);
    return s;
}

/* out (head_dim) = sum over j of p[j] times column j (head_dim floats at
 * values + rows[j] x row_stride + j x head_dim), j where p[j] > 0, in order of
 * j: 64 dimensions at a time, four independent chains */
static inline void weigh_sources(const float *p, const float *values, const int64_t *rows,
                                 int64_t row_stride, int64_t width, int64_t head_dim,
                                 float *out)
{
#define COLUMN(j) (values + rows[j] * row_stride + (j) * head_dim)
    int64_t d = 0;
    for (; d + 64 <= head_dim; d += 64) {
        v16 a0 = zero16(), a1 = zero16(), a2 = zero16(), a3 = zero16();
        for (int64_t j = 0; j < width; j++) {
            if (p[j] > 0.0f) {
                const float *v = COLUMN(j) + d;
                a0 = scaled_fma16(p[j], load16(v), a0);
                a1 = scaled_fma16(p[j], load16(v + 16), a1);
                a2 = scaled_fma16(p[j], load16(v + 32), a2);
                a3 = scaled_fma16(p[j], load16(v + 48), a3);
            }
        }
        store16(out + d, a0);
        store16(out + d + 16, a1);
        store16(out + d + 32, a2);
        store16(out + d + 48, a3);
    }
    for (; d + 16 <= head_dim; d += 16) {
        v16 acc = zero16();
        for (int64_t j = 0; j < width; j++)
            if (p[j] > 0.0f)
                acc = scaled_fma16(p[j], load16(COLUMN(j) + d), acc);
        store16(out + d, acc);
    }
    for (; d < head_dim; d++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < width; j++)
            if (p[j] > 0.0f)
                acc = fma1(p[j], COLUMN(j)[d], acc);
        out[d] = acc;
    }
#undef COLUMN
}

/* every cache line of n floats at p asked for (a hint: no fault, no wait), into the level-2
 * cache, not the first: asked into the first, the requests wait on its few misses in flight */
static inline void ask_for(const float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16)
        __builtin_prefetch(p + i, 0, 2);
}

/* qkv: rows x 3 embed (row stride qkv_stride): queries, keys, values, each head after head.
 * keys, values: this layer's history, [slots, heads, width, head_dim] (strides row_stride,
 * head_stride, head_dim, 1). sources: rows x width, the slot that holds each row's column (a
 * beam reorder rewrites this table, not the history); row r's column width - 1 is slot r's,
 * which receives this step's key and value. bias: rows x width, 0 or -inf. probs: rows x heads
 * x width (written), or NULL. out: rows x embed. Returns -1, computing nothing, if a source is
 * not a slot or there are fewer slots than rows. */
int self_attention(const float *qkv, int64_t qkv_stride, float *keys, float *values,
                   int64_t row_stride, int64_t head_stride, const int64_t *sources,
                   int64_t slots, const float *bias, float *probs, float *out, int64_t rows,
                   int64_t heads, int64_t head_dim, int64_t width, int threads)
{
    if (rows > slots)
        return -1;
    for (int64_t i = 0; i < rows * width; i++)
        if (sources[i] < 0 || sources[i] >= slots)
            return -1;
    int64_t embed = heads * head_dim;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row_bias = bias + r * width;
        const int64_t *row_sources = sources + r * width;
        /* the next row's keys and values asked for while this one's are read: at a batch's
         * hundreds of rows the histories are read from memory, which the hardware's prefetch
         * alone left waiting. Not the columns this row reads from the same slot: a sentence's
         * beams share most of their history, and asking again for lines in cache takes room
         * in the queue of misses. */
        if (r + 1 < rows) {
            const int64_t *next_sources = sources + (r + 1) * width;
            const float *next_bias = bias + (r + 1) * width;
            for (int64_t j = 0; j < width; j++)
                if (next_bias[j] != -INFINITY &&
                    (row_bias[j] == -INFINITY || row_sources[j] != next_sources[j]))
                    for (int64_t h = 0; h < heads; h++) {
                        int64_t at = next_sources[j] * row_stride + h * head_stride + j * head_dim;
                        ask_for(keys + at, head_dim);
                        ask_for(values + at, head_dim);
                    }
        }
        for (int64_t h = 0; h < heads; h++) {
            const float *q = qkv + r * qkv_stride + h * head_dim;
            float *k = keys + r * row_stride + h * head_stride;
            float *v = values + r * row_stride + h * head_stride;
            memcpy(k + (width - 1) * head_dim, q + embed, head_dim * sizeof(float));
            memcpy(v + (width - 1) * head_dim, q + 2 * embed, head_dim * sizeof(float));
            float scratch[probs ? 1 : width];
            float *s = probs ? probs + (r * heads + h) * width : scratch;
            for (int64_t j = 0; j < width; j++) {
                const float *column = keys + row_sources[j] * row_stride + h * head_stride;
                s[j] = row_bias[j] == -INFINITY
                           ? -INFINITY
                           : row_bias[j] + dot(q, column + j * head_dim, head_dim);
            }
            softmax(s, width);
            weigh_sources(s, values + h * head_stride, row_sources, row_stride, width, head_dim,
                          out + r * embed + h * head_dim);
        }
    }
    return 0;
}

/* ---- attention of a sentence's rows over its one memory (ConvS2S's: one head) ---------------
 *
 * All rows of a sentence (its beams) in tiles of up to SENTENCE_TILE rows, each tile reading
 * the sentence's keys and values once: a register tile of rows x two vectors, as the products'.
 * Each score is bias + a chain of fused multiply-adds over the embedding in order, each context
 * element a chain over the source positions in order (masked ones skipped: they weigh exactly
 * 0), then times the sentence's scale: a row's bits do not depend on the rows, the tile, the
 * vector width or the padding before its source. */
#define SENTENCE_TILE 6 /* 12 accumulators: AVX2's 16 registers hold them with the operands */

/* s[i][j0 ..] (row stride src) = q_i . keys[:, j0 ..] for `vectors` vectors of positions */
static inline __attribute__((always_inline)) void score_tile(
    int rows, int vectors, const float *q, int64_t q_stride, const float *keys, int64_t k_dim,
    int64_t embed, int64_t j0, float *s, int64_t src)
{
    vf acc[SENTENCE_TILE][2];
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < vectors; v++)
            acc[i][v] = vf_zero();
    for (int64_t d = 0; d < embed; d++) {
        const float *k = keys + d * k_dim + j0;
        vf b[2];
        for (int v = 0; v < vectors; v++)
            b[v] = vf_load(k + v * LANES);
        for (int i = 0; i < rows; i++) {
            vf a = vf_set1(q[i * q_stride + d]);
            for (int v = 0; v < vectors; v++)
                acc[i][v] = vf_fma(a, b[v], acc[i][v]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < vectors; v++)
            vf_store(s + i * src + j0 + v * LANES, acc[i][v]);
}

/* out[i][d0 ..] = scale x sum over unmasked j of p[i][j] values[j][d0 ..], `vectors` vectors */
static inline __attribute__((always_inline)) void context_tile(
    int rows, int vectors, const float *p, int64_t src, const float *values, int64_t v_src,
    const float *bias, int64_t d0, float scale, float *out, int64_t out_stride)
{
    vf acc[SENTENCE_TILE][2];
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < vectors; v++)
            acc[i][v] = vf_zero();
    for (int64_t j = 0; j < src; j++) {
        if (bias && bias[j] == -INFINITY)
            continue;
        const float *value = values + j * v_src + d0;
        vf b[2];
        for (int v = 0; v < vectors; v++)
            b[v] = vf_load(value + v * LANES);
        for (int i = 0; i < rows; i++) {
            vf a = vf_set1(p[i * src + j]);
            for (int v = 0; v < vectors; v++)
                acc[i][v] = vf_fma(a, b[v], acc[i][v]);
        }
    }
    vf times = vf_set1(scale);
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < vectors; v++)
            vf_store(out + i * out_stride + d0 + v * LANES, vf_mul(acc[i][v], times));
}

/* one tile of `rows` rows (a constant where it is inlined: its accumulators stay in registers) */
static inline __attribute__((always_inline)) void sentence_tile(
    int rows, const float *q, int64_t q_stride, const float *keys, int64_t k_dim,
    const float *values, int64_t v_src, const float *bias, float scale, float *s, float *out,
    int64_t out_stride, int64_t embed, int64_t src)
{
    int64_t j = 0;
    for (; j + 2 * LANES <= src; j += 2 * LANES)
        score_tile(rows, 2, q, q_stride, keys, k_dim, embed, j, s, src);
    for (; j + LANES <= src; j += LANES)
        score_tile(rows, 1, q, q_stride, keys, k_dim, embed, j, s, src);
    if (j < src) {
        /* the last positions, fewer than a vector, as a vector too, on a zero-padded copy of
         * their keys: scalar chains of fused multiply-adds, one a row and position, took most
         * of the attention's time at a source of 21 (the same chains, so the same bits) */
        int64_t left = src - j;
        float padded[embed * LANES], sums[SENTENCE_TILE * LANES];
        for (int64_t d = 0; d < embed; d++) {
            memcpy(padded + d * LANES, keys + d * k_dim + j, left * sizeof(float));
            memset(padded + d * LANES + left, 0, (LANES - left) * sizeof(float));
        }
        score_tile(rows, 1, q, q_stride, padded, LANES, embed, 0, sums, LANES);
        for (int i = 0; i < rows; i++)
            memcpy(s + i * src + j, sums + i * LANES, left * sizeof(float));
    }
    for (int i = 0; i < rows; i++) {
        float *row = s + i * src;
        for (j = 0; bias && j < src; j++)
            row[j] = bias[j] == -INFINITY ? -INFINITY : bias[j] + row[j];
        softmax(row, src);
    }
    int64_t d = 0;
    for (; d + 2 * LANES <= embed; d += 2 * LANES)
        context_tile(rows, 2, s, src, values, v_src, bias, d, scale, out, out_stride);
    for (; d + LANES <= embed; d += LANES)
        context_tile(rows, 1, s, src, values, v_src, bias, d, scale, out, out_stride);
    for (; d < embed; d++)
        for (int i = 0; i < rows; i++) {
            float acc = 0.0f;
            for (j = 0; j < src; j++)
                if (!bias || bias[j] != -INFINITY)
                    acc = fma1(s[i * src + j], values[j * v_src + d], acc);
            out[i * out_stride + d] = acc * scale;
        }
}

/* q: rows x embed (row stride q_stride), rows sentence by sentence, `each` a sentence.
 * keys: [sentences, heads, head_dim, src] (strides k_sentence, k_head, k_dim, 1); values:
 * [sentences, heads, src, head_dim] (strides v_sentence, v_head, head_dim, 1); bias:
 * [sentences, src] (strides bias_sentence, 1), 0 or -inf. mean: rows x src (row stride
 * mean_stride), the weights averaged over heads (summed head after head, then divided: torch's
 * mean at up to 4 heads), written, or NULL. out: rows x embed.
 *
 * Each head of a sentence as ConvS2S's attention (sentence_tile): its rows (beams) in tiles
 * that read the head's keys and values once, sums in registers, the same chains (so the same
 * bits) as one row alone. */
/* every cache line of a head's memory asked for (keys: head_dim rows of src floats, k_dim
 * apart; values: src x head_dim floats) */
static inline void ask_for_head(const float *k, int64_t k_dim, const float *v, int64_t head_dim,
                                int64_t src)
{
    for (int64_t d = 0; d < head_dim; d++)
        ask_for(k + d * k_dim, src);
    ask_for(v, src * head_dim);
}

void cross_attention(const float *q, int64_t q_stride, const float *keys, int64_t k_sentence,
                     int64_t k_head, int64_t k_dim, const float *values, int64_t v_sentence,
                     int64_t v_head, const float *bias, int64_t bias_sentence, float *mean,
                     int64_t mean_stride, float *out, int64_t rows, int64_t each, int64_t heads,
                     int64_t head_dim, int64_t src, int threads)
{
    int64_t embed = heads * head_dim, sentences = rows / each;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t sentence = 0; sentence < sentences; sentence++) {
        const float *sentence_bias = bias + sentence * bias_sentence;
        float s[SENTENCE_TILE * src];
        for (int64_t h = 0; h < heads; h++) {
            const float *k = keys + sentence * k_sentence + h * k_head;
            const float *v = values + sentence * v_sentence + h * v_head;
            /* the same head of the sentence two ahead asked for while this one is read: a
             * step's memory is read from DRAM after its logits have passed through the caches,
             * and the next head's came too late (a quarter of the time at 64 sentences) */
            int64_t ahead = sentence + 2;
            if (ahead < sentences)
                ask_for_head(keys + ahead * k_sentence + h * k_head, k_dim,
                             values + ahead * v_sentence + h * v_head, head_dim, src);
            for (int64_t first = 0; first < each; first += SENTENCE_TILE) {
                int64_t r = sentence * each + first;
                int tile = each - first < SENTENCE_TILE ? (int)(each - first) : SENTENCE_TILE;
                const float *qr = q + r * q_stride + h * head_dim;
                float *o = out + r * embed + h * head_dim;
                switch (tile) {
#define HEAD_ROWS(R)                                                                            \
    case R:                                                                                     \
        sentence_tile(R, qr, q_stride, k, k_dim, v, head_dim, sentence_bias, 1.0f, s, o, embed, \
                      head_dim, src);                                                           \
        break;
                    HEAD_ROWS(1)
                    HEAD_ROWS(2)
                    HEAD_ROWS(3)
                    HEAD_ROWS(4)
                    HEAD_ROWS(5)
                    HEAD_ROWS(6)
#undef HEAD_ROWS
                }
                for (int i = 0; mean && i < tile; i++) {
                    float *m = mean + (r + i) * mean_stride;
                    for (int64_t j = 0; j < src; j++)
                        m[j] = h ? m[j] + s[i * src + j] : s[i * src + j];
                }
            }
        }
        for (int64_t i = 0; mean && i < each; i++)
            for (int64_t j = 0; j < src; j++)
                mean[(sentence * each + i) * mean_stride + j] /= (float)heads;
    }
}

/* q: sentences x each rows of embed (row stride q_stride), sentence-major. keys: [sentences,
 * embed, src] (strides k_sentence, k_dim, 1); values: [sentences, src, embed] (strides
 * v_sentence, v_src, 1); bias: [sentences, src] (strides bias_sentence, 1), 0 or -inf, or NULL;
 * scale: one float a sentence (stride scale_stride). out: the rows' contexts (row stride
 * out_stride). probs: the rows' weights (rows x src, contiguous), written, or NULL. */
void sentence_attention(const float *q, int64_t q_stride, const float *keys, int64_t k_sentence,
                        int64_t k_dim, const float *values, int64_t v_sentence, int64_t v_src,
                        const float *bias, int64_t bias_sentence, const float *scale,
                        int64_t scale_stride, float *out, int64_t out_stride, float *probs,
                        int64_t sentences, int64_t each, int64_t embed, int64_t src, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < sentences; n++) {
        float scratch[probs ? 1 : SENTENCE_TILE * src];
        const float *k = keys + n * k_sentence, *v = values + n * v_sentence;
        const float *b = bias ? bias + n * bias_sentence : 0;
        float times = scale[n * scale_stride];
        for (int64_t first = 0; first < each; first += SENTENCE_TILE) {
            int64_t r = n * each + first;
            int rows = each - first < SENTENCE_TILE ? (int)(each - first) : SENTENCE_TILE;
            float *s = probs ? probs + r * src : scratch;
            const float *qr = q + r * q_stride;
            float *o = out + r * out_stride;
            switch (rows) {
#define SENTENCE_ROWS(R)                                                                        \
    case R:                                                                                     \
        sentence_tile(R, qr, q_stride, k, k_dim, v, v_src, b, times, s, o, out_stride, embed,  \
                      src);                                                                     \
        break;
                SENTENCE_ROWS(1)
                SENTENCE_ROWS(2)
                SENTENCE_ROWS(3)
                SENTENCE_ROWS(4)
                SENTENCE_ROWS(5)
                SENTENCE_ROWS(6)
#undef SENTENCE_ROWS
            }
        }
    }
}
