/* The bf16 panel matmul (layout: panel.h, RS_BF16): weights kept as the checkpoint's bf16,
 * activations and accumulation float32.
 *
 * A bf16 value is the top half of a float32, so widening is a zero-extend and a 16-bit shift
 * (exact): each 16-channel row of the panel is 32 bytes read and widened in registers, never
 * a float32 copy in memory. Decode reads half the bytes of the float32 panels, which is what
 * sets its speed (a memory-bound step); the products are those of float32 arithmetic on the
 * bf16 weights, so a bf16 checkpoint served this way gives what a float32 model loaded from
 * it gives, up to float32 rounding order (more precise than bf16 activations would be).
 *
 * Tiles as panel_f32.c: up to TILE rows of x against one panel, one accumulator (16 channels)
 * per row, inputs in order; 1 row splits its inputs into even and odd sums (two FMA chains)
 * and adds them at the end. The AVX-512 build holds a row's 16 channels in one zmm, the AVX2
 * build in two ymm; the operations per channel are the same, so both builds give equal
 * results bit for bit (tests/gpu/test_gpu_linear.py builds the AVX2 one on AVX-512 hosts).
 *
 * AVX512-BF16's vdpbf16ps is not used: it multiplies bf16 by bf16, so the activations would
 * be rounded to bf16 too, and decode is bound by the weight bytes, not the multiplies; the
 * many-row shapes of prefill go to torch's GEMM (ringserve.gpu.native.panel, MANY_ROWS).
 */
#include <immintrin.h>
#include <string.h>

#include "panel.h"

#ifdef __AVX512F__
#define TILE 8
typedef __m512 acc_t;

static inline __attribute__((always_inline)) acc_t widen(const uint16_t *p)
{
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __attribute__((always_inline)) acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) acc_t fma_x(float x, acc_t w, acc_t c)
{
    return _mm512_fmadd_ps(_mm512_set1_ps(x), w, c);
}
static inline __attribute__((always_inline)) acc_t acc_add(acc_t a, acc_t b)
{
    return _mm512_add_ps(a, b);
}
static inline __attribute__((always_inline)) void acc_store(float *out, acc_t c)
{
    _mm512_storeu_ps(out, c);
}
#else
#define TILE 6
typedef struct {
    __m256 lo, hi;
} acc_t;

static inline __attribute__((always_inline)) acc_t widen(const uint16_t *p)
{
    const __m128i a = _mm_loadu_si128((const __m128i *)p);
    const __m128i b = _mm_loadu_si128((const __m128i *)(p + 8));
    acc_t w;
    w.lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
    w.hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    return w;
}
static inline __attribute__((always_inline)) acc_t acc_zero(void)
{
    acc_t c = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    return c;
}
static inline __attribute__((always_inline)) acc_t fma_x(float x, acc_t w, acc_t c)
{
    const __m256 xb = _mm256_set1_ps(x);
    c.lo = _mm256_fmadd_ps(xb, w.lo, c.lo);
    c.hi = _mm256_fmadd_ps(xb, w.hi, c.hi);
    return c;
}
static inline __attribute__((always_inline)) acc_t acc_add(acc_t a, acc_t b)
{
    a.lo = _mm256_add_ps(a.lo, b.lo);
    a.hi = _mm256_add_ps(a.hi, b.hi);
    return a;
}
static inline __attribute__((always_inline)) void acc_store(float *out, acc_t c)
{
    _mm256_storeu_ps(out, c.lo);
    _mm256_storeu_ps(out + 8, c.hi);
}
#endif

/* One row: even and odd inputs in two chains, so the FMA latency hides behind the loads; the
 * next panel is fetched into L2 on the way (one 64-byte line per two inputs). */
static void row1(const float *x, const uint16_t *p, int64_t k, float *out, const uint16_t *pf)
{
    acc_t even = acc_zero(), odd = acc_zero();
    int64_t j = 0;
    for (; j + 2 <= k; j += 2) {
        _mm_prefetch((const char *)(pf + j * RS_PANEL), _MM_HINT_T1);
        even = fma_x(x[j], widen(p + j * RS_PANEL), even);
        odd = fma_x(x[j + 1], widen(p + (j + 1) * RS_PANEL), odd);
    }
    if (j < k)
        even = fma_x(x[j], widen(p + j * RS_PANEL), even);
    acc_store(out, acc_add(even, odd));
}

/* R rows (2 <= R <= TILE): the panel's row j widened once, used by every row of x. pf: a
 * panel to fetch into L2 on the way (the next one during the first tile of this one). */
static inline __attribute__((always_inline)) void tile(const int R, const float *x,
                                                        int64_t ldx, const uint16_t *p,
                                                        int64_t k, float *out,
                                                        const uint16_t *pf)
{
    acc_t c[TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        c[r] = acc_zero();
    for (int64_t j = 0; j < k; j++) {
        const acc_t w = widen(p + j * RS_PANEL);
        if ((j & 1) == 0) /* 64 bytes: one line per two inputs */
            _mm_prefetch((const char *)(pf + j * RS_PANEL), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            c[r] = fma_x(x[r * ldx + j], w, c[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        acc_store(out + r * RS_PANEL, c[r]);
}

#define TILE_FN(R)                                                                             \
    static void tile##R(const float *x, int64_t ldx, const uint16_t *p, int64_t k, float *out, \
                        const uint16_t *pf)                                                    \
    {                                                                                          \
        tile(R, x, ldx, p, k, out, pf);                                                        \
    }
TILE_FN(2)
TILE_FN(3)
TILE_FN(4)
TILE_FN(5)
TILE_FN(6)
#if TILE == 8
TILE_FN(7)
TILE_FN(8)
#endif

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, int64_t, float *,
                        const uint16_t *);
static const tile_fn tiles[TILE + 1] = {NULL,   NULL,   tile2, tile3, tile4, tile5, tile6,
#if TILE == 8
                                        tile7, tile8
#endif
};

/* The height of the tile at row i of m rows: as few tiles as TILE allows, their heights
 * differing by at most one. */
static int64_t tile_rows(int64_t m, int64_t i)
{
    const int64_t count = (m + TILE - 1) / TILE, base = m / count, extra = m % count;
    return i < extra * (base + 1) ? base + 1 : base;
}

void rs_bf16_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy, int64_t p0, int64_t p1)
{
    const uint16_t *data = (const uint16_t *)w->data;
    const int64_t panels = (w->n + RS_PANEL - 1) / RS_PANEL;
    float out[TILE * RS_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *panel = data + p * w->k * RS_PANEL;
        const uint16_t *next = p + 1 < panels ? panel + w->k * RS_PANEL : panel;
        const int64_t c0 = p * RS_PANEL;
        const int64_t lanes = w->n - c0 < RS_PANEL ? w->n - c0 : RS_PANEL;
        for (int64_t i = 0; i < m;) {
            const int64_t rows = m == 1 ? 1 : tile_rows(m, i);
            if (rows == 1)
                row1(x + i * ldx, panel, w->k, out, next);
            else
                tiles[rows](x + i * ldx, ldx, panel, w->k, out, i == 0 ? next : panel);
            for (int64_t r = 0; r < rows; r++)
                memcpy(y + (i + r) * ldy + c0, out + r * RS_PANEL, sizeof(float) * (size_t)lanes);
            i += rows;
        }
    }
}
