/* The int8, int8g and int4 panel matmuls (layout: panel.h): weight-only, float32 activations.
 *
 * Built with panel_f32.c and decode_step.c into one library (ringserve.gpu.native.panel);
 * AVX2 + FMA. As in the float32 kernel, a tile is a few rows of x against one panel of 16
 * channels, so the codes of one input are widened to float once per tile and multiplied by
 * each row's x broadcast; the tile sizes are instantiated from one always-inline body with a
 * constant row count, which gcc fully unrolls into registers.
 *
 * int8 (tiles of up to 6 rows): the 16 codes of input j are sign-extended (vpmovsxbd, 8 at a
 * time) and converted to float; each row accumulates x[j] * code in float, and the channel's
 * scale multiplies the sum at the end (w = code * scale).
 *
 * int4, 1 to 4 rows (decode): per group of 32 inputs, each row accumulates
 * dot = sum_j x[j] * code_j: one 8-byte load zero-extended to 8 dwords holds 8 channels of
 * inputs 2 j (low nibble, `& 15`) and 2 j + 1 (high nibble, `>> 4`). At the group's end
 * acc += scale * dot + min * sum_j x[j] (w = code * scale + min), the sum of x taken once per
 * row and group for all 16 channels. From 5 rows on, widening the codes in every tile costs
 * more than the FMAs it feeds: there each block of 128 inputs of a panel is dequantized
 * (code * scale + min) once per chunk of up to 48 rows into a float buffer in L1, which
 * float 6-row tiles then read.
 *
 * int8g (int8 with a scale per group of 32 inputs: GGUF's Q8_0 blocks as they are), 1 to 3
 * rows: the int8 tile with its sums taken per group, total += scale * sum; from 4 rows on, the
 * dequantized path of int4 (per-format group dequantizers, `quant_wide`).
 *
 * With AVX-512 the int8 and int4 tiles hold a panel's 16 channels in one zmm register (the
 * same operations per lane: bit-identical results).
 *
 * Few rows need more independent FMA chains than 2 per row to cover the FMA latency (4 cycles,
 * 2 per cycle on Zen 3), so 1- and 2-row tiles accumulate even and odd inputs (int8), or low
 * and high nibbles and even and odd input pairs (int4), apart and add them at the end.
 *
 * Measured with scripts/bench_quant.py on the 2-core AVX2 VM, loaded by other work (load
 * average 3-6), so on 1 thread and its CPU time; 30 distinct weights per SmolLM-135M shape,
 * medians of 7, two runs: at 1 row int8 3.0-4.0x and int4 3.7-4.3x faster than the float32
 * panels, streaming at 76-92% and 68-75% of the rate of torch's .sum() over the float
 * weights (int4 is bound by the widening there); at 8 rows 1.7-2.3x and 1.6-2.0x; at 64 rows
 * (compute bound) int8 0.8-1.0x (its fastest rounds 1.3-1.4x) and int4 1.1-1.3x. With
 * AVX-512 the dequantized path's tiles are 8-row zmm ones: on the AMX Xeon dev VM, int4 over
 * float32 panels at 8 / 32 / 64 rows went from 0.79-1.58x to 1.02-2.09x (gate_up, down, qkv).
 */
#include <immintrin.h>
#include <string.h>

#include "panel.h"

/* Rows per tile: int8 6 (12 accumulators, as the float kernel); int4 4, whose 8 accumulators
 * leave registers for the widened codes (6 spilled). */
#define INT8_ROWS 6
#define INT4_ROWS 4
/* Bytes ahead of the codes being read to prefetch: at 1 row the codes stream from DRAM and
 * the hardware prefetcher alone left int8 ~30% below the float kernel's bandwidth. */
#define PF 2048
/* From this many rows on, int4 panels are dequantized once per chunk of rows (int4_wide). */
#define WIDE_MIN 5
#define INLINE static inline __attribute__((always_inline))

/* Rows for the next tile of at most `most` rows, `left` rows to go: balanced tiles (7 rows
 * as 4 + 3, not 6 + 1), since a 1-row tile of the dequantized int4 path is bound by FMA
 * latency (2 chains). */
INLINE int64_t tile_rows(int64_t left, int64_t most)
{
    const int64_t tiles = (left + most - 1) / most;
    return (left + tiles - 1) / tiles;
}

