/* The per-task function of the CPU decode attention kernel (cpu_decode.c), shared with the
 * fused decode step (../decode_step.c). */
#ifndef RINGSERVE_CPU_DECODE_H
#define RINGSERVE_CPU_DECODE_H

#include <stdint.h>

/* Attention of one decode's query heads of kv heads kv0 .. kv1 - 1 (hq / hkv per kv head,
 * rows kv0 * group .. kv1 * group - 1 of q [hq, d]) over the first seq_len tokens of its
 * sequence (block ids `table`, checked by the caller), into the same rows of out [hq, d].
 * `scores` holds (kv1 - kv0) * group * seq_len floats (rs_attend_scratch_floats). window > 0:
 * the last `window` positions only; soft_cap > 0: each score becomes
 * soft_cap * tanh(score / soft_cap). */
void rs_attend_heads(const float *q, float *out, const float *cache, int64_t num_slots,
                     const int32_t *table, int64_t seq_len, int64_t hq, int64_t hkv, int64_t d,
                     int64_t kv0, int64_t kv1, int64_t block_size, float scale, int64_t window,
                     float soft_cap, float *scores);

/* KV heads per task when n decodes are split over nthreads threads: every head of a decode
 * (its keys and values are read as one stream) when there are decodes enough to keep every
 * thread busy, else one. hkv is a multiple of it. */
int64_t rs_attend_heads_per_task(int64_t n, int64_t hkv, int64_t nthreads);

/* Floats of scores scratch one thread needs for tasks of `per` kv heads over sequences of
 * up to max_len tokens. */
static inline int64_t rs_attend_scratch_floats(int64_t hq, int64_t hkv, int64_t per,
                                               int64_t max_len)
{
    return hq / hkv * per * (max_len > 0 ? max_len : 1);
}

#endif
