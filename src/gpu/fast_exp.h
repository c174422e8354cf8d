/* e^x written so that loops over it vectorize (glibc's expf is a scalar call), shared by the
 * attention softmax (attention/cpu_decode.c) and the fused decode step's SiLU (decode_step.c).
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

#endif