/* The 8 codes at p, sign-extended and converted to float. */
INLINE __m256 int8_to_ps(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The scaling of an int8 tile's sums: G == 0, one scale per channel over all k inputs
 * (RS_INT8: out = sum * scale); G == RS_INT4_GROUP, one per group of 32 inputs (RS_INT8G:
 * out = sum over groups of scale_g * sum_g; scales [k / 32][16]). A compile-time constant
 * where the tile is inlined. */
#ifdef __AVX512F__
/* int8_tile with the panel's 16 channels in one zmm register (one load, sign extension and
 * conversion per input instead of two, one FMA per row): each lane the same sequence of
 * operations as in the AVX2 tile, so the results are bit-identical to it. */
INLINE void int8_tile_z(const int R, const int G, const float *x, int64_t ldx, const int8_t *p,
                        int64_t k, const float *scales, float *out)
{
    const int S = R == 1 || (R == 2 && G == 0) ? 2 : 1; /* 2 rows grouped: registers */
    const int64_t span = G ? G : k; /* inputs per scale */
    __m512 total[INT8_ROWS];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
        total[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += span) {
        __m512 acc[2][INT8_ROWS];
#pragma GCC unroll 2
        for (int s = 0; s < S; s++)
#pragma GCC unroll 6
            for (int r = 0; r < R; r++)
                acc[s][r] = _mm512_setzero_ps();
        int64_t j = g0;
        for (; j + S <= g0 + span; j += S) {
            if ((j & 3) == 0) /* one prefetch per 64-byte line */
                _mm_prefetch((const char *)(p + j * RS_PANEL + PF), _MM_HINT_T0);
#pragma GCC unroll 2
            for (int s = 0; s < S; s++) {
                const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(p + (j + s) * RS_PANEL))));
#pragma GCC unroll 6
                for (int r = 0; r < R; r++)
                    acc[s][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + j + s]), w,
                                                acc[s][r]);
            }
        }
        for (; j < g0 + span; j++) {
            const __m512 w = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + j * RS_PANEL))));
#pragma GCC unroll 6
            for (int r = 0; r < R; r++)
                acc[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + j]), w, acc[0][r]);
        }
        const __m512 sc = _mm512_loadu_ps(scales + (G ? g0 / G * RS_PANEL : 0));
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512 a = S == 2 ? _mm512_add_ps(acc[0][r], acc[1][r]) : acc[0][r];
            total[r] = G == 0 ? _mm512_mul_ps(a, sc) : _mm512_fmadd_ps(sc, a, total[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out + r * RS_PANEL, total[r]);
}
#endif

/* R rows of x (stride ldx) against one int8 panel: out[r * 16 + l] for every lane l; the
 * scaling G as above. */
INLINE void int8_tile(const int R, const int G, const float *x, int64_t ldx, const int8_t *p,
                      int64_t k, const float *scales, float *out)
{
#ifdef __AVX512F__
    int8_tile_z(R, G, x, ldx, p, k, scales, out);
    return;
#endif
    /* Two accumulator sets (even and odd inputs) where R alone gives too few FMA chains. */
    const int S = R == 1 || (R == 2 && G == 0) ? 2 : 1; /* 2 rows grouped: registers */
    const int64_t span = G ? G : k; /* inputs per scale */
    __m256 total[INT8_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
        total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < k; g0 += span) {
        __m256 acc[2][INT8_ROWS][2];
#pragma GCC unroll 2
        for (int s = 0; s < S; s++)
#pragma GCC unroll 6
            for (int r = 0; r < R; r++)
                acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
        int64_t j = g0;
        for (; j + S <= g0 + span; j += S) {
            if ((j & 3) == 0) /* one prefetch per 64-byte line */
                _mm_prefetch((const char *)(p + j * RS_PANEL + PF), _MM_HINT_T0);
#pragma GCC unroll 2
            for (int s = 0; s < S; s++) {
                const __m256 w0 = int8_to_ps(p + (j + s) * RS_PANEL);
                const __m256 w1 = int8_to_ps(p + (j + s) * RS_PANEL + 8);
#pragma GCC unroll 6
                for (int r = 0; r < R; r++) {
                    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + j + s);
                    acc[s][r][0] = _mm256_fmadd_ps(xb, w0, acc[s][r][0]);
                    acc[s][r][1] = _mm256_fmadd_ps(xb, w1, acc[s][r][1]);
                }
            }
        }
        for (; j < g0 + span; j++) {
            const __m256 w0 = int8_to_ps(p + j * RS_PANEL);
            const __m256 w1 = int8_to_ps(p + j * RS_PANEL + 8);
#pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                const __m256 xb = _mm256_broadcast_ss(x + r * ldx + j);
                acc[0][r][0] = _mm256_fmadd_ps(xb, w0, acc[0][r][0]);
                acc[0][r][1] = _mm256_fmadd_ps(xb, w1, acc[0][r][1]);
            }
        }
        const float *sg = scales + (G ? g0 / G * RS_PANEL : 0);
        const __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m256 a0 = acc[0][r][0], a1 = acc[0][r][1];
            if (S == 2) {
                a0 = _mm256_add_ps(a0, acc[1][r][0]);
                a1 = _mm256_add_ps(a1, acc[1][r][1]);
            }
            if (G == 0) {
                total[r][0] = _mm256_mul_ps(a0, s0);
                total[r][1] = _mm256_mul_ps(a1, s1);
            } else {
                total[r][0] = _mm256_fmadd_ps(s0, a0, total[r][0]);
                total[r][1] = _mm256_fmadd_ps(s1, a1, total[r][1]);
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * RS_PANEL, total[r][0]);
        _mm256_storeu_ps(out + r * RS_PANEL + 8, total[r][1]);
    }
}

