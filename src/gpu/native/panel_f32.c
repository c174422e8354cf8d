/* The float32 panel matmul (layout: panel.h), and the dispatch every CPU matmul goes through.
 *
 * Built at run time by ringserve.gpu.native.panel (cc -O3 -march=native -fopenmp) with
 * panel_quant.c and decode_step.c into one library, called through ctypes.
 *
 * A tile is up to 6 rows of x against one panel: 12 accumulators of 8 channels, the panel's
 * 16 channels of input j loaded once and multiplied by each row's x[j] broadcast, so one
 * pass over the panel serves every row of the tile (BLIS's register blocking, 6 x 16). Each
 * tile size is written out: with a loop over rows, gcc keeps the accumulators on the stack.
 * One row reads the panel at the memory bandwidth; 6 rows are bound by the FMA units, as long
 * as the panel is in cache: the first tile of each panel fetches the next one into L2 (one
 * prefetch per input), so its DRAM reads overlap this one's arithmetic (30 distinct weights
 * of every 135M-shape linear plus the LM head, 2 threads: 33.0 -> 24.4 ms at 8 rows, 67.7
 * -> 58.8 at 32, 125 -> 105 at 64; medians of 3 alternated runs; 1 row unchanged at ~19 ms).
 * The 1-row tile fetches the next panel too: on the AMX Xeon dev VM one pass over 30
 * 3072 x 576 weights went 12.7 -> 8.8-10.4 ms (16.7 -> 20.5-24.2 GB/s, the .sum() rate), a
 * whole float32 decode step 1.21x faster at batch 1.
 * Measured on the AVX2 benchmark VM (2 threads, 30 distinct weights so they stream from
 * DRAM): 3072 x 576 at 1 row 10.3 ms vs oneDNN's packed GEMM 17.2 ms (20.6 vs 12.3 GB/s);
 * at 64 rows 63.7 vs 60.0 ms.
 */
#include <immintrin.h>
#include <string.h>

#include "panel.h"

#define TILE_ROWS 6
/* Rows of x per block: a block's rows stay in L2 while every panel of the thread passes. */
#define ROW_BLOCK 48

static void tile1(const float *x, int64_t ldx, const float *p, int64_t k, float *out,
                  const float *pf)
{
    (void)ldx; /* one row */
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a;
    __m256 d0a = _mm256_setzero_ps(), d0b = d0a;
    int64_t j = 0;
    for (; j + 2 <= k; j += 2) {
        _mm_prefetch((const char *)(pf + j * 16), _MM_HINT_T1);
        _mm_prefetch((const char *)(pf + j * 16 + 16), _MM_HINT_T1);
        const __m256 xa = _mm256_broadcast_ss(x + j), xb = _mm256_broadcast_ss(x + j + 1);
        c0a = _mm256_fmadd_ps(xa, _mm256_loadu_ps(p + j * 16), c0a);
        c0b = _mm256_fmadd_ps(xa, _mm256_loadu_ps(p + j * 16 + 8), c0b);
        d0a = _mm256_fmadd_ps(xb, _mm256_loadu_ps(p + j * 16 + 16), d0a);
        d0b = _mm256_fmadd_ps(xb, _mm256_loadu_ps(p + j * 16 + 24), d0b);
    }
    for (; j < k; j++) {
        const __m256 xa = _mm256_broadcast_ss(x + j);
        c0a = _mm256_fmadd_ps(xa, _mm256_loadu_ps(p + j * 16), c0a);
        c0b = _mm256_fmadd_ps(xa, _mm256_loadu_ps(p + j * 16 + 8), c0b);
    }
    c0a = _mm256_add_ps(c0a, d0a);
    c0b = _mm256_add_ps(c0b, d0b);
    _mm256_storeu_ps(out + 0, c0a);
    _mm256_storeu_ps(out + 8, c0b);
}

static void tile2(const float *x, int64_t ldx, const float *p, int64_t k, float *out,
                  const float *pf)
{
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a; __m256 c1a = _mm256_setzero_ps(), c1b = c1a;
    for (int64_t j = 0; j < k; j++) {
        const __m256 w0 = _mm256_loadu_ps(p + j * 16), w1 = _mm256_loadu_ps(p + j * 16 + 8);
        _mm_prefetch((const char *)(pf + j * 16), _MM_HINT_T1);
        __m256 xb;
        xb = _mm256_broadcast_ss(x + 0 * ldx + j);
        c0a = _mm256_fmadd_ps(xb, w0, c0a);
        c0b = _mm256_fmadd_ps(xb, w1, c0b);
        xb = _mm256_broadcast_ss(x + 1 * ldx + j);
        c1a = _mm256_fmadd_ps(xb, w0, c1a);
        c1b = _mm256_fmadd_ps(xb, w1, c1b);
    }
    _mm256_storeu_ps(out + 0, c0a);
    _mm256_storeu_ps(out + 8, c0b);
    _mm256_storeu_ps(out + 16, c1a);
    _mm256_storeu_ps(out + 24, c1b);
}

