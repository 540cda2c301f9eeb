/* A transformer decoder step in one call: each row's last token embedded at its position, the
 * mask of its history, then for each layer the self-attention over the rows' histories, the cross-attention over their sentences' encoder memory, the feed-forward,
 * each sublayer's residual and layer norm (before its products in a pre-norm layer, inside its
 * last product in a post-norm one), calling the float32 product, norm and attention kernels of
 * products.c (or int8_products.c, or bf16_products.c's float32 rows on bfloat16 weights) and
 * attention.c through the pointers it is given. Python made the same calls one
 * by one, 5-6 us each at a step's few rows, some 150 us a step for 3 layers (docs/speed.md):
 * the same kernels in the same order, so the same bits; last the final norm and the output
 * projection. */
#include <math.h>
#include <stdint.h>

/* the embedding is torch's scale x row, then + position, one rounding each */
#pragma GCC optimize("fp-contract=off")

#include "product_calls.h"

typedef int (*self_attention_fn)(const float *qkv, int64_t qkv_stride, float *keys,
                                 float *values, int64_t row_stride, int64_t head_stride,
                                 const int64_t *sources, int64_t slots, const float *bias,
                                 float *probs, float *out, int64_t rows, int64_t heads,
                                 int64_t head_dim, int64_t width, int threads);
typedef void (*cross_attention_fn)(const float *q, int64_t q_stride, const float *keys,
                                   int64_t k_sentence, int64_t k_head, int64_t k_dim,
                                   const float *values, int64_t v_sentence, int64_t v_head,
                                   const float *bias, int64_t bias_sentence, float *mean,
                                   int64_t mean_stride, float *out, int64_t rows, int64_t each,
                                   int64_t heads, int64_t head_dim, int64_t src, int threads);

struct norm { /* a pre-norm layer's norm of a sublayer's input (gamma NULL: post-norm) */
    const float *gamma, *beta;
    float eps;
};

struct layer {
    struct product qkv, self_out, cross_query, cross_out, fc1, fc2;
    struct norm self_norm, cross_norm, final_norm;
    float *keys, *values; /* this step's history window: [slots, heads, width, head_dim] */
};

struct group { /* rows of sentences whose memory is one pool's (attention.c's layout) */
    const float **keys, **values; /* per layer */
    int64_t k_sentence, k_head, k_dim, v_sentence, v_head, bias_sentence;
    const float *bias;
    int64_t rows, each, src;
};

struct step {
    /* this step's tokens [rows, steps] (row stride token_stride), pad before each row's own;
     * the embedding [vocab, embed], its scale, and the positions [positions, embed] */
    const int64_t *tokens;
    int64_t token_stride, steps, pad, vocab, positions;
    const float *embedding, *position_table;
    float embed_scale;
    struct norm final_norm;
    struct product output; /* the logits' projection, into logits [rows, out] */
    float *logits;
    struct product_kernels kernels; /* products, int8_products, bf16_products, smallest, norm */
    self_attention_fn self_attention;
    cross_attention_fn cross_attention;
    int64_t layers, rows, embed, heads, head_dim, hidden, width, slots, row_stride,
        head_stride, groups, alignment_layer;
    const int64_t *sources;
    float *bias; /* [rows, width], written: 0 at each row's own steps, -inf before */
    struct group *group;
    /* written: the alignment layer's weights averaged over heads, [rows, alignment_width], each
     * group's left-padded with zeros to the widest group's src */
    float *alignment;
    int64_t alignment_width;
    float *x, *a, *b, *normed, *qkv, *context, *query, *inner; /* scratch, rows wide */
    int threads;
    int failed; /* written: 1 if the self-attention refused its sources, 2 if an int8 or bf16
                   product could not allocate its rounded rows, 3 for a token or position
                   outside its table */
};

static int threads_for(const struct step *s, int64_t work)
{
    return threads_for_work(s->threads, work);
}