#define INT8_TILE(R)                                                                        \
    static void int8_tile##R(const float *x, int64_t ldx, const int8_t *p, int64_t k,      \
                             const float *scales, float *out)                              \
    {                                                                                       \
        int8_tile(R, 0, x, ldx, p, k, scales, out);                                         \
    }
INT8_TILE(1)
INT8_TILE(2)
INT8_TILE(3)
INT8_TILE(4)
INT8_TILE(5)
INT8_TILE(6)

typedef void (*int8_tile_fn)(const float *, int64_t, const int8_t *, int64_t, const float *,
                             float *);
static const int8_tile_fn int8_tiles[INT8_ROWS + 1] = {
    NULL, int8_tile1, int8_tile2, int8_tile3, int8_tile4, int8_tile5, int8_tile6,
};

void rs_int8_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy, int64_t p0, int64_t p1)
{
    const int8_t *codes = (const int8_t *)w->data;
    float out[INT8_ROWS * RS_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const int8_t *panel = codes + p * w->k * RS_PANEL;
        const int64_t c0 = p * RS_PANEL;
        const int64_t lanes = w->n - c0 < RS_PANEL ? w->n - c0 : RS_PANEL;
        for (int64_t i = 0; i < m; i += INT8_ROWS) {
            /* Greedy tiles: 1- and 2-row tiles keep two accumulator sets, not latency bound. */
            const int64_t rows = m - i < INT8_ROWS ? m - i : INT8_ROWS;
            int8_tiles[rows](x + i * ldx, ldx, panel, w->k, w->scales + c0, out);
            for (int64_t r = 0; r < rows; r++)
                memcpy(y + (i + r) * ldy + c0, out + r * RS_PANEL, sizeof(float) * (size_t)lanes);
        }
    }
}

/* sum x[0..31] in every lane. */
INLINE __m256 sum32(const float *x)
{
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
    s = _mm256_add_ps(s, _mm256_permute2f128_ps(s, s, 1));
    s = _mm256_add_ps(s, _mm256_permute_ps(s, 0x4E));
    return _mm256_add_ps(s, _mm256_permute_ps(s, 0xB1));
}

#ifdef __AVX512F__
/* int4_tile with the panel's 16 channels in one zmm register: half the widening
 * instructions (one load and zero-extension of 16 codes, one mask, one shift, two
 * conversions per input pair) and half the FMAs, each lane the same sequence of operations as
 * in the AVX2 tile, so the results are bit-identical to it. Decode at batch 1 is bound by the
 * widening (the module docstring). */
