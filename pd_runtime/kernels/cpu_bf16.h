/* bf16 helpers shared by the native CPU kernels (see pd_runtime/kernels/native.py). */
#ifndef PD_RUNTIME_CPU_BF16_H
#define PD_RUNTIME_CPU_BF16_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);  /* NaN */
    x.u += 0x7fffu + ((x.u >> 16) & 1u);
    return (uint16_t)(x.u >> 16);
}

/* exp(x) for x <= 0 in plain float arithmetic, so loops over it vectorize: x = n ln2 + r with
 * |r| <= ln2 / 2 (two-part ln2), exp(r) by its degree-7 Taylor polynomial (relative error
 * below 2e-7), 2^n from the exponent bits. Inputs below -87 give exp(-87) ~ 1.6e-38. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } two_n;
    two_n.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * two_n.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_nonpositive on 16 lanes: the same reduction and polynomial, 2^n by vscalefps. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
