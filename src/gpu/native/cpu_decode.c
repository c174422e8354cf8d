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
 * One task is one decode's kv heads kv0 .. kv1 - 1 (`rs_attend_heads`, also called by the
 * fused decode step, decode_step.c): every kv head of the decode when there are decodes
 * enough for the threads (its keys, then its values, are read as one stream), else one. Each
 * kv head's group of hq / hkv query heads shares every key and value read. Scores are kept
 * whole (lens[i] floats per query head) and softmaxed in three passes, exactly (no online
 * rescaling): the sequences here are at most max_model_len long.
 *
 * With AVX2 and d % 8 == 0 (every model here), the scores are taken eight positions at a time
 * (eight accumulators, one horizontal sum for the eight) and the weighted sum of the values in
 * register tiles of up to 3 query heads by 32 channels (4 by 16 when the group is a multiple
 * of 4), one pass over the positions each; the
 * first pass prefetches the rest of each value row, so the later passes read it from L2. The
 * scalar loops (the reference for this order of summation up to float32 rounding) serve the
 * rest. Measured on the AVX2 benchmark VM, 32 decodes of 256 tokens, the 135M shape (9 query
 * heads, 3 kv heads, d 64), 30 layers' distinct caches, 2 threads: 86 ms with the scalar loops
 * (a scalar e^x, a horizontal sum per dot product, a 64-bit division per position) -> see
 * docs/benchmarks.md for the current figure.
 *
 * Returns 0, or -1 when a thread's scratch buffers could not be allocated (out untouched for
 * the tasks it did not run).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "fast_exp.h" /* immintrin.h where AVX2 is on */

/* The slot of position pos (its block's id times block_size plus its offset). */
static inline int64_t slot_of(const int32_t *table, int64_t pos, int64_t block_size)
{
    return (int64_t)table[pos / block_size] * block_size + pos % block_size;
}

/* The positions lo, lo + 1, ... of a sequence, walked block by block without a division. */
typedef struct {
    const int32_t *table;
    int64_t block_size, blk, off;
} slot_walk;

static inline slot_walk walk_from(const int32_t *table, int64_t lo, int64_t block_size)
{
    const slot_walk w = {table, block_size, lo / block_size, lo % block_size};
    return w;
}

/* The slot of the walk's position, then one position on. */
static inline int64_t walk_next(slot_walk *w)
{
    const int64_t slot = (int64_t)w->table[w->blk] * w->block_size + w->off;
    if (++w->off == w->block_size) {
        w->off = 0;
        w->blk++;
    }
    return slot;
}

#if defined(__AVX2__) && defined(__FMA__)
/* The lane sums of eight vectors, in order: lane i of the result is the sum of a[i]. */
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                          __m256 a6, __m256 a7)
{
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                         _mm256_permute2f128_ps(t0, t1, 0x31));
}

static inline float sum1(__m256 a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float max1(__m256 a)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

#ifndef RS_PREFETCH
/* Positions ahead whose rows are prefetched into L2 (into L1, or 64-128 ahead: slower). */
#define RS_PREFETCH 32
#endif

static inline void prefetch_row(const float *row, int64_t floats)
{
    for (int64_t j = 0; j < floats; j += 16)
        _mm_prefetch((const char *)(row + j), _MM_HINT_T1);
}

/* scores[h * len + p] = scale * q_h . key(lo + p) for the heads qh of q (nh of them, query
 * head h reading kv head h / group at keys + (h / group) * d), eight positions at a time:
 * the eight keys' rows stay in L1 while every head passes, and the next eight are prefetched. */
static void vector_scores(const float *q, int64_t nh, int64_t group, int64_t d,
                          const float *keys, int64_t row, slot_walk walk, int64_t len,
                          float scale, float *scores)
{
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t span = nh / group * d; /* floats of a key row the heads read */
    /* The rows RS_PREFETCH positions ahead are fetched while these are summed. */
    slot_walk ahead = walk;
    int64_t fetched = 0;
    for (; fetched < RS_PREFETCH && fetched < len; fetched++)
        prefetch_row(keys + walk_next(&ahead) * row, span);
    int64_t p = 0;
    for (; p + 8 <= len; p += 8) {
        const float *k[8];
        for (int i = 0; i < 8; i++)
            k[i] = keys + walk_next(&walk) * row;
        for (int i = 0; i < 8 && fetched < len; i++, fetched++)
            prefetch_row(keys + walk_next(&ahead) * row, span);
        for (int64_t h = 0; h < nh; h++) {
            const float *qh = q + h * d;
            const int64_t kv = (h / group) * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
                   a6 = a0, a7 = a0;
            for (int64_t j = 0; j < d; j += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + j);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + kv + j), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + kv + j), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + kv + j), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + kv + j), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + kv + j), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + kv + j), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + kv + j), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + kv + j), a7);
            }
            _mm256_storeu_ps(scores + h * len + p,
                             _mm256_mul_ps(sum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
        }
    }
    for (; p < len; p++) {
        const float *kp = keys + walk_next(&walk) * row;
        for (int64_t h = 0; h < nh; h++) {
            const float *qh = q + h * d, *kh = kp + (h / group) * d;
            __m256 a = _mm256_setzero_ps();
            for (int64_t j = 0; j < d; j += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), _mm256_loadu_ps(kh + j), a);
            scores[h * len + p] = sum1(a) * scale;
        }
    }
}

