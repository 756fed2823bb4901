/* 8-lane float32 vectors with one fixed arithmetic per build (AVX2 + FMA intrinsics, or the
 * same operations lane by lane), for the batch-invariant kernels: a result never depends on
 * whether a value went through a vector or a remainder loop, because there is no remainder
 * loop. Include after `#pragma GCC optimize("fp-contract=off")`: multiplies and adds are fused
 * only where vf8_fma says so. */
#ifndef PD_RUNTIME_CPU_VF8_H
#define PD_RUNTIME_CPU_VF8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 vf8;
static inline vf8 vf8_load(const float *p) { return _mm256_loadu_ps(p); }
/* 8 bf16 -> 8 float32, exactly */
static inline vf8 vf8_load_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline void vf8_store(float *p, vf8 x) { _mm256_storeu_ps(p, x); }
static inline vf8 vf8_zero(void) { return _mm256_setzero_ps(); }
static inline vf8 vf8_set1(float x) { return _mm256_set1_ps(x); }
static inline vf8 vf8_fma(vf8 a, vf8 b, vf8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf8 vf8_add(vf8 a, vf8 b) { return _mm256_add_ps(a, b); }
static inline vf8 vf8_sub(vf8 a, vf8 b) { return _mm256_sub_ps(a, b); }
static inline vf8 vf8_mul(vf8 a, vf8 b) { return _mm256_mul_ps(a, b); }
static inline vf8 vf8_max(vf8 a, vf8 b) { return _mm256_max_ps(a, b); }
static inline vf8 vf8_min(vf8 a, vf8 b) { return _mm256_min_ps(a, b); }
static inline vf8 vf8_div(vf8 a, vf8 b) { return _mm256_div_ps(a, b); }
/* lanes where x >= 0 get a, the others b */
static inline vf8 vf8_if_nonnegative(vf8 x, vf8 a, vf8 b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
static inline vf8 vf8_floor(vf8 a) { return _mm256_floor_ps(a); }
/* lanes below `live` keep a, the others get b */
static inline vf8 vf8_keep(vf8 a, vf8 b, int live) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane)));
}
static inline vf8 vf8_pow2(vf8 n) {  /* 2^n for integral n in [-126, 127] */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
/* tree8 of 8 vectors at once, out[k] = tree8(a[k]): the same pairs as the scalar tree, the
 * additions commute, so each lane's bits are the scalar tree's */
static inline vf8 vf8_tree8x8(const vf8 *a) {
    vf8 x[4];
    for (int i = 0; i < 4; i++)  /* lane l of a[k]'s half: a[k][l] + a[k][l + 4] */
        x[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    vf8 y[2];
    for (int i = 0; i < 2; i++)  /* s4[l] + s4[l + 2] */
        y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const vf8 z = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* z holds keys 0 2 4 6 | 1 3 5 7 */
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#else  /* the same arithmetic lane by lane */
typedef struct { float v[8]; } vf8;
static inline vf8 vf8_load(const float *p) { vf8 r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vf8 vf8_load_bf16(const uint16_t *p) {
    vf8 r;
    for (int l = 0; l < 8; l++) {
        union { uint32_t u; float f; } x;
        x.u = (uint32_t)p[l] << 16;
        r.v[l] = x.f;
    }
    return r;
}
static inline void vf8_store(float *p, vf8 x) { memcpy(p, x.v, sizeof x.v); }
static inline vf8 vf8_zero(void) { vf8 r = {{0}}; return r; }
static inline vf8 vf8_set1(float x) { vf8 r; for (int l = 0; l < 8; l++) r.v[l] = x; return r; }
#define VF8_LANES(expr) vf8 r; for (int l = 0; l < 8; l++) r.v[l] = (expr); return r;
static inline vf8 vf8_fma(vf8 a, vf8 b, vf8 c) { VF8_LANES(fmaf(a.v[l], b.v[l], c.v[l])) }
static inline vf8 vf8_add(vf8 a, vf8 b) { VF8_LANES(a.v[l] + b.v[l]) }
static inline vf8 vf8_sub(vf8 a, vf8 b) { VF8_LANES(a.v[l] - b.v[l]) }
static inline vf8 vf8_mul(vf8 a, vf8 b) { VF8_LANES(a.v[l] * b.v[l]) }
static inline vf8 vf8_max(vf8 a, vf8 b) { VF8_LANES(a.v[l] > b.v[l] ? a.v[l] : b.v[l]) }
static inline vf8 vf8_min(vf8 a, vf8 b) { VF8_LANES(a.v[l] < b.v[l] ? a.v[l] : b.v[l]) }
static inline vf8 vf8_div(vf8 a, vf8 b) { VF8_LANES(a.v[l] / b.v[l]) }
static inline vf8 vf8_if_nonnegative(vf8 x, vf8 a, vf8 b) { VF8_LANES(x.v[l] >= 0.0f ? a.v[l] : b.v[l]) }
static inline vf8 vf8_floor(vf8 a) { VF8_LANES(floorf(a.v[l])) }
static inline vf8 vf8_keep(vf8 a, vf8 b, int live) { VF8_LANES(l < live ? a.v[l] : b.v[l]) }
static inline vf8 vf8_pow2(vf8 n) {
    vf8 r;
    for (int l = 0; l < 8; l++) {
        union { uint32_t u; float f; } x;
        x.u = (uint32_t)((int32_t)n.v[l] + 127) << 23;
        r.v[l] = x.f;
    }
    return r;
}
static inline vf8 vf8_tree8x8(const vf8 *a) {
    vf8 r;
    for (int k = 0; k < 8; k++) {
        const float *x = a[k].v;
        r.v[k] = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
    }
    return r;
}
#endif

static inline float tree8(vf8 a) {
    float x[8];
    vf8_store(x, a);
    return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
}

static inline float max8(vf8 a) {  /* max is exact in any order */
    float x[8], m;
    vf8_store(x, a);
    m = x[0];
    for (int l = 1; l < 8; l++) m = x[l] > m ? x[l] : m;
    return m;
}

/* exp(x) for x <= 0 on 8 lanes: x = n ln2 + r (two-part ln2), exp(r) by its degree-7 Taylor
 * polynomial, 2^n from the exponent bits; inputs below -87 give exp(-87). */
static inline vf8 vf8_exp_nonpositive(vf8 x) {
    x = vf8_max(x, vf8_set1(-87.0f));
    const vf8 n = vf8_floor(vf8_fma(x, vf8_set1(1.44269504088896341f), vf8_set1(0.5f)));
    vf8 r = vf8_fma(n, vf8_set1(-0.693145751953125f), x);
    r = vf8_fma(n, vf8_set1(-1.42860682030941723e-6f), r);
    vf8 p = vf8_set1(1.0f / 5040.0f);
    p = vf8_fma(p, r, vf8_set1(1.0f / 720.0f));
    p = vf8_fma(p, r, vf8_set1(1.0f / 120.0f));
    p = vf8_fma(p, r, vf8_set1(1.0f / 24.0f));
    p = vf8_fma(p, r, vf8_set1(1.0f / 6.0f));
    p = vf8_fma(p, r, vf8_set1(0.5f));
    p = vf8_fma(p, r, vf8_set1(1.0f));
    p = vf8_fma(p, r, vf8_set1(1.0f));
    return vf8_mul(p, vf8_pow2(n));
}

#endif
