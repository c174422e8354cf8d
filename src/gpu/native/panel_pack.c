/* Packing float32 rows into the panel layout (panel.h): start-up loading (`to_panels`) and a
 * weight update, which writes each received tensor straight into the panels of the model it
 * loads (ringserve.gpu.native.panel.pack_rows).
 *
 * A full panel is 16 source rows read side by side and written as k lines of 16 channels:
 * each 8 x 8 block is transposed in registers (AVX), so the pack runs at about the speed of a
 * copy. (Non-temporal stores measured 2-3x slower than plain ones on the 2-core benchmark VM.) A panel the rows cover only in part (a fused shard
 * that does not start on a multiple of 16, the tail of a matrix) is written lane by lane; its
 * other lanes are left as they are.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "panel.h"

/* Columns j0 .. j0 + 7 of 8 rows (s, row stride ld) -> 8 lines of the panel (d, stride 16). */
static inline void block8(const float *s, int64_t ld, float *d)
{
    const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ld);
    const __m256 r2 = _mm256_loadu_ps(s + 2 * ld), r3 = _mm256_loadu_ps(s + 3 * ld);
    const __m256 r4 = _mm256_loadu_ps(s + 4 * ld), r5 = _mm256_loadu_ps(s + 5 * ld);
    const __m256 r6 = _mm256_loadu_ps(s + 6 * ld), r7 = _mm256_loadu_ps(s + 7 * ld);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 c[8];
    c[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    c[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    c[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    c[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    c[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    c[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    c[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    c[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
    for (int j = 0; j < 8; j++)
        _mm256_storeu_ps(d + j * RS_PANEL, c[j]);
}

/* One panel from 16 full rows. */
static void full_panel(const float *s, int64_t ld, int64_t k, float *d)
{
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        block8(s + j, ld, d + j * RS_PANEL);
        block8(s + 8 * ld + j, ld, d + j * RS_PANEL + 8);
    }
    for (; j < k; j++)
        for (int i = 0; i < RS_PANEL; i++)
            d[j * RS_PANEL + i] = s[i * ld + j];
}

/* Panel p of one job: the rows of it that the job covers. */
static void pack_panel(const rs_pack_job *job, int64_t p)
{
    const int64_t row0 = job->row0, m = job->m, k = job->k, ld = job->ld;
    const int64_t lo = p * RS_PANEL > row0 ? p * RS_PANEL : row0;
    const int64_t hi = (p + 1) * RS_PANEL < row0 + m ? (p + 1) * RS_PANEL : row0 + m;
    float *d = job->panels + p * k * RS_PANEL;
    if (hi - lo == RS_PANEL) {
        full_panel(job->src + (lo - row0) * ld, ld, k, d);
        return;
    }
    for (int64_t r = lo; r < hi; r++) {
        const float *s = job->src + (r - row0) * ld;
        const int64_t lane = r - p * RS_PANEL;
        for (int64_t j = 0; j < k; j++)
            d[j * RS_PANEL + lane] = s[j];
    }
}

static int64_t first_panel(const rs_pack_job *job) { return job->row0 / RS_PANEL; }

static int64_t panel_count(const rs_pack_job *job)
{
    if (job->m <= 0 || job->k <= 0)
        return 0;
    return (job->row0 + job->m - 1) / RS_PANEL + 1 - first_panel(job);
}

/* Every job of `jobs` (the packs of one bucket of a weight update): rows row0 .. row0 + m - 1
 * of a logical float32 [n, k] weight, read from `src` (row r at src + (r - row0) * ld, columns
 * contiguous), written into their lanes of `panels` [P][k][16]; every other lane is left as it
 * is. One parallel region for the whole batch, its panels handed out dynamically, so a thread
 * the scheduler takes away (a trainer copying on the same cores) delays only its last chunk,
 * not a barrier per tensor. Returns 0, or -1 when the index cannot be allocated. */
int rs_pack_f32_batch(const rs_pack_job *jobs, int64_t count, int nthreads)
{
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(count + 1));
    if (start == NULL)
        return -1;
    start[0] = 0;
    for (int64_t i = 0; i < count; i++)
        start[i + 1] = start[i] + panel_count(&jobs[i]);
    const int64_t total = start[count];
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 8)
    for (int64_t g = 0; g < total; g++) {
        int64_t lo = 0, hi = count; /* the job whose panels hold g: start[lo] <= g < start[lo + 1] */
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (start[mid] <= g)
                lo = mid;
            else
                hi = mid;
        }
        pack_panel(&jobs[lo], first_panel(&jobs[lo]) + g - start[lo]);
    }
    free(start);
    return 0;
}

/* One job (start-up packing, a layer's panels). */
int rs_pack_f32_rows(const float *src, int64_t m, int64_t k, int64_t ld, float *panels,
                     int64_t row0, int nthreads)
{
    const rs_pack_job job = {src, m, k, ld, panels, row0};
    return rs_pack_f32_batch(&job, 1, nthreads);
}
