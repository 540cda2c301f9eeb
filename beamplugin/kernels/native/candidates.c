/* A beam search step's candidates: for each sentence, the k best of lprobs[b][v] + scores[b]
 * over its hypotheses b and words v, best first, with their flat indices b x vocab + v. The
 * sums are torch's (one float addition each), so without ties the candidates and their order
 * are those of torch.topk of the summed tensor. torch.topk orders equal scores (and ranks NaN)
 * its own way, which fairseq's results follow: where the k best hold equal scores, one equals
 * the k-th best without being kept, or a sum is NaN, the call says so, for the caller to take
 * torch.topk.
 *
 * One pass over the hypotheses' log-probabilities, 16 at a time against the k-th best so far:
 * after the first few hundred words almost every vector is below it. torch's add and topk took
 * 0.3 ms a step at 64 sentences x beam 5 of a 4k vocabulary (docs/speed.md). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

/* The highest score met equal to one kept at the time: torch's order decides only if it is
 * still among the k best at the end (a tie the scan later passes by does not count). */
struct tie {
    int seen;
    float value;
};

static inline void note_tie(struct tie *tie, float value)
{
    if (!tie->seen || value > tie->value)
        tie->value = value;
    tie->seen = 1;
}

/* value (not NaN) into best[0..*count) (descending, at most k), after its equals; a tie noted
 * if it equals one of them or, with k kept, the least of them */
static inline void consider(float value, int64_t index, float *best, int64_t *where,
                            int64_t *count, int64_t k, struct tie *tie)
{
    if (*count == k && !(value > best[k - 1])) {
        if (value == best[k - 1])
            note_tie(tie, value);
        return;
    }
    int64_t p = *count < k ? (*count)++ : k - 1;
    while (p > 0 && best[p - 1] < value) {
        best[p] = best[p - 1];
        where[p] = where[p - 1];
        p--;
    }
    if (p > 0 && best[p - 1] == value)
        note_tie(tie, value);
    best[p] = value;
    where[p] = index;
}

/* top_candidates; for a sentence whose `last_step` is 1 (NULL: none), equal -inf scores (dead
 * candidates) do not make it unsure, and vectors of them are skipped once fewer than k live
 * sums were met */
static int64_t ranked(const float *lprobs, int64_t sentence_stride, int64_t beam_stride,
                      const float *scores, int64_t sentences, int64_t beams, int64_t vocab,
                      int64_t k, float *values, int64_t *indices, uint8_t *unsure_rows,
                      const uint8_t *last_step, int threads)
{
    int64_t unsure = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) \
    reduction(+ : unsure)
    for (int64_t s = 0; s < sentences; s++) {
        float *best = values + s * k;
        int64_t *where = indices + s * k, count = 0;
        struct tie tie = {0, 0.0f};
        int nan = 0, dead_ties_decide = !(last_step && last_step[s]);
        for (int64_t b = 0; b < beams; b++) {
            const float *row = lprobs + s * sentence_stride + b * beam_stride;
            float score = scores[s * beams + b];
            int64_t first = b * vocab, v = 0;
            for (; count < k && v < vocab; v++) {
                float value = row[v] + score;
                if (value != value)
                    nan = 1;
                else
                    consider(value, first + v, best, where, &count, k, &tie);
            }
            for (; v + 16 <= vocab; v += 16) {
                v16 sums = plus16(load16(row + v), score);
                float least = best[k - 1];
                if (least == -INFINITY && !dead_ties_decide)
                    least = -FLT_MAX; /* any live sum, or NaN */
                if (!any_not_below16(sums, least))
                    continue;
                float lane[16];
                store16(lane, sums);
                for (int j = 0; j < 16; j++) {
                    if (lane[j] != lane[j])
                        nan = 1;
                    else
                        consider(lane[j], first + v + j, best, where, &count, k, &tie);
                }
            }
            for (; v < vocab; v++) {
                float value = row[v] + score;
                if (value != value)
                    nan = 1;
                else
                    consider(value, first + v, best, where, &count, k, &tie);
            }
        }
        int tie_decides = tie.seen && tie.value >= best[k - 1] &&
                          (dead_ties_decide || tie.value != -INFINITY);
        unsure_rows[s] = nan || count < k || tie_decides;
        unsure += unsure_rows[s];
    }
    return unsure;
}