static void tile3(const float *x, int64_t ldx, const float *p, int64_t k, float *out,
                  const float *pf)
{
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a; __m256 c1a = _mm256_setzero_ps(), c1b = c1a; __m256 c2a = _mm256_setzero_ps(), c2b = c2a;
    for (int64_t j = 0; j < k; j++) {
        const __m256 w0 = _mm256_loadu_ps(p + j * 16), w1 = _mm256_loadu_ps(p + j * 16 + 8);
        _mm_prefetch((const char *)(pf + j * 16), _MM_HINT_T1);
        __m256 xb;
        xb = _mm256_broadcast_ss(x + 0 * ldx + j);
        c0a = _mm256_fmadd_ps(xb, w0, c0a);
        c0b = _mm256_fmadd_ps(xb, w1, c0b);
        xb = _mm256_broadcast_ss(x + 1 * ldx + j);
        c1a = _mm256_fmadd_ps(xb, w0, c1a);
        c1b = _mm256_fmadd_ps(xb, w1, c1b);
        xb = _mm256_broadcast_ss(x + 2 * ldx + j);
        c2a = _mm256_fmadd_ps(xb, w0, c2a);
        c2b = _mm256_fmadd_ps(xb, w1, c2b);
    }
    _mm256_storeu_ps(out + 0, c0a);
    _mm256_storeu_ps(out + 8, c0b);
    _mm256_storeu_ps(out + 16, c1a);
    _mm256_storeu_ps(out + 24, c1b);
    _mm256_storeu_ps(out + 32, c2a);
    _mm256_storeu_ps(out + 40, c2b);
}

static void tile4(const float *x, int64_t ldx, const float *p, int64_t k, float *out,
                  const float *pf)
{
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a; __m256 c1a = _mm256_setzero_ps(), c1b = c1a; __m256 c2a = _mm256_setzero_ps(), c2b = c2a; __m256 c3a = _mm256_setzero_ps(), c3b = c3a;
    for (int64_t j = 0; j < k; j++) {
        const __m256 w0 = _mm256_loadu_ps(p + j * 16), w1 = _mm256_loadu_ps(p + j * 16 + 8);
        _mm_prefetch((const char *)(pf + j * 16), _MM_HINT_T1);
        __m256 xb;
        xb = _mm256_broadcast_ss(x + 0 * ldx + j);
        c0a = _mm256_fmadd_ps(xb, w0, c0a);
        c0b = _mm256_fmadd_ps(xb, w1, c0b);
        xb = _mm256_broadcast_ss(x + 1 * ldx + j);
        c1a = _mm256_fmadd_ps(xb, w0, c1a);
        c1b = _mm256_fmadd_ps(xb, w1, c1b);
        xb = _mm256_broadcast_ss(x + 2 * ldx + j);
        c2a = _mm256_fmadd_ps(xb, w0, c2a);
        c2b = _mm256_fmadd_ps(xb, w1, c2b);
        xb = _mm256_broadcast_ss(x + 3 * ldx + j);
        c3a = _mm256_fmadd_ps(xb, w0, c3a);
        c3b = _mm256_fmadd_ps(xb, w1, c3b);
    }
    _mm256_storeu_ps(out + 0, c0a);
    _mm256_storeu_ps(out + 8, c0b);
    _mm256_storeu_ps(out + 16, c1a);
    _mm256_storeu_ps(out + 24, c1b);
    _mm256_storeu_ps(out + 32, c2a);
    _mm256_storeu_ps(out + 40, c2b);
    _mm256_storeu_ps(out + 48, c3a);
    _mm256_storeu_ps(out + 56, c3b);
}