INLINE void int4_tile_z(const int R, const float *x, int64_t ldx, const uint8_t *p, int64_t k,
                        const float *scales, const float *mins, float *out)
{
    const int N = R <= 2 ? 2 : 1, U = R == 1 ? 2 : 1;
    const __m512i low = _mm512_set1_epi32(15);
    __m512 o[INT4_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        o[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / RS_INT4_GROUP; g++) {
        const uint8_t *pg = p + g * (RS_INT4_GROUP / 2) * RS_PANEL;
        const float *xg = x + g * RS_INT4_GROUP;
        __m512 dot[4][INT4_ROWS];
#pragma GCC unroll 4
        for (int s = 0; s < N * U; s++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                dot[s][r] = _mm512_setzero_ps();
        for (int j = 0; j < RS_INT4_GROUP / 2; j += U) {
            if (j % 4 == 0) /* one prefetch per 64-byte line */
                _mm_prefetch((const char *)(pg + j * RS_PANEL + PF), _MM_HINT_T0);
#pragma GCC unroll 2
            for (int u = 0; u < U; u++) {
                const __m512i d = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(pg + (j + u) * RS_PANEL)));
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, low));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
                const int sl = u * N, sh = u * N + N - 1;
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    dot[sl][r] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + 2 * (j + u)]), lo,
                                                 dot[sl][r]);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    dot[sh][r] = _mm512_fmadd_ps(
                        _mm512_set1_ps(xg[r * ldx + 2 * (j + u) + 1]), hi, dot[sh][r]);
            }
        }
        const __m512 sc = _mm512_loadu_ps(scales + g * RS_PANEL);
        const __m512 mn = _mm512_loadu_ps(mins + g * RS_PANEL);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 a = dot[0][r];
#pragma GCC unroll 4
            for (int s = 1; s < N * U; s++)
                a = _mm512_add_ps(a, dot[s][r]);
            const __m512 sx = _mm512_set1_ps(_mm256_cvtss_f32(sum32(xg + r * ldx)));
            o[r] = _mm512_fmadd_ps(sc, a, _mm512_fmadd_ps(mn, sx, o[r]));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(out + r * RS_PANEL, o[r]);
}
#endif

/* R rows of x against one int4 panel (codes p, the panel's scales and mins [k / 32][16]). */
INLINE void int4_tile(const int R, const float *x, int64_t ldx, const uint8_t *p, int64_t k,
                      const float *scales, const float *mins, float *out)
{
#ifdef __AVX512F__
    int4_tile_z(R, x, ldx, p, k, scales, mins, out);
    return;
#endif
    /* Accumulator sets: N (low and high nibbles apart) times U (even and odd input pairs
     * apart), so that few rows still have 8 independent FMA chains. */
    const int N = R <= 2 ? 2 : 1, U = R == 1 ? 2 : 1;
    const __m256i low = _mm256_set1_epi32(15);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + r * RS_PANEL, _mm256_setzero_ps());
        _mm256_storeu_ps(out + r * RS_PANEL + 8, _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < k / RS_INT4_GROUP; g++) {
        const uint8_t *pg = p + g * (RS_INT4_GROUP / 2) * RS_PANEL;
        const float *xg = x + g * RS_INT4_GROUP;
        __m256 dot[4][INT4_ROWS][2];
#pragma GCC unroll 4
        for (int s = 0; s < N * U; s++)
#pragma GCC unroll 6
            for (int r = 0; r < R; r++)
                dot[s][r][0] = dot[s][r][1] = _mm256_setzero_ps();
        for (int j = 0; j < RS_INT4_GROUP / 2; j += U) {
            if (j % 4 == 0) /* one prefetch per 64-byte line */
                _mm_prefetch((const char *)(pg + j * RS_PANEL + PF), _MM_HINT_T0);
#pragma GCC unroll 2
            for (int u = 0; u < U; u++) {
                const uint8_t *b = pg + (j + u) * RS_PANEL;
                const __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
                const __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
                const __m256 lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(d0, low));
                const __m256 lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(d1, low));
                const int sl = u * N, sh = u * N + N - 1;
#pragma GCC unroll 6
                for (int r = 0; r < R; r++) {
                    const __m256 xb = _mm256_broadcast_ss(xg + r * ldx + 2 * (j + u));
                    dot[sl][r][0] = _mm256_fmadd_ps(xb, lo0, dot[sl][r][0]);
                    dot[sl][r][1] = _mm256_fmadd_ps(xb, lo1, dot[sl][r][1]);
                }
                const __m256 hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d0, 4));
                const __m256 hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d1, 4));