/* out[h][j0 .. j0 + W) = sum_p weights[h][p] value(lo + p)[j0 ..] for HN heads and W = 8, 16
 * or 32 channels (HN * W / 8 <= 12 accumulators) from values (one kv head's): the
 * accumulators stay in registers over every position. prefetch: fetch `span` floats of each
 * value row from there on the way (the task's kv heads). HN and W are constants where it is
 * inlined. */
static inline __attribute__((always_inline)) void value_tile(
    int HN, int W, const float *weights, int64_t len, const float *values, int64_t row,
    slot_walk walk, int64_t j0, float *out, int64_t d, const float *prefetch, int64_t span)
{
    __m256 acc[4][4];
    for (int h = 0; h < HN; h++)
        for (int c = 0; c < W / 8; c++)
            acc[h][c] = _mm256_setzero_ps();
    slot_walk ahead = walk;
    int64_t fetched = 0;
    if (prefetch != NULL)
        for (; fetched < RS_PREFETCH && fetched < len; fetched++)
            prefetch_row(prefetch + walk_next(&ahead) * row, span);
    for (int64_t p = 0; p < len; p++) {
        const float *v = values + walk_next(&walk) * row + j0;
        if (prefetch != NULL && fetched < len) {
            prefetch_row(prefetch + walk_next(&ahead) * row, span);
            fetched++;
        }
        __m256 vv[4];
        for (int c = 0; c < W / 8; c++)
            vv[c] = _mm256_loadu_ps(v + 8 * c);
        for (int h = 0; h < HN; h++) {
            const __m256 w = _mm256_broadcast_ss(weights + h * len + p);
            for (int c = 0; c < W / 8; c++)
                acc[h][c] = _mm256_fmadd_ps(w, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < HN; h++)
        for (int c = 0; c < W / 8; c++)
            _mm256_storeu_ps(out + h * d + j0 + 8 * c, acc[h][c]);
}

/* out [nh, d] = weights [nh, len] times the values (query head h reads kv head h / group at
 * values + (h / group) * d): per kv head, tiles of up to 4 of its query heads by 16 channels,
 * or of up to 3 by 32 (fewer passes over the positions, two lines of each row per pass). */
static void vector_values(const float *weights, int64_t nh, int64_t group, int64_t d,
                          const float *values, int64_t row, slot_walk walk, int64_t len,
                          float *out)
{
    for (int64_t g0 = 0; g0 < nh; g0 += group) {
        const float *vg = values + (g0 / group) * d;
        const int64_t step = group % 4 == 0 ? 4 : 3; /* query heads per tile */
        for (int64_t h0 = g0; h0 < g0 + group; h0 += step) {
            const int64_t hn = g0 + group - h0 < step ? g0 + group - h0 : step;
            const float *w = weights + h0 * len;
            float *o = out + h0 * d;
            for (int64_t j0 = 0; j0 < d;) {
                const int64_t left = d - j0;
                const int64_t width = hn <= 3 && left >= 32 ? 32 : left >= 16 ? 16 : 8;
                const float *pf = g0 == 0 && h0 == 0 && j0 == 0 ? values : NULL;
#define RS_VALUE_TILE(HN)                                                                    \
    (width == 32 ? value_tile(HN, 32, w, len, vg, row, walk, j0, o, d, pf, nh / group * d)  \
     : width == 16 ? value_tile(HN, 16, w, len, vg, row, walk, j0, o, d, pf, nh / group * d) \
                   : value_tile(HN, 8, w, len, vg, row, walk, j0, o, d, pf, nh / group * d))
                switch (hn) {
                case 4: RS_VALUE_TILE(4); break;
                case 3: RS_VALUE_TILE(3); break;
                case 2: RS_VALUE_TILE(2); break;
                default: RS_VALUE_TILE(1); break;
                }
#undef RS_VALUE_TILE
                j0 += width;
            }
        }
    }
}
#endif

/* Softmax of one head's scores s [len] in place (soft-capped first when soft_cap > 0). */
static void softmax(float *s, int64_t len, float soft_cap)
{
    if (soft_cap > 0.f) {
        for (int64_t p = 0; p < len; p++)
            s[p] = soft_cap * tanhf(s[p] / soft_cap);
    }
    float top = s[0];
    int64_t p = 1;
#if defined(__AVX2__) && defined(__FMA__)
    /* max_ps(x, m) keeps m where x is NaN, as the scalar comparison does. */
    __m256 vmax = _mm256_set1_ps(top);
    for (; p + 8 <= len; p += 8)
        vmax = _mm256_max_ps(_mm256_loadu_ps(s + p), vmax);
    top = max1(vmax);
#endif
    for (; p < len; p++)
        top = s[p] > top ? s[p] : top;
    float sum = 0.f;
    p = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (; p + 8 <= len; p += 8) {
        const __m256 e = rs_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vtop));
        _mm256_storeu_ps(s + p, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = sum1(vsum);
#endif
    for (; p < len; p++) {
        s[p] = rs_exp(s[p] - top);
        sum += s[p];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < len; i++)
        s[i] *= inv;
}

void rs_attend_heads(const float *q, float *out, const float *cache, int64_t num_slots,
                     const int32_t *table, int64_t seq_len, int64_t hq, int64_t hkv, int64_t d,
                     int64_t kv0, int64_t kv1, int64_t block_size, float scale, int64_t window,
                     float soft_cap, float *scores)
{
    const int64_t group = hq / hkv, nh = (kv1 - kv0) * group;
    const int64_t row = hkv * d; /* floats per slot: every kv head's key (or value) */
    const float *keys = cache + kv0 * d, *values = cache + num_slots * row + kv0 * d;
    /* Keys lo .. seq_len - 1; scores and weights are indexed from lo. */
    const int64_t lo = window > 0 && seq_len > window ? seq_len - window : 0;
    const int64_t len = seq_len - lo;
    const float *qg = q + kv0 * group * d;
    float *og = out + kv0 * group * d;
    const slot_walk walk = walk_from(table, lo, block_size);
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        vector_scores(qg, nh, group, d, keys, row, walk, len, scale, scores);
        for (int64_t h = 0; h < nh; h++)
            softmax(scores + h * len, len, soft_cap);
        vector_values(scores, nh, group, d, values, row, walk, len, og);
        return;
    }
#endif
    for (int64_t p = 0; p < len; p++) {
        const float *k = keys + slot_of(table, lo + p, block_size) * row;
        for (int64_t h = 0; h < nh; h++) {
            const float *qh = qg + h * d, *kh = k + (h / group) * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < d; j++)
                dot += qh[j] * kh[j];
            scores[h * len + p] = dot * scale;
        }
    }
    for (int64_t h = 0; h < nh; h++)
        softmax(scores + h * len, len, soft_cap);
    memset(og, 0, sizeof(float) * (size_t)(nh * d));
    for (int64_t p = 0; p < len; p++) {
        const float *v = values + slot_of(table, lo + p, block_size) * row;
        for (int64_t h = 0; h < nh; h++) {
            const float w = scores[h * len + p], *vh = v + (h / group) * d;
            float *a = og + h * d;
#pragma omp simd
            for (int64_t j = 0; j < d; j++)
                a[j] += w * vh[j];
        }
    }
}

int64_t rs_attend_heads_per_task(int64_t n, int64_t hkv, int64_t nthreads)
{
    return n >= 2 * nthreads ? hkv : 1;
}

int ringserve_paged_decode_f32(
    const float *q, float *out, const float *cache, int64_t num_slots,
    const int64_t *rows, const int32_t *lens, const int32_t *tables, int64_t max_blocks,
    int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t block_size, float scale,
    int64_t max_len, int64_t window, float soft_cap, int nthreads)
{
    int failed = 0;
    const int64_t per = rs_attend_heads_per_task(n, hkv, nthreads);

#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const int64_t floats = rs_attend_scratch_floats(hq, hkv, per, max_len);
        float *scores = malloc(sizeof(float) * (size_t)floats);
        if (scores == NULL)
            failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n * (hkv / per); t++) {
            if (scores == NULL)
                continue;
            const int64_t i = t / (hkv / per), kv0 = t % (hkv / per) * per;
            rs_attend_heads(q + rows[i] * hq * d, out + rows[i] * hq * d, cache, num_slots,
                            tables + i * max_blocks, lens[i], hq, hkv, d, kv0, kv0 + per,
                            block_size, scale, window, soft_cap, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
