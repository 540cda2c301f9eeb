/* A ConvS2S decoder step in one call (beamplugin/models/convs2s.py's ConvS2SDecoder.forward with
 * an incremental state, after the embedding): fc1; per layer its residual input (projected where
 * its channels differ), the causal convolution's window (each row's previous kernel - 1 inputs,
 * in the order a beam reorder noted, then this step's) written as the next step's buffer, the
 * convolution's product and GLU; where the layer attends, the query (in_projection(x) + target)
 * sqrt(0.5), each sentence's attention over its memory (attention.c's sentence_attention) and
 * x = (out_projection(context) + x) sqrt(0.5), its weights averaged over the layers if asked;
 * then (x + residual) sqrt(0.5); last fc2 and fc3 (the logits; without logits, fc2's rows are
 * the result, for the caller's shortlist of fc3's columns).
 *
 * The products are product_calls.h's (float32 panels, int8, or float32 rows on bfloat16 weights),
 * called with the rows, residuals and order Python calls them with, so with the same bits; the
 * attention is sentence_attention's, as Python calls it. GLU's sigmoid is isa.h's exp and a
 * division, not torch's (within a few ulp of it). Python took some 20 us a product and 25 small
 * torch ops a step around them: most of a step at a beam's 5 rows. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* torch's (x + residual) * sqrt(0.5): two roundings */
#pragma GCC optimize("fp-contract=off")

#include "isa.h"
#include "product_calls.h"

typedef void (*sentence_attention_fn)(const float *q, int64_t q_stride, const float *keys,
                                      int64_t k_sentence, int64_t k_dim, const float *values,
                                      int64_t v_sentence, int64_t v_src, const float *bias,
                                      int64_t bias_sentence, const float *scale,
                                      int64_t scale_stride, float *out, int64_t out_stride,
                                      float *probs, int64_t sentences, int64_t each,
                                      int64_t embed, int64_t src, int threads);

struct conv_layer {
    /* the residual's projection (panels NULL: none), the convolution [2 channels, kernel x
     * in_channels] (frame by frame), the attention's in and out projections (panels NULL: the
     * layer does not attend) */
    struct product residual, conv, in_projection, out_projection;
    int64_t in_channels, channels, kernel, distance; /* distance 0: no residual */
    /* the previous inputs [rows before, kernel - 1, in_channels] (row stride buffer_stride,
     * frames consecutive), NULL: zeros (a first step); order: each row's row in them (NULL: its
     * own) */
    const float *buffer;
    int64_t buffer_stride;
    const int64_t *order;
    int64_t order_rows; /* the buffer's rows (order's entries checked against them) */
    float *window; /* [rows, kernel, in_channels], written (kernel > 1): the next buffer's */
};

struct memory_group { /* rows of sentences reading one memory (sentence_attention's layout) */
    const float *keys, *values, *bias, *scale; /* bias NULL: no padding */
    int64_t k_sentence, k_dim, v_sentence, v_src, bias_sentence, scale_stride;
    int64_t sentences, rows, src;
};

struct convs2s_step {
    struct product_kernels kernels;
    sentence_attention_fn attention;
    struct product fc1, fc2, fc3;
    int64_t layers, rows, embed, attention_layers, widest_channels, out_embed, groups;
    const struct memory_group *group;
    const float *x, *target; /* [rows, embed]: the embedded tokens (fc1's input and target) */
    float *logits;           /* [rows, vocab], written; NULL: fc3 left to the caller */
    float *attn;             /* [rows, attn_width] averaged over layers, written, or NULL */
    int64_t attn_width;
    /* scratch: outputs (layers + 1) x rows x widest_channels; wide 2 x rows x
     * widest_channels; residual, glued: rows x widest_channels; query, context: rows x embed;
     * probs: rows x attn_width; hidden: rows x out_embed */
    float *outputs, *wide, *residual, *glued, *query, *context, *probs, *hidden;
    int threads;
    int failed; /* written: 2 if an int8 or bf16 product could not allocate its rounded rows, 4
                   for a beam order outside the buffer */
};

#define SQRT_HALF 0.70710678118654752440f

static int product(const struct convs2s_step *s, const struct product *p, const float *x,
                   const float *residual, float *y)
{
    return call_product(&s->kernels, s->rows, s->threads, p, x, p->in, residual, y, 0);
}

/* a sigmoid(b), each lane: with e = exp(-|b|), 1 / (1 + e) where b >= 0, else e / (1 + e) */
static inline vf vf_glu(vf a, vf b)
{
    vf one = vf_set1(1.0f);
    vf e = vf_exp_nonpositive(vf_min(b, vf_sub(vf_zero(), b)));
    return vf_mul(a, vf_div(vf_if_nonnegative(b, one, e), vf_add(one, e)));
}

/* out [rows, channels] = GLU of wide [rows, 2 channels]: first half times the sigmoid of the
 * second; a vector at a time (no registers spilled), the tail as a vector padded with zeros */
