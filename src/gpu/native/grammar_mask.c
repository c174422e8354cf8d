/* The grammar bitmask applied to float32 logits in place (ringserve.gpu.sample.grammar_mask).
 *
 * Bitmask row j (int32 words, bit t % 32 of word t / 32 set when token t is allowed) masks
 * logits row rows[j]: every forbidden token's logit becomes -inf, tokens past the bitmask's
 * width too; bits past the vocabulary are ignored. Words whose 32 tokens are all allowed are
 * skipped and all-forbidden words are filled without testing bits, so a JSON grammar's row
 * (mostly whole forbidden words) costs about one store per token. One thread: a row is
 * microseconds of stores, less than waking a parallel region beside torch's own threads
 * (measured: 7 ms a call with one).
 */
#include <math.h>
#include <stdint.h>

int rs_apply_bitmask(float *logits, int64_t stride, int64_t vocab, const int32_t *bitmask,
                     int64_t words, const int64_t *rows, int64_t k, int nthreads) {
    (void)nthreads;
    const float neg = -INFINITY;
    int64_t width = words * 32 < vocab ? words * 32 : vocab;
    for (int64_t j = 0; j < k; j++) {
        float *row = logits + rows[j] * stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + j * words);
        for (int64_t w = 0; w * 32 < width; w++) {
            uint32_t m = mask[w];
            if (m == 0xFFFFFFFFu)
                continue;
            int64_t base = w * 32;
            int64_t n = width - base < 32 ? width - base : 32;
            if (m == 0) {
                for (int64_t b = 0; b < n; b++)
                    row[base + b] = neg;
            } else {
                for (int64_t b = 0; b < n; b++)
                    if (!((m >> b) & 1u))
                        row[base + b] = neg;
            }
        }
        for (int64_t t = width; t < vocab; t++)
            row[t] = neg;
    }
    return 0;
}
