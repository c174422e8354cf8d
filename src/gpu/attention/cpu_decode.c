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
 * One task is one (decode, kv head) pair (`rs_attend_group`, also called by the fused decode
 * step, decode_step.c): its group of hq / hkv query heads shares every key and value read.
 * Scores are kept whole (lens[i] floats per query head) and softmaxed in three passes,
 * exactly (no online rescaling): the sequences here are at most max_model_len long.
 *
 * Returns 0, or -1 when a thread's scratch buffers could not be allocated (out untouched for
 * the tasks it did not run).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "fast_exp.h"

void rs_attend_group(const float *q, float *out, const float *cache, int64_t num_slots,
                     const int32_t *table, int64_t seq_len, int64_t hq, int64_t hkv, int64_t d,
                     int64_t kv_head, int64_t block_size, float scale, int64_t window,
                     float soft_cap, float *scores)
{
    const int64_t group = hq / hkv;
    const int64_t row = hkv * d; /* floats per slot: every kv head's key (or value) */
    const float *keys = cache + kv_head * d, *values = cache + num_slots * row + kv_head * d;
    /* Keys lo .. seq_len - 1; scores and weights are indexed from lo. */
    const int64_t lo = window > 0 && seq_len > window ? seq_len - window : 0;
    const int64_t len = seq_len - lo;
    const float *qg = q + kv_head * group * d;
    float *og = out + kv_head * group * d;

    for (int64_t p = 0; p < len; p++) {
        const int64_t pos = lo + p;
        const int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
        const float *k = keys + slot * row;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = qg + h * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < d; j++)
                dot += qh[j] * k[j];
            scores[h * len + p] = dot * scale;
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *s = scores + h * len;
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
            s[p] = rs_exp(s[p] - top);
            sum += s[p];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t p = 0; p < len; p++)
            s[p] *= inv;
    }
    memset(og, 0, sizeof(float) * (size_t)(group * d));
    for (int64_t p = 0; p < len; p++) {
        const int64_t pos = lo + p;
        const int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
        const float *v = values + slot * row;
        for (int64_t h = 0; h < group; h++) {
            const float w = scores[h * len + p];
            float *a = og + h * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++)
                a[j] += w * v[j];
        }
    }
}

int ringserve_paged_decode_f32(
    const float *q, float *out, const float *cache, int64_t num_slots,
    const int64_t *rows, const int32_t *lens, const int32_t *tables, int64_t max_blocks,
    int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale,
    int64_t max_len, int64_t window, float soft_cap, int nthreads)
{
    const int64_t group = hq / hkv;
    int failed = 0;

#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * max_len));
        if (scores == NULL)
            failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n * hkv; t++) {
            if (scores == NULL)
                continue;
            const int64_t i = t / hkv;
            rs_attend_group(q + rows[i] * hq * d, out + rows[i] * hq * d, cache, num_slots,
                            tables + i * max_blocks, lens[i], hq, hkv, d, t % hkv, block_size,
                            scale, window, soft_cap, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