static void glu(const float *wide, float *out, int64_t rows, int64_t channels)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *a = wide + r * 2 * channels, *b = a + channels;
        float *o = out + r * channels;
        int64_t c = 0;
        for (; c + LANES <= channels; c += LANES)
            vf_store(o + c, vf_glu(vf_load(a + c), vf_load(b + c)));
        if (c < channels) {
            float ta[LANES] = {0}, tb[LANES] = {0}, to[LANES];
            memcpy(ta, a + c, (size_t)(channels - c) * sizeof *ta);
            memcpy(tb, b + c, (size_t)(channels - c) * sizeof *tb);
            vf_store(to, vf_glu(vf_load(ta), vf_load(tb)));
            memcpy(o + c, to, (size_t)(channels - c) * sizeof *to);
        }
    }
}

/* each row's window: its previous inputs (its order's row of the buffer, zeros without one)
 * then x; -1 for an order outside the buffer */
static int gather_window(const struct convs2s_step *s, const struct conv_layer *L,
                         const float *x)
{
    int64_t C = L->in_channels, before = (L->kernel - 1) * C;
    for (int64_t r = 0; r < s->rows; r++) {
        float *w = L->window + r * L->kernel * C;
        int64_t from = L->order ? L->order[r] : r;
        if (!L->buffer)
            memset(w, 0, (size_t)before * sizeof *w);
        else if (from < 0 || from >= L->order_rows)
            return -1;
        else
            memcpy(w, L->buffer + from * L->buffer_stride, (size_t)before * sizeof *w);
        memcpy(w + before, x + r * C, (size_t)C * sizeof *w);
    }
    return 0;
}

/* the layer's attention on x [rows, channels] (and s->target), into out: 0, or -1 if a product
 * could not allocate */
static int attend(struct convs2s_step *s, const struct conv_layer *L, const float *x, float *out)
{
    int64_t E = s->embed, n = s->rows * E, first = 0, W = s->attn_width;
    if (product(s, &L->in_projection, x, s->target, s->query))
        return -1;
    for (int64_t i = 0; i < n; i++)
        s->query[i] *= SQRT_HALF;
    for (int64_t g = 0; g < s->groups; g++) {
        const struct memory_group *G = s->group + g;
        int64_t each = G->rows / G->sentences;
        float *probs = s->attn ? s->probs : 0;
        s->attention(s->query + first * E, E, G->keys, G->k_sentence, G->k_dim, G->values,
                     G->v_sentence, G->v_src, G->bias, G->bias_sentence, G->scale,
                     G->scale_stride, s->context + first * E, E, probs, G->sentences, each, E,
                     G->src, threads_for_work(s->threads, G->rows * G->src * E * 2));
        if (probs) { /* each layer's weights / layers, summed in layer order (zeros: padding) */
            float layers = (float)s->attention_layers; /* all, attending or not */
            for (int64_t r = 0; r < G->rows; r++) {
                float *a = s->attn + (first + r) * W;
                const float *p = probs + r * G->src;
                int64_t pad = W - G->src;
                for (int64_t j = 0; j < W; j++) {
                    float v = j < pad ? 0.0f : p[j - pad];
                    a[j] = a[j] + v / layers;
                }
            }
        }
        first += G->rows;
    }
    if (product(s, &L->out_projection, s->context, x, out))
        return -1;
    for (int64_t i = 0; i < s->rows * L->channels; i++)
        out[i] *= SQRT_HALF;
    return 0;
}

static const float *failing(struct convs2s_step *s, int why)
{
    s->failed = why;
    return 0;
}

/* The step: s->logits, or NULL (why in s->failed). */
const float *convs2s_step(struct convs2s_step *s, const struct conv_layer *layers)
{
    int64_t R = s->rows, block = R * s->widest_channels;
    if (s->attn) /* the sum starts from zeros: the first layer's 0 + w / n is w / n's bits */
        memset(s->attn, 0, (size_t)(R * s->attn_width) * sizeof *s->attn);
    if (product(s, &s->fc1, s->x, 0, s->outputs))
        return failing(s, 2);
    for (int64_t l = 0; l < s->layers; l++) {
        const struct conv_layer *L = layers + l;
        const float *x = s->outputs + l * block;
        float *out = s->outputs + (l + 1) * block;
        const float *residual = 0;
        if (L->distance) {
            residual = s->outputs + (l + 1 - L->distance) * block;
            if (L->residual.panels) {
                if (product(s, &L->residual, residual, 0, s->residual))
                    return failing(s, 2);
                residual = s->residual;
            }
        }
        const float *in = x;
        if (L->kernel > 1) {
            if (gather_window(s, L, x))
                return failing(s, 4);
            in = L->window;
        }
        if (product(s, &L->conv, in, 0, s->wide))
            return failing(s, 2);
        if (L->in_projection.panels) {
            glu(s->wide, s->glued, R, L->channels);
            if (attend(s, L, s->glued, out))
                return failing(s, 2);
        } else
            glu(s->wide, out, R, L->channels);
        if (residual)
            for (int64_t i = 0; i < R * L->channels; i++)
                out[i] = (out[i] + residual[i]) * SQRT_HALF;
    }
    if (product(s, &s->fc2, s->outputs + s->layers * block, 0, s->hidden))
        return failing(s, 2);
    if (!s->logits) /* the caller multiplies fc3's columns it wants (a shortlist) */
        return s->hidden;
    if (product(s, &s->fc3, s->hidden, 0, s->logits))
        return failing(s, 2);
    return s->logits;
}