/* 0, or -1 if an int8 or bf16 product could not allocate its rounded rows */
static int product(const struct step *s, const struct product *p, const float *x, int64_t ldx,
                   const float *residual, float *y, int relu)
{
    return call_product(&s->kernels, s->rows, s->threads, p, x, ldx, residual, y, relu);
}

/* a sublayer's input: x, or x normed into s->normed */
static const float *input(const struct step *s, const struct norm *n, const float *x)
{
    if (!n->gamma)
        return x;
    s->kernels.norm(x, s->embed, s->normed, s->embed, s->rows, s->embed, n->gamma, n->beta,
                    n->eps, threads_for(s, s->rows * s->embed * 64));
    return s->normed;
}

/* the feed-forward sublayer on x, its residual added (and a post-norm), into out: 0, or -1 if
 * an int8 product could not allocate its quantized rows */
static int feed_forward(const struct step *s, const struct layer *L, const float *x, float *out)
{
    if (product(s, &L->fc1, input(s, &L->final_norm, x), s->embed, 0, s->inner, 1))
        return -1;
    return product(s, &L->fc2, s->inner, s->hidden, x, out, 0);
}

static const float *out_of_memory(struct step *s)
{
    s->failed = 2;
    return 0;
}

/* s->x: each row's last token embedded at its position (pad + its own tokens, as fairseq
 * counts); s->bias: -inf before each row's own steps and at its padding. 0, or -1 for a token
 * or position outside its table. */
static int embed(struct step *s)
{
    int64_t E = s->embed, own = s->width - s->steps;
    for (int64_t r = 0; r < s->rows; r++) {
        const int64_t *row = s->tokens + r * s->token_stride;
        float *bias = s->bias + r * s->width;
        int64_t count = 0;
        for (int64_t j = 0; j < s->width; j++)
            bias[j] = -INFINITY;
        for (int64_t j = 0; j < s->steps; j++)
            if (row[j] != s->pad) {
                count++;
                bias[own + j] = 0.0f;
            }
        int64_t token = row[s->steps - 1], position = s->pad + count;
        if (token < 0 || token >= s->vocab || position < 0 || position >= s->positions)
            return -1;
        const float *e = s->embedding + token * E, *p = s->position_table + position * E;
        float *x = s->x + r * E;
        for (int64_t d = 0; d < E; d++)
            x[d] = s->embed_scale * e[d] + p[d];
    }
    return 0;
}

/* An encoder's sentences: `sentences` of `width` positions each (the step's rows, sentence by
 * sentence), the padding bias [sentences, width] (row stride bias_sentence; 0 or -inf), and
 * scratch for a layer's keys [sentences, heads, head_dim, width] and values [sentences, heads,
 * width, head_dim] (attention.c's layout). */
struct sources {
    int64_t sentences, width, bias_sentence;
    const float *bias;
    float *keys, *values;
};

/* The self-attention of s->qkv's rows into s->context: over each row's history (a decoder's,
 * src NULL), or over its sentence's positions (an encoder's: the cross-attention kernel, keys
 * and values laid out from the projections). 0, or -1 if the history's sources were refused. */
static int self_attention(struct step *s, const struct layer *L, const struct sources *src)
{
    int64_t E = s->embed, H = s->heads, D = s->head_dim;
    if (!src)
        return s->self_attention(s->qkv, 3 * E, L->keys, L->values, s->row_stride,
                                 s->head_stride, s->sources, s->slots, s->bias, 0, s->context,
                                 s->rows, H, D, s->width,
                                 threads_for(s, s->rows * H * s->width * D));
    int64_t W = src->width;
    for (int64_t n = 0; n < src->sentences; n++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t w = 0; w < W; w++) {
                const float *row = s->qkv + (n * W + w) * 3 * E + h * D;
                float *keys = src->keys + ((n * H + h) * D) * W + w;
                float *values = src->values + ((n * H + h) * W + w) * D;
                for (int64_t d = 0; d < D; d++) {
                    keys[d * W] = row[E + d];
                    values[d] = row[2 * E + d];
                }
            }
    s->cross_attention(s->qkv, 3 * E, src->keys, H * D * W, D * W, W, src->values, H * W * D,
                       W * D, src->bias, src->bias_sentence, 0, 0, s->context, s->rows, W, H, D, W,
                       threads_for(s, s->rows * H * W * D));
    return 0;
}