#pragma GCC unroll 6
                for (int r = 0; r < R; r++) {
                    const __m256 xb = _mm256_broadcast_ss(xg + r * ldx + 2 * (j + u) + 1);
                    dot[sh][r][0] = _mm256_fmadd_ps(xb, hi0, dot[sh][r][0]);
                    dot[sh][r][1] = _mm256_fmadd_ps(xb, hi1, dot[sh][r][1]);
                }
            }
        }
        const float *sg = scales + g * RS_PANEL, *mg = mins + g * RS_PANEL;
        const __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);
        const __m256 m0 = _mm256_loadu_ps(mg), m1 = _mm256_loadu_ps(mg + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m256 a0 = dot[0][r][0], a1 = dot[0][r][1];
#pragma GCC unroll 4
            for (int s = 1; s < N * U; s++) {
                a0 = _mm256_add_ps(a0, dot[s][r][0]);
                a1 = _mm256_add_ps(a1, dot[s][r][1]);
            }
            const __m256 sx = sum32(xg + r * ldx);
            float *o = out + r * RS_PANEL;
            __m256 o0 = _mm256_fmadd_ps(m0, sx, _mm256_loadu_ps(o));
            __m256 o1 = _mm256_fmadd_ps(m1, sx, _mm256_loadu_ps(o + 8));
            _mm256_storeu_ps(o, _mm256_fmadd_ps(s0, a0, o0));
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(s1, a1, o1));
        }
    }
}

#define INT4_TILE(R)                                                                        \
    static void int4_tile##R(const float *x, int64_t ldx, const uint8_t *p, int64_t k,     \
                             const float *scales, const float *mins, float *out)           \
    {                                                                                       \
        int4_tile(R, x, ldx, p, k, scales, mins, out);                                      \
    }
INT4_TILE(1)
INT4_TILE(2)
INT4_TILE(3)
INT4_TILE(4)

typedef void (*int4_tile_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *,
                             const float *, float *);
static const int4_tile_fn int4_tiles[INT4_ROWS + 1] = {
    NULL, int4_tile1, int4_tile2, int4_tile3, int4_tile4,
};

/* Many rows: a block of WIDE_GROUPS groups is dequantized once per chunk of up to CHUNK_ROWS
 * rows into fb[inputs][16] (float, in L1), which tiles of up to WIDE_ROWS rows then read as
 * the float kernel reads its panel, adding into acc[row][16] (the chunk's sums over the
 * blocks so far): 6-row ymm tiles with AVX2; 8-row zmm tiles with AVX-512, as the float
 * kernel's (the same FMAs per lane in the same order, so both builds give equal results). */
#define CHUNK_ROWS 48
#define WIDE_GROUPS 4
#define WIDE_K (WIDE_GROUPS * RS_INT4_GROUP)

#ifdef __AVX512F__
#define WIDE_ROWS 8

/* R rows of x (kb inputs) against fb: acc[r] += x[r] . fb. */
INLINE void wide_tile(const int R, const float *x, int64_t ldx, const float *fb, int64_t kb,
                      float *acc)
{
    __m512 c[WIDE_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        c[r] = _mm512_loadu_ps(acc + r * RS_PANEL);
#pragma GCC unroll 4
    for (int64_t j = 0; j < kb; j++) {
        const __m512 w = _mm512_load_ps(fb + j * RS_PANEL);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            c[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + j]), w, c[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(acc + r * RS_PANEL, c[r]);
}
#else
#define WIDE_ROWS 6

/* R rows of x (kb inputs) against fb: acc[r] += x[r] . fb. */
INLINE void wide_tile(const int R, const float *x, int64_t ldx, const float *fb, int64_t kb,
                      float *acc)
{
    __m256 c[WIDE_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        c[r][0] = _mm256_loadu_ps(acc + r * RS_PANEL);
        c[r][1] = _mm256_loadu_ps(acc + r * RS_PANEL + 8);
    }
#pragma GCC unroll 4
    for (int64_t j = 0; j < kb; j++) {
        const __m256 w0 = _mm256_load_ps(fb + j * RS_PANEL);
        const __m256 w1 = _mm256_load_ps(fb + j * RS_PANEL + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + j);
            c[r][0] = _mm256_fmadd_ps(xb, w0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(xb, w1, c[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc + r * RS_PANEL, c[r][0]);
        _mm256_storeu_ps(acc + r * RS_PANEL + 8, c[r][1]);
    }
}
#endif

#define WIDE_TILE(R)                                                                        \
    static void wide_tile##R(const float *x, int64_t ldx, const float *fb, int64_t kb,     \
                             float *acc)                                                   \
    {                                                                                       \
        wide_tile(R, x, ldx, fb, kb, acc);                                                  \
    }
WIDE_TILE(1)
WIDE_TILE(2)
WIDE_TILE(3)
WIDE_TILE(4)
WIDE_TILE(5)
WIDE_TILE(6)
#if WIDE_ROWS == 8
WIDE_TILE(7)
WIDE_TILE(8)
#endif

typedef void (*wide_tile_fn)(const float *, int64_t, const float *, int64_t, float *);
static const wide_tile_fn wide_tiles[WIDE_ROWS + 1] = {
    NULL, wide_tile1, wide_tile2, wide_tile3, wide_tile4, wide_tile5, wide_tile6,
#if WIDE_ROWS == 8
    wide_tile7, wide_tile8,
#endif
};

/* One group's 32 x 16 weights (codes at pg, scales s, mins mn) as floats fb[j][16]. */
INLINE void dequantize_group(const uint8_t *pg, const float *s, const float *mn, float *fb)
{
    const __m256i low = _mm256_set1_epi32(15);
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    const __m256 m0 = _mm256_loadu_ps(mn), m1 = _mm256_loadu_ps(mn + 8);
    for (int j = 0; j < RS_INT4_GROUP / 2; j++) {
        if (j % 4 == 0)
            _mm_prefetch((const char *)(pg + j * RS_PANEL + PF), _MM_HINT_T0);
        const uint8_t *b = pg + j * RS_PANEL;
        const __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
        const __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
        float *f = fb + 2 * j * RS_PANEL; /* inputs 2 j (low nibbles) and 2 j + 1 (high) */
        const __m256 lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(d0, low));
        const __m256 lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(d1, low));
        const __m256 hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d0, 4));
        const __m256 hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(d1, 4));
        _mm256_store_ps(f, _mm256_fmadd_ps(lo0, s0, m0));
        _mm256_store_ps(f + 8, _mm256_fmadd_ps(lo1, s1, m1));
        _mm256_store_ps(f + 16, _mm256_fmadd_ps(hi0, s0, m0));
        _mm256_store_ps(f + 24, _mm256_fmadd_ps(hi1, s1, m1));
    }
}