/* lprobs: [sentences, beams, vocab] (strides sentence_stride, beam_stride, 1); scores:
 * [sentences, beams] contiguous; values, indices: [sentences, k], written; unsure: [sentences],
 * written: 1 where torch.topk may order the sentence's candidates otherwise (ties, NaN). Returns
 * the number of such sentences. */
int64_t top_candidates(const float *lprobs, int64_t sentence_stride, int64_t beam_stride,
                       const float *scores, int64_t sentences, int64_t beams, int64_t vocab,
                       int64_t k, float *values, int64_t *indices, uint8_t *unsure_rows,
                       int threads)
{
    return ranked(lprobs, sentence_stride, beam_stride, scores, sentences, beams, vocab, k,
                  values, indices, unsure_rows, 0, threads);
}

/* fairseq's beam step on top_candidates' k candidates (k >= beam_size): each candidate's
 * hypothesis (flat / vocab) and token (flat % vocab); finalize: the first beam_size
 * candidates that end in EOS with a finite score; the next beam: the first beam_size
 * candidates that do not end in EOS, in rank order, then EOS ones (their scores -inf where
 * fewer than beam_size others can exist: k - beams < beam_size). Outputs [sentences, k]
 * (scores, tokens, beams) and [sentences, beam_size] (finalize, alive beams, tokens, scores).
 * unsure: as top_candidates', except that equal -inf scores leave a sentence at its last
 * step (`last_step` 1; NULL: none) sure: a dead candidate (score -inf) never finishes, and
 * with no next step which dead ones fill the last places changes nothing (at the maximum
 * length every word but EOS is dead, and torch.topk ranked 64 x 5 x 8000 sums a batch again).
 * Before it, they matter: a prefix ending in EOS gives every row the first one's tokens and
 * scores, not its history. An unsure sentence's step is left to the caller (torch's to make).
 * Returns the number of unsure sentences. */
int64_t beam_step(const float *lprobs, int64_t sentence_stride, int64_t beam_stride,
                  const float *scores, int64_t sentences, int64_t beams, int64_t vocab,
                  int64_t k, int64_t beam_size, int64_t eos, float *cand_scores,
                  int64_t *cand_tokens, int64_t *cand_beams, uint8_t *finalize,
                  int64_t *alive_beams, int64_t *alive_tokens, float *alive_scores,
                  const uint8_t *last_step, uint8_t *unsure_rows, int threads)
{
    int64_t unsure = ranked(lprobs, sentence_stride, beam_stride, scores, sentences, beams, vocab,
                            k, cand_scores, cand_tokens, unsure_rows, last_step, threads);
    int dead_slots = k - beams < beam_size;
    for (int64_t s = 0; s < sentences; s++) {
        if (unsure_rows[s])
            continue;
        float *score = cand_scores + s * k;
        int64_t *token = cand_tokens + s * k, *from = cand_beams + s * k;
        uint8_t ends[k];
        for (int64_t j = 0; j < k; j++) {
            int64_t flat = token[j];
            from[j] = flat / vocab;
            token[j] = flat % vocab;
            ends[j] = token[j] == eos && score[j] != -INFINITY;
            if (j < beam_size)
                finalize[s * beam_size + j] = ends[j];
        }
        int64_t n = 0;
        for (int pass = 0; pass < 2 && n < beam_size; pass++)
            for (int64_t j = 0; j < k && n < beam_size; j++)
                if (ends[j] == pass) {
                    int64_t i = s * beam_size + n++;
                    alive_beams[i] = from[j];
                    alive_tokens[i] = token[j];
                    alive_scores[i] = dead_slots && ends[j] ? -INFINITY : score[j];
                }
    }
    return unsure;
}
