/* Runs our float kernels on fixed pseudo-random inputs and writes every output's bytes to
 * stdout: built once per instruction set (and for AArch64 with a cross-compiler, run under
 * qemu), the outputs of every set that fuses multiply-adds must be the same bytes
 * (tests/test_instruction_sets.py). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

void products(const float *x, int64_t ldx, const float *panels, const float *bias,
              const float *residual, int64_t ldr, float *y, int64_t ldy, int64_t m, int64_t n,
              int64_t k_len, int relu, const float *gamma, const float *beta, float eps,
              int threads);
int self_attention(const float *qkv, int64_t qkv_stride, float *keys, float *values,
                   int64_t row_stride, int64_t head_stride, const int64_t *sources,
                   int64_t slots, const float *bias, float *probs, float *out, int64_t rows,
                   int64_t heads, int64_t head_dim, int64_t width, int threads);
void cross_attention(const float *q, int64_t q_stride, const float *keys, int64_t k_sentence,
                     int64_t k_head, int64_t k_dim, const float *values, int64_t v_sentence,
                     int64_t v_head, const float *bias, int64_t bias_sentence, float *mean,
                     int64_t mean_stride, float *out, int64_t rows, int64_t each, int64_t heads,
                     int64_t head_dim, int64_t src, int threads);
void sentence_attention(const float *q, int64_t q_stride, const float *keys, int64_t k_sentence,
                        int64_t k_dim, const float *values, int64_t v_sentence, int64_t v_src,
                        const float *bias, int64_t bias_sentence, const float *scale,
                        int64_t scale_stride, float *out, int64_t out_stride, float *probs,
                        int64_t sentences, int64_t each, int64_t embed, int64_t src, int threads);
int64_t top_candidates(const float *lprobs, int64_t sentence_stride, int64_t beam_stride,
                       const float *scores, int64_t sentences, int64_t beams, int64_t vocab,
                       int64_t k, float *values, int64_t *indices, uint8_t *unsure_rows,
                       int threads);

static uint64_t state = 12345;

static float uniform(void) /* in [-1, 1) */
{
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((state >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

static float *filled(int64_t n)
{
    float *p = malloc(n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        p[i] = uniform();
    return p;
}

static void emit(const void *p, size_t bytes) { fwrite(p, 1, bytes, stdout); }

static void check_products(int64_t m, int64_t n, int64_t k)
{
    int64_t panels = (n + 31) / 32;
    float *x = filled(m * k), *w = filled(panels * k * 32), *bias = filled(n);
    float *residual = filled(m * n), *gamma = filled(n), *beta = filled(n);
    float *y = malloc(m * n * sizeof(float));
    products(x, k, w, bias, 0, 0, y, n, m, n, k, 0, 0, 0, 0.0f, 1);
    emit(y, m * n * sizeof(float));
    products(x, k, w, bias, 0, 0, y, n, m, n, k, 1, 0, 0, 0.0f, 1);
    emit(y, m * n * sizeof(float));
    products(x, k, w, bias, residual, n, y, n, m, n, k, 0, gamma, beta, 1e-5f, 1);
    emit(y, m * n * sizeof(float));
    free(x), free(w), free(bias), free(residual), free(gamma), free(beta), free(y);
}

static void check_attention(int64_t rows, int64_t heads, int64_t head_dim, int64_t width,
                            int64_t src)
{
    int64_t embed = heads * head_dim;
    float *qkv = filled(rows * 3 * embed), *keys = filled(rows * heads * width * head_dim);
    float *values = filled(rows * heads * width * head_dim), *bias = calloc(rows * width, 4);
    int64_t *sources = malloc(rows * width * sizeof(int64_t));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < width; j++) {
            sources[r * width + j] = (r + j) % rows;
            bias[r * width + j] = j < r % 3 ? -INFINITY : 0.0f; /* masked columns */
        }
    float *out = malloc(rows * embed * sizeof(float));
    float *probs = malloc(rows * heads * width * sizeof(float));
    self_attention(qkv, 3 * embed, keys, values, heads * width * head_dim, width * head_dim,
                   sources, rows, bias, probs, out, rows, heads, head_dim, width, 1);
    emit(out, rows * embed * sizeof(float));
    emit(probs, rows * heads * width * sizeof(float));
    float *ckeys = filled(heads * head_dim * src), *cvalues = filled(heads * src * head_dim);
    float *cbias = calloc(src, 4), *mean = malloc(rows * src * sizeof(float));
    cbias[0] = -INFINITY;
    cross_attention(qkv, 3 * embed, ckeys, heads * head_dim * src, head_dim * src, src, cvalues,
                    heads * src * head_dim, src * head_dim, cbias, src, mean, src, out, rows,
                    rows, heads, head_dim, src, 1);
    emit(out, rows * embed * sizeof(float));
    emit(mean, rows * src * sizeof(float));
    free(qkv), free(keys), free(values), free(bias), free(sources), free(out), free(probs);
    free(ckeys), free(cvalues), free(cbias), free(mean);
}

/* ConvS2S's: `each` rows a sentence (tiles of 6 and what is left), widths off the vectors */
static void check_sentence_attention(int64_t sentences, int64_t each, int64_t embed, int64_t src)
{
    int64_t rows = sentences * each;
    float *q = filled(rows * embed), *keys = filled(sentences * embed * src);
    float *values = filled(sentences * src * embed), *scale = filled(sentences);
    float *bias = calloc(sentences * src, 4), *out = malloc(rows * embed * sizeof(float));
    float *probs = malloc(rows * src * sizeof(float));
    for (int64_t n = 0; n < sentences; n++)
        for (int64_t j = 0; j < n % 3; j++)
            bias[n * src + j] = -INFINITY; /* padding before a source */
    sentence_attention(q, embed, keys, embed * src, src, values, src * embed, embed, bias, src,
                       scale, 1, out, embed, probs, sentences, each, embed, src, 1);
    emit(out, rows * embed * sizeof(float));
    emit(probs, rows * src * sizeof(float));
    free(q), free(keys), free(values), free(scale), free(bias), free(out), free(probs);
}

static void check_candidates(int64_t sentences, int64_t beams, int64_t vocab)
{
    float *lprobs = filled(sentences * beams * vocab), *scores = filled(sentences * beams);
    int64_t k = 2 * beams;
    float *values = malloc(sentences * k * sizeof(float));
    int64_t *indices = malloc(sentences * k * sizeof(int64_t));
    uint8_t *unsure_rows = malloc(sentences);
    int64_t unsure = top_candidates(lprobs, beams * vocab, vocab, scores, sentences, beams,
                                    vocab, k, values, indices, unsure_rows, 1);
    emit(&unsure, sizeof unsure);
    emit(unsure_rows, sentences);
    emit(values, sentences * k * sizeof(float));
    emit(indices, sentences * k * sizeof(int64_t));
    free(lprobs), free(scores), free(values), free(indices), free(unsure_rows);
}

void log_softmax(float *rows, int64_t count, int64_t width, int64_t stride, int threads);

/* widths off the 16-float vectors, masked words, exps below the float range */
static void check_log_softmax(int64_t rows, int64_t width)
{
    float *x = filled(rows * width);
    for (int64_t i = 0; i < rows * width; i++)
        x[i] = i % 7 == 3 ? -INFINITY : 60.0f * x[i];
    log_softmax(x, rows, width, width, 1);
    emit(x, rows * width * sizeof(float));
    free(x);
}

int main(void)
{
    const int64_t shapes[][2] = {{256, 256}, {1032, 256}, {37, 101}, {64, 1024}};
    for (int s = 0; s < 4; s++)
        for (int64_t m = 1; m <= 17; m += (m < 9 ? 1 : 8))
            check_products(m, shapes[s][0], shapes[s][1]);
    check_attention(5, 4, 64, 9, 13);
    check_attention(3, 2, 24, 17, 40);
    check_sentence_attention(3, 5, 256, 48);
    check_sentence_attention(2, 13, 40, 37);
    check_candidates(3, 5, 3992);
    check_log_softmax(5, 3992);
    check_log_softmax(7, 37);
    check_log_softmax(3, 3);
    return 0;
}