static void tile5(const float *x, int64_t ldx, const float *p, int64_t k, float *out,
                  const float *pf)
{
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a; __m256 c1a = _mm256_setzero_ps(), c1b = c1a; __m256 c2a = _mm256_setzero_ps(), c2b = c2a; __m256 c3a = _mm256_setzero_ps(), c3b = c3a; __m256 c4a = _mm256_setzero_ps(), c4b = c4a;
    for (int64_t j = 0; j < k; j++) {
        const __m256 w0 = _mm256_loadu_ps(p + j * 16), w1 = _mm256_loadu_ps(p + j * 16 + 8);
        _mm_prefetch((const char *)(pf + j * 16), _MM_HINT_T1);
        __m256 xb;
        xb = _mm256_broadcast_ss(x + 0 * ldx + j);
        c0a = _mm256_fmadd_ps(xb, w0, c0a);
        c0b = _mm256_fmadd_ps(xb, w1, c0b);
        xb = _mm256_broadcast_ss(x + 1 * ldx + j);
        c1a = _mm256_fmadd_ps(xb, w0, c1a);
        c1b = _mm256_fmadd_ps(xb, w1, c1b);
        xb = _mm256_broadcast_ss(x + 2 * ldx + j);
        c2a = _mm256_fmadd_ps(xb, w0, c2a);
        c2b = _mm256_fmadd_ps(xb, w1, c2b);
        xb = _mm256_broadcast_ss(x + 3 * ldx + j);
        c3a = _mm256_fmadd_ps(xb, w0, c3a);
        c3b = _mm256_fmadd_ps(xb, w1, c3b);
        xb = _mm256_broadcast_ss(x + 4 * ldx + j);
        c4a = _mm256_fmadd_ps(xb, w0, c4a);
        c4b = _mm256_fmadd_ps(xb, w1, c4b);
    }
    _mm256_storeu_ps(out + 0, c0a);
    _mm256_storeu_ps(out + 8, c0b);
    _mm256_storeu_ps(out + 16, c1a);
    _mm256_storeu_ps(out + 24, c1b);
    _mm256_storeu_ps(out + 32, c2a);
    _mm256_storeu_ps(out + 40, c2b);
    _mm256_storeu_ps(out + 48, c3a);
    _mm256_storeu_ps(out + 56, c3b);
    _mm256_storeu_ps(out + 64, c4a);
    _mm256_storeu_ps(out + 72, c4b);
}

static void tile6(const float *x, int64_t ldx, const float *p, int64_t k, float *out,
                  const float *pf)
{
    __m256 c0a = _mm256_setzero_ps(), c0b = c0a; __m256 c1a = _mm256_setzero_ps(), c1b = c1a; __m256 c2a = _mm256_setzero_ps(), c2b = c2a; __m256 c3a = _mm256_setzero_ps(), c3b = c3a; __m256 c4a = _mm256_setzero_ps(), c4b = c4a; __m256 c5a = _mm256_setzero_ps(), c5b = c5a;
    for (int64_t j = 0; j < k; j++) {
        const __m256 w0 = _mm256_loadu_ps(p + j * 16), w1 = _mm256_loadu_ps(p + j * 16 + 8);
        _mm_prefetch((const char *)(pf + j * 16), _MM_HINT_T1);
        __m256 xb;
        xb = _mm256_broadcast_ss(x + 0 * ldx + j);
        c0a = _mm256_fmadd_ps(xb, w0, c0a);
        c0b = _mm256_fmadd_ps(xb, w1, c0b);
        xb = _mm256_broadcast_ss(x + 1 * ldx + j);
        c1a = _mm256_fmadd_ps(xb, w0, c1a);
        c1b = _mm256_fmadd_ps(xb, w1, c1b);
        xb = _mm256_broadcast_ss(x + 2 * ldx + j);
        c2a = _mm256_fmadd_ps(xb, w0, c2a);
        c2b = _mm256_fmadd_ps(xb, w1, c2b);
        xb = _mm256_broadcast_ss(x + 3 * ldx + j);
        c3a = _mm256_fmadd_ps(xb, w0, c3a);
        c3b = _mm256_fmadd_ps(xb, w1, c3b);
        xb = _mm256_broadcast_ss(x + 4 * ldx + j);
        c4a = _mm256_fmadd_ps(xb, w0, c4a);
        c4b = _mm256_fmadd_ps(xb, w1, c4b);
        xb = _mm256_broadcast_ss(x + 5 * ldx + j);
        c5a = _mm256_fmadd_ps(xb, w0, c5a);
        c5b = _mm256_fmadd_ps(xb, w1, c5b);
    }
    _mm256_storeu_ps(out + 0, c0a);
    _mm256_storeu_ps(out + 8, c0b);
    _mm256_storeu_ps(out + 16, c1a);
    _mm256_storeu_ps(out + 24, c1b);
    _mm256_storeu_ps(out + 32, c2a);
    _mm256_storeu_ps(out + 40, c2b);
    _mm256_storeu_ps(out + 48, c3a);
    _mm256_storeu_ps(out + 56, c3b);
    _mm256_storeu_ps(out + 64, c4a);
    _mm256_storeu_ps(out + 72, c4b);
    _mm256_storeu_ps(out + 80, c5a);
    _mm256_storeu_ps(out + 88, c5b);
}

