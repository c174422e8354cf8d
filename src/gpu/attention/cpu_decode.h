/* The per-task function of the CPU decode attention kernel (cpu_decode.c), shared with the
 * fused decode step (../decode_step.c). */
#ifndef RINGSERVE_CPU_DECODE_H
#define RINGSERVE_CPU_DECODE_H

#include <stdint.h>

/* Attention of one decode's query heads of kv head `kv_head` (hq / hkv of them, rows
 * kv_head * group .. of q [hq, d]) over the first seq_len tokens of its sequence (block ids
 * `table`, checked by the caller), into the same rows of out [hq, d]. `scores` holds
 * group * seq_len floats. window > 0: the last `window` positions only; soft_cap > 0: each
 * score becomes soft_cap * tanh(score / soft_cap). */
void rs_attend_group(const float *q, float *out, const float *cache, int64_t num_slots,
                     const int32_t *table, int64_t seq_len, int64_t hq, int64_t hkv, int64_t d,
                     int64_t kv_head, int64_t block_size, float scale, int64_t window,
                     float soft_cap, float *scores);

#endif