/* The cross-attention of s->query's rows over their groups' memory (layer l's), into
 * s->context; the alignment layer's weights averaged over heads into s->alignment. */
static void cross_attention(const struct step *s, int64_t l)
{
    int64_t E = s->embed, H = s->heads, D = s->head_dim, W = s->alignment_width, first = 0;
    for (int64_t g = 0; g < s->groups; g++) {
        const struct group *G = s->group + g;
        float *mean = 0;
        if (l == s->alignment_layer && s->alignment) {
            mean = s->alignment + first * W + W - G->src;
            for (int64_t r = 0; r < G->rows; r++)
                for (int64_t j = 0; j < W - G->src; j++)
                    s->alignment[(first + r) * W + j] = 0.0f;
        }
        s->cross_attention(s->query + first * E, E, G->keys[l], G->k_sentence, G->k_head,
                           G->k_dim, G->values[l], G->v_sentence, G->v_head, G->bias,
                           G->bias_sentence, mean, W, s->context + first * E, G->rows, G->each,
                           H, D, G->src, threads_for(s, G->rows * H * G->src * D));
        first += G->rows;
    }
}

/* The layers on s->x ([rows, embed]): the self-attention (see self_attention), the
 * cross-attention where a layer has one (a decoder's), the feed-forward, each sublayer's
 * residual added in its last product and its norm before (pre-norm) or after (post-norm).
 * Returns the output (s->a or s->b), or NULL (why in s->failed). */
static const float *run_layers(struct step *s, const struct layer *layers,
                               const struct sources *src)
{
    int64_t E = s->embed;
    float *x = s->x, *spare[2] = {s->a, s->b};
    int turn = 0;
    for (int64_t l = 0; l < s->layers; l++) {
        const struct layer *L = layers + l;
        float *out = spare[turn];
        turn ^= 1;
        if (product(s, &L->qkv, input(s, &L->self_norm, x), E, 0, s->qkv, 0))
            return out_of_memory(s);
        if (self_attention(s, L, src)) {
            s->failed = 1;
            return 0;
        }
        if (product(s, &L->self_out, s->context, E, x, out, 0))
            return out_of_memory(s);
        x = out;
        if (L->cross_query.panels) {
            out = spare[turn];
            turn ^= 1;
            if (product(s, &L->cross_query, input(s, &L->cross_norm, x), E, 0, s->query, 0))
                return out_of_memory(s);
            cross_attention(s, l);
            if (product(s, &L->cross_out, s->context, E, x, out, 0))
                return out_of_memory(s);
            x = out;
        }
        out = spare[turn];
        turn ^= 1;
        if (feed_forward(s, L, x, out))
            return out_of_memory(s);
        x = out;
    }
    return x;
}

/* A decoder's step (s->width >= s->steps, the history's columns): the embedding and mask, the
 * layers, the final norm and the output projection. Returns s->logits, or NULL (why in
 * s->failed). */
const float *decoder_step(struct step *s, const struct layer *layers)
{
    if (embed(s)) {
        s->failed = 3;
        return 0;
    }
    const float *x = run_layers(s, layers, 0);
    if (!x)
        return 0;
    if (product(s, &s->output, input(s, &s->final_norm, x), s->embed, 0, s->logits, 0))
        return out_of_memory(s);
    return s->logits;
}

/* An encoder's layers on s->x ([rows, embed], rows = sentences x width, src: the sentences).
 * Returns the output (s->a or s->b), or NULL if an int8 product had no memory. */
const float *encoder_layers(struct step *s, const struct layer *layers, const struct sources *src)
{
    return run_layers(s, layers, src);
}