static void int4_group(const void *codes, const float *s, const float *mn, float *fb)
{
    dequantize_group((const uint8_t *)codes, s, mn, fb);
}

/* One group's 32 x 16 int8 codes at pg times their scales s as floats fb[j][16]. */
static void int8g_group(const void *codes, const float *s, const float *mn, float *fb)
{
    (void)mn;
    const int8_t *pg = (const int8_t *)codes;
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    for (int j = 0; j < RS_INT4_GROUP; j++) {
        if (j % 4 == 0)
            _mm_prefetch((const char *)(pg + j * RS_PANEL + PF), _MM_HINT_T0);
        _mm256_store_ps(fb + j * RS_PANEL, _mm256_mul_ps(int8_to_ps(pg + j * RS_PANEL), s0));
        _mm256_store_ps(fb + j * RS_PANEL + 8,
                        _mm256_mul_ps(int8_to_ps(pg + j * RS_PANEL + 8), s1));
    }
}

/* A group's codes as floats: `group` bytes of codes per group of 32 inputs of a panel. */
typedef struct {
    void (*fn)(const void *codes, const float *s, const float *mn, float *fb);
    int64_t group;
} group_dequantizer;

/* Up to CHUNK_ROWS rows of x against one int4 or int8g panel (its groups dequantized by
 * deq), channels c0 .. c0 + lanes of y. */
static void quant_wide(const rs_weight *w, group_dequantizer deq, const uint8_t *panel,
                       const float *scales, const float *mins, const float *x, int64_t rows,
                       int64_t ldx, float *y, int64_t ldy, int64_t c0, int64_t lanes)
{
    float fb[WIDE_K * RS_PANEL] __attribute__((aligned(64)));
    float acc[CHUNK_ROWS * RS_PANEL];
    memset(acc, 0, sizeof(float) * (size_t)(rows * RS_PANEL));
    const int64_t groups = w->k / RS_INT4_GROUP;
    for (int64_t g0 = 0; g0 < groups; g0 += WIDE_GROUPS) {
        const int64_t gb = groups - g0 < WIDE_GROUPS ? groups - g0 : WIDE_GROUPS;
        for (int64_t g = 0; g < gb; g++)
            deq.fn(panel + (g0 + g) * deq.group, scales + (g0 + g) * RS_PANEL,
                   mins == NULL ? NULL : mins + (g0 + g) * RS_PANEL,
                   fb + g * RS_INT4_GROUP * RS_PANEL);
        const float *xb = x + g0 * RS_INT4_GROUP;
        for (int64_t i = 0, r; i < rows; i += r) {
            r = tile_rows(rows - i, WIDE_ROWS);
            wide_tiles[r](xb + i * ldx, ldx, fb, gb * RS_INT4_GROUP, acc + i * RS_PANEL);
        }
    }
    for (int64_t r = 0; r < rows; r++)
        memcpy(y + r * ldy + c0, acc + r * RS_PANEL, sizeof(float) * (size_t)lanes);
}