#ifdef __AVX512F__
/* With AVX-512 a panel row of 16 channels is one register, and there are 32 of them: a tile
 * is 4 to 8 rows of one accumulator each, one load of the panel row and one FMA with an
 * embedded broadcast per row and input. Each output is the same single chain of FMAs as in
 * the 2 .. 6-row tiles above, so the results are bit-identical to theirs; fewer than 4 rows
 * keep those tiles (with one chain per row the FMA latency would bound them). The 135M
 * shape's 120 linears at 32 rows, 2 threads: 45.3 -> 35.9 ms (150 -> 189 GFLOP/s; the LM
 * head 158 -> 194); taller tiles were slower (16 rows: 150 GFLOP/s against 193 for 8 in the
 * same run, with or without blocking the inputs for L1). See docs/benchmarks.md, issue 17's
 * seventh pass. */
#define Z_ROWS 8
#define Z_MIN 4

static inline __attribute__((always_inline)) void ztile(const int R, const float *x,
                                                         int64_t ldx, const float *p, int64_t k,
                                                         float *out, const float *pf)
{
    __m512 c[Z_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        c[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        const __m512 w = _mm512_loadu_ps(p + j * 16);
        _mm_prefetch((const char *)(pf + j * 16), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            c[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + j]), w, c[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out + r * 16, c[r]);
}

#define ZTILE(R)                                                                               \
    static void ztile##R(const float *x, int64_t ldx, const float *p, int64_t k, float *out,  \
                         const float *pf)                                                      \
    {                                                                                          \
        ztile(R, x, ldx, p, k, out, pf);                                                       \
    }
ZTILE(4)
ZTILE(5)
ZTILE(6)
ZTILE(7)
ZTILE(8)

typedef void (*ztile_fn)(const float *, int64_t, const float *, int64_t, float *,
                         const float *);
static const ztile_fn ztiles[Z_ROWS + 1] = {NULL,   NULL,   NULL,   NULL,  ztile4,
                                            ztile5, ztile6, ztile7, ztile8};

/* The height of the tile at row i of m >= Z_MIN: as few tiles as Z_ROWS allows, their heights
 * differing by at most one (so none is under Z_MIN). */
static int64_t ztile_rows(int64_t m, int64_t i)
{
    const int64_t tiles = (m + Z_ROWS - 1) / Z_ROWS, base = m / tiles, extra = m % tiles;
    return i < extra * (base + 1) ? base + 1 : base;
}
#define TILE_MAX Z_ROWS
#else
#define TILE_MAX TILE_ROWS
#endif

/* pf: a panel to fetch into L2 on the way, one line per input (the next panel, during the
 * first tile of this one; this one, already there, for the others). */
static void tile(int64_t rows, const float *x, int64_t ldx, const float *p, int64_t k,
                 float *out, const float *pf)
{
    switch (rows) {
    case 1: tile1(x, ldx, p, k, out, pf); break;
    case 2: tile2(x, ldx, p, k, out, pf); break;
    case 3: tile3(x, ldx, p, k, out, pf); break;
    case 4: tile4(x, ldx, p, k, out, pf); break;
    case 5: tile5(x, ldx, p, k, out, pf); break;
    default: tile6(x, ldx, p, k, out, pf); break;
    }
}

void rs_f32_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                   int64_t ldy, int64_t p0, int64_t p1)
{
    const float *data = (const float *)w->data;
    const int64_t panels = (w->n + RS_PANEL - 1) / RS_PANEL;
    float out[TILE_MAX * RS_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = data + p * w->k * RS_PANEL;
        const float *next = p + 1 < panels ? panel + w->k * RS_PANEL : panel;
        const int64_t c0 = p * RS_PANEL;
        const int64_t lanes = w->n - c0 < RS_PANEL ? w->n - c0 : RS_PANEL;
        for (int64_t i = 0; i < m;) {
            const float *pf = i == 0 ? next : panel;
            int64_t rows;
#ifdef __AVX512F__
            if (m >= Z_MIN) {
                rows = ztile_rows(m, i);
                ztiles[rows](x + i * ldx, ldx, panel, w->k, out, pf);
            } else
#endif
            {
                rows = m - i < TILE_ROWS ? m - i : TILE_ROWS;
                tile(rows, x + i * ldx, ldx, panel, w->k, out, pf);
            }
            for (int64_t r = 0; r < rows; r++)
                memcpy(y + (i + r) * ldy + c0, out + r * RS_PANEL, sizeof(float) * (size_t)lanes);
            i += rows;
        }
    }
}

