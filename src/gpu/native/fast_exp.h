/* e^x written so that loops over it vectorize (glibc's expf is a scalar call), shared by the
 * attention softmax (cpu_decode.c) and the fused decode step's SiLU (decode_step.c).
 *
 * Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, times 2^n
 * built in the exponent bits; relative error about 1e-7. x is clamped to [-87, 88] (below,
 * about 1.6e-38: a weight of zero in float32 sums; above, about 1.65e38); a NaN stays NaN, so a
 * poisoned row still reaches the sampler's NaN check. */
#ifndef RINGSERVE_FAST_EXP_H
#define RINGSERVE_FAST_EXP_H

#include <math.h>
#include <stdint.h>

static inline float rs_exp(float x)
{
    const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* rs_exp for 8 lanes, written with AVX2 intrinsics: gcc keeps the scalar one out of vector
 * loops (its clamps are comparisons that may trap under the default -ftrapping-math), and a
 * scalar e^x per element was a quarter of the decode attention's time. Same steps, fused
 * multiply-adds; a NaN lane stays NaN. */
static inline __m256 rs_exp8(__m256 x)
{
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)),
                                    _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* silu(g) * u = g / (1 + e^-g) * u for 8 lanes. */
static inline __m256 rs_silu_mul8(__m256 g, __m256 u)
{
    const __m256 e = rs_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
#endif

#endif