void rs_int4_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                    int64_t ldy, int64_t p0, int64_t p1)
{
    const uint8_t *codes = (const uint8_t *)w->data;
    const int64_t groups = w->k / RS_INT4_GROUP;
    float out[INT4_ROWS * RS_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = codes + p * (w->k / 2) * RS_PANEL;
        const float *scales = w->scales + p * groups * RS_PANEL;
        const float *mins = w->mins + p * groups * RS_PANEL;
        const int64_t c0 = p * RS_PANEL;
        const int64_t lanes = w->n - c0 < RS_PANEL ? w->n - c0 : RS_PANEL;
        if (m >= WIDE_MIN) {
            const group_dequantizer deq = {int4_group, (RS_INT4_GROUP / 2) * RS_PANEL};
            for (int64_t i = 0; i < m; i += CHUNK_ROWS)
                quant_wide(w, deq, panel, scales, mins, x + i * ldx,
                           m - i < CHUNK_ROWS ? m - i : CHUNK_ROWS, ldx, y + i * ldy, ldy, c0,
                           lanes);
            continue;
        }
        for (int64_t i = 0; i < m; i += INT4_ROWS) {
            const int64_t rows = m - i < INT4_ROWS ? m - i : INT4_ROWS;
            int4_tiles[rows](x + i * ldx, ldx, panel, w->k, scales, mins, out);
            for (int64_t r = 0; r < rows; r++)
                memcpy(y + (i + r) * ldy + c0, out + r * RS_PANEL, sizeof(float) * (size_t)lanes);
        }
    }
}

/* int8g (GGUF's Q8_0 kept as it is; panel.h's RS_INT8G): the int8 tiles with a scale per
 * group of 32 inputs, for at most INT8G_ROWS rows (sums and totals: 4 registers a row with
 * AVX2); more rows take the dequantized path (quant_wide). */
#define INT8G_ROWS 3

#define INT8G_TILE(R)                                                                       \
    static void int8g_tile##R(const float *x, int64_t ldx, const int8_t *p, int64_t k,     \
                              const float *scales, float *out)                             \
    {                                                                                       \
        int8_tile(R, RS_INT4_GROUP, x, ldx, p, k, scales, out);                             \
    }
INT8G_TILE(1)
INT8G_TILE(2)
INT8G_TILE(3)

static const int8_tile_fn int8g_tiles[INT8G_ROWS + 1] = {NULL, int8g_tile1, int8g_tile2,
                                                         int8g_tile3};

void rs_int8g_panels(const rs_weight *w, const float *x, int64_t m, int64_t ldx, float *y,
                     int64_t ldy, int64_t p0, int64_t p1)
{
    const int8_t *codes = (const int8_t *)w->data;
    const int64_t groups = w->k / RS_INT4_GROUP;
    float out[INT8G_ROWS * RS_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const int8_t *panel = codes + p * w->k * RS_PANEL;
        const float *scales = w->scales + p * groups * RS_PANEL;
        const int64_t c0 = p * RS_PANEL;
        const int64_t lanes = w->n - c0 < RS_PANEL ? w->n - c0 : RS_PANEL;
        if (m > INT8G_ROWS) {
            const group_dequantizer deq = {int8g_group, RS_INT4_GROUP * RS_PANEL};
            for (int64_t i = 0; i < m; i += CHUNK_ROWS)
                quant_wide(w, deq, (const uint8_t *)panel, scales, NULL, x + i * ldx,
                           m - i < CHUNK_ROWS ? m - i : CHUNK_ROWS, ldx, y + i * ldy, ldy, c0,
                           lanes);
            continue;
        }
        const int64_t rows = m;
        if (rows == 0)
            continue;
        int8g_tiles[rows](x, ldx, panel, w->k, scales, out);
        for (int64_t r = 0; r < rows; r++)
            memcpy(y + r * ldy + c0, out + r * RS_PANEL, sizeof(float) * (size_t)lanes);
    }
}
