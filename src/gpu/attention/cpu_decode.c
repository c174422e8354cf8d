/* Decode attention over the paged KV cache, read in place (the CPU backend's kernel).
 *
 * Built at run time by ringserve.gpu.attention.cpu_native (cc -O3 -march=native -fopenmp)
 * and called through ctypes, which releases the GIL for the call. The torch reference gathers
 * every sequence's keys and values into a padded copy and then runs SDPA over it: on CPU both
 * passes are memory-bound, so reading each key and value once, where it lies, does the same
 * work with a third of the memory traffic.
 *
 * Layout (see torch_ref.py): cache [2, num_slots, hkv, d], keys then values, contiguous; slot
 * = block_id * block_size + offset. Query and output rows are [hq, d], contiguous. Decode i is
 * query row rows[i], attending to the first lens[i] tokens of its sequence, whose blocks are
 * tables[i * max_blocks ...]. The caller has checked every block id it will read.
 *
 * window > 0: decode i sees only its last `window` positions (lens[i] - window .. lens[i] - 1,
 * transformers' sliding window), so the key loops start there. soft_cap > 0: each score
 * becomes soft_cap * tanh(score / soft_cap) after the scale (Gemma 2). Zero turns either off.
 *
 * One task is one (decode, kv head) pair: its group of hq / hkv query heads shares every key
 * and value read. Scores are kept whole (lens[i] floats per query head) and softmaxed in three
 * passes, exactly (no online rescaling): the sequences here are at most max_model_len long.
 *
 * Returns 0, or -1 when a thread's scratch buffers could not be allocated (out untouched for
 * the tasks it did not run).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their maximum), written so that the softmax loop
 * vectorizes: glibc's expf is a scalar call. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by a degree-7 polynomial, times 2^n built in the exponent bits; relative error about
 * 1e-7. Below -87 the result is clamped to about 1.6e-38 (a weight of zero in float32 sums);
 * a NaN stays NaN, so a poisoned row still reaches the sampler's NaN check. */
static inline float exp_nonpositive(float x)
{
    const float xc = x < -87.0f ? -87.0f : x;
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    const float y = p * scale.f;
    return x != x ? x : y;
}

int ringserve_paged_decode_f32(
    const float *q, float *out, const float *cache, int64_t num_slots,
    const int64_t *rows, const int32_t *lens, const int32_t *tables, int64_t max_blocks,
    int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale,
    int64_t max_len, int64_t window, float soft_cap, int nthreads)
{
    const int64_t group = hq / hkv;
    const int64_t row = hkv * d; /* floats per slot: every kv head's key (or value) */
    const float *values = cache + num_slots * row;
    int failed = 0;

#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(hq * max_len));
        float *acc = malloc(sizeof(float) * (size_t)(hq * d));
        if (scores == NULL || acc == NULL)
            failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            if (scores == NULL || acc == NULL)
                continue;
            /* Keys lo .. lens[i] - 1; scores and weights are indexed from lo. */
            const int64_t lo = window > 0 && lens[i] > window ? lens[i] - window : 0;
            const int64_t len = lens[i] - lo;
            const int32_t *table = tables + i * max_blocks;
            const float *qi = q + rows[i] * hq * d;

            for (int64_t p = 0; p < len; p++) {
                const int64_t pos = lo + p;
                const int64_t slot = (int64_t)table[pos / block_size] * block_size
                                     + pos % block_size;
                const float *k = cache + slot * row;
                for (int64_t head = 0; head < hq; head++) {
                    const float *qh = qi + head * d, *kh = k + (head / group) * d;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t j = 0; j < d; j++)
                        dot += qh[j] * kh[j];
                    scores[head * max_len + p] = dot * scale;
                }
            }
            for (int64_t head = 0; head < hq; head++) {
                float *s = scores + head * max_len;
                if (soft_cap > 0.f) {
                    for (int64_t p = 0; p < len; p++)
                        s[p] = soft_cap * tanhf(s[p] / soft_cap);
                }
                float top = s[0];
                for (int64_t p = 1; p < len; p++)
                    top = s[p] > top ? s[p] : top;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t p = 0; p < len; p++) {
                    s[p] = exp_nonpositive(s[p] - top);
                    sum += s[p];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t p = 0; p < len; p++)
                    s[p] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(hq * d));
            for (int64_t p = 0; p < len; p++) {
                const int64_t pos = lo + p;
                const int64_t slot = (int64_t)table[pos / block_size] * block_size
                                     + pos % block_size;
                const float *v = values + slot * row;
                for (int64_t head = 0; head < hq; head++) {
                    const float w = scores[head * max_len + p], *vh = v + (head / group) * d;
                    float *a = acc + head * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; j++)
                        a[j] += w * vh[j];
                }
            }
            memcpy(out + rows[i] * hq * d, acc, sizeof(float) * (size_t)(hq * d));
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
