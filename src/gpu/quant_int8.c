/* y = x W^T * scale for int8 weights read as stored (ringserve.gpu.quant's int8 kernel).
 *
 * Built at run time by ringserve.gpu.quant_native (cc -O3 -march=native -fopenmp) and called
 * through ctypes. torch's `_weight_int8pack_mm` is vectorized for AVX-512 only; elsewhere it
 * runs slower than the float32 GEMM, which throws away the point of reading 4x fewer bytes.
 *
 * x [m, k] float32, w [n, k] int8 (row-major, symmetric codes), scales [n] float32, y [m, n].
 * Output channels are split into tiles of TILE rows over the threads; a tile's codes are
 * widened to float once, into a per-thread buffer that stays in cache, and then every row of
 * x is dotted with its TILE rows four at a time (each x element loaded once per four rows).
 * Returns 0, or -1 when a thread's buffer could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>

#define TILE 16

int ringserve_int8_linear_f32(const float *x, const int8_t *w, const float *scales, float *y,
                              int64_t m, int64_t n, int64_t k, int nthreads)
{
    int failed = 0;
    const int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *wf = malloc(sizeof(float) * TILE * (size_t)k);
        if (wf == NULL)
            failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (wf == NULL)
                continue;
            const int64_t n0 = t * TILE;
            const int64_t rows = n - n0 < TILE ? n - n0 : TILE;
            for (int64_t r = 0; r < rows; r++) {
                const int8_t *src = w + (n0 + r) * k;
                float *dst = wf + r * k;
#pragma omp simd
                for (int64_t i = 0; i < k; i++)
                    dst[i] = (float)src[i];
            }
            for (int64_t row = 0; row < m; row++) {
                const float *xr = x + row * k;
                float *yr = y + row * n + n0;
                int64_t r = 0;
                for (; r + 4 <= rows; r += 4) {
                    const float *w0 = wf + r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
                    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                    for (int64_t i = 0; i < k; i++) {
                        const float xi = xr[i];
                        a0 += xi * w0[i];
                        a1 += xi * w1[i];
                        a2 += xi * w2[i];
                        a3 += xi * w3[i];
                    }
                    yr[r] = a0 * scales[n0 + r];
                    yr[r + 1] = a1 * scales[n0 + r + 1];
                    yr[r + 2] = a2 * scales[n0 + r + 2];
                    yr[r + 3] = a3 * scales[n0 + r + 3];
                }
                for (; r < rows; r++) {
                    const float *wr = wf + r * k;
                    float a = 0.0f;
#pragma omp simd reduction(+ : a)
                    for (int64_t i = 0; i < k; i++)
                        a += xr[i] * wr[i];
                    yr[r] = a * scales[n0 + r];
                }
            }
        }
        free(wf);
    }
    return failed ? -1 : 0;
}