void rs_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
               int64_t ldy, int64_t p0, int64_t p1)
{
    switch (w->format) {
    case RS_INT8: rs_int8_panels(w, x, m, ldx, y, ldy, p0, p1); break;
    case RS_INT4: rs_int4_panels(w, x, m, ldx, y, ldy, p0, p1); break;
    case RS_INT8G: rs_int8g_panels(w, x, m, ldx, y, ldy, p0, p1); break;
    case RS_BF16: rs_bf16_panels(w, x, m, ldx, y, ldy, p0, p1); break;
    default: rs_f32_panels(w, x, m, ldx, y, ldy, p0, p1); break;
    }
    if (w->bias == NULL)
        return;
    const int64_t c0 = p0 * RS_PANEL, c1 = p1 * RS_PANEL < w->n ? p1 * RS_PANEL : w->n;
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = c0; c < c1; c++)
            y[i * ldy + c] += w->bias[c];
}

/* No contraction into FMAs: int4's code * scale + min is rounded after the product, as a
 * dequantized weight is (GGUF's own dequantization, torch's mul then add). */
__attribute__((optimize("fp-contract=off"))) void rs_panel_row(const rs_weight *w, int64_t r,
                                                               float *out)
{
    const int64_t k = w->k, p = r / RS_PANEL, l = r % RS_PANEL, groups = k / RS_INT4_GROUP;
    switch (w->format) {
    case RS_BF16: {
        const uint16_t *d = (const uint16_t *)w->data + p * k * RS_PANEL + l;
        for (int64_t j = 0; j < k; j++) {
            const uint32_t bits = (uint32_t)d[j * RS_PANEL] << 16;
            memcpy(out + j, &bits, sizeof(float));
        }
        break;
    }
    case RS_INT8: {
        const int8_t *d = (const int8_t *)w->data + p * k * RS_PANEL + l;
        const float scale = w->scales[r];
        for (int64_t j = 0; j < k; j++)
            out[j] = (float)d[j * RS_PANEL] * scale;
        break;
    }
    case RS_INT8G: {
        const int8_t *d = (const int8_t *)w->data + p * k * RS_PANEL + l;
        const float *scales = w->scales + p * groups * RS_PANEL + l;
        for (int64_t j = 0; j < k; j++)
            out[j] = (float)d[j * RS_PANEL] * scales[(j / RS_INT4_GROUP) * RS_PANEL];
        break;
    }
    case RS_INT4: {
        const uint8_t *d = (const uint8_t *)w->data + p * (k / 2) * RS_PANEL + l;
        const float *scales = w->scales + p * groups * RS_PANEL + l;
        const float *mins = w->mins + p * groups * RS_PANEL + l;
        for (int64_t j = 0; j < k; j++) {
            const uint8_t byte = d[(j / 2) * RS_PANEL];
            const int code = j & 1 ? byte >> 4 : byte & 15;
            const int64_t g = (j / RS_INT4_GROUP) * RS_PANEL;
            const float scaled = (float)code * scales[g];
            out[j] = scaled + mins[g];
        }
        break;
    }
    default: {
        const float *d = (const float *)w->data + p * k * RS_PANEL + l;
        for (int64_t j = 0; j < k; j++)
            out[j] = d[j * RS_PANEL];
        break;
    }
    }
}

int rs_panel_rows(const rs_weight *w, const int64_t *ids, int64_t n, float *out, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; i++)
        rs_panel_row(w, ids[i], out + i * w->k);
    return 0;
}

void rs_linear_team(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy)
{
    const int64_t panels = (w->n + RS_PANEL - 1) / RS_PANEL;
    for (int64_t i = 0; i < m; i += ROW_BLOCK) {
        const int64_t rows = m - i < ROW_BLOCK ? m - i : ROW_BLOCK;
        /* Rows are independent: no barrier between row blocks, one at the end. */
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++)
            rs_panels(w, x + i * ldx, rows, ldx, y + i * ldy, ldy, p, p + 1);
    }
#pragma omp barrier
}

/* y [m, n] = x [m, k] W^T + bias on `nthreads` threads. Returns 0. */
int rs_linear(const rs_weight *w, const float *x, int64_t m, float *y, int nthreads)
{
#pragma omp parallel num_threads(nthreads)
    rs_linear_team(w, x, m, w->k, y, w->n);
    return 0;
}
