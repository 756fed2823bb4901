/* Decode attention over a contiguous bf16 K/V batch, for the CPU (see pd_runtime/kernels/native.py).
 *
 * One query token per sequence; the query heads of a KV group share that group's K/V.
 *   q   [batch, kv_heads, group, dim]       bf16
 *   k,v [rows >= batch, kv_heads, cap, dim]  bf16 (row b holds sequence b, first lens[b] valid)
 *   out [batch, kv_heads, group, dim]       bf16
 * With window > 0 only the last `window` valid keys of a row are attended (a sliding window).
 * For each (sequence, kv head): scores = q k^T * scale over the valid keys, softmax in float32,
 * out = probs v, accumulated in float32 and rounded to bf16 once. K and V are each read once,
 * which is what bounds this on a CPU; torch's batched matmuls over these shapes (2 query rows
 * per head) are dominated by per-matrix overhead instead.
 *
 * The (sequence, kv head) pairs are shared out over `threads` OpenMP threads. Built with
 * -fopenmp, this library needs libgomp.so.1, which resolves to the copy torch has loaded
 * already: one thread pool for torch's ops and this kernel, no second pool spinning against
 * the first. Each pair's result depends only on its own inputs: a sequence gets the same
 * bits whatever else is in the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

/* sum of a[d] * b[d]: 16 independent partial sums (vectorizes without reassociation), added
 * in a fixed order, so the result is the same on every call. dim % 16 == 0. */
static inline float dot(const float *a, const float *b, int64_t dim) {
    float part[16] = {0};
    for (int64_t d = 0; d < dim; d += 16)
        for (int l = 0; l < 16; l++) part[l] += a[d + l] * b[d + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += part[l];
    return s;
}

/* scores[j] -> exp(scores[j] - max) in place; returns their sum. */
static inline float softmax_numerators(float *s, int64_t n) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
    for (int64_t j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - top);
    for (int64_t j = 0; j < n; j++) total += s[j];
    return total;
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load_bf16x16(const uint16_t *p) {  /* 16 bf16 -> 16 float32, exactly */
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* softmax_numerators on 16 lanes (the scalar one's max and sum are serial chains: they were
 * ~40% of this kernel's time). The additions run in a fixed order, so a row's result does not
 * depend on anything but the row. */
static inline float softmax_numerators16(float *s, int64_t n) {
    const int64_t full = n & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (n - full)) - 1u);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < full; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + full));
    const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < full; j += 16) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + j), t));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
        const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive16(
            _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), t)));
        _mm512_mask_storeu_ps(s + full, tail, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* One (sequence, kv head) pair with G query rows and dim = 16 * C, both compile-time constants
 * at each call site (see PAIR below), so the V accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_pair(
        const float *qf, const uint16_t *qp, const uint16_t *kp, const uint16_t *vp, int64_t n,
        float scale, float *scores, int64_t cap, uint16_t *op, const int G, const int C) {
    const int64_t dim = 16 * C;
#if defined(__AVX512BF16__)
    /* bf16 pairs straight from q and K: products exact in float32, two per lane and
     * instruction (vdpbf16ps), half the instructions of converting K first. */
    __m512bh qb[8][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C / 2; c++)
            qb[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qp + g * dim + 32 * c));
    for (int64_t j = 0; j < n; j++) {
        __m512bh kb[4];
        for (int c = 0; c < C / 2; c++) kb[c] = (__m512bh)_mm512_loadu_si512((const void *)(kp + j * dim + 32 * c));
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < C / 2; c++) a = _mm512_dpbf16_ps(a, qb[g][c], kb[c]);
            scores[g * cap + j] = _mm512_reduce_add_ps(a) * scale;
        }
    }
#else
    (void)qp;
    for (int64_t j = 0; j < n; j++)
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < C; c++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * dim + 16 * c), load_bf16x16(kp + j * dim + 16 * c), a);
            scores[g * cap + j] = _mm512_reduce_add_ps(a) * scale;
        }
#endif
    float row_sum[8];
    for (int g = 0; g < G; g++) row_sum[g] = softmax_numerators16(scores + g * cap, n);
    __m512 acc[8][8];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++)
        for (int c = 0; c < C; c++) {
            const __m512 vv = load_bf16x16(vp + j * dim + 16 * c);
            for (int g = 0; g < G; g++)
                acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * cap + j]), vv, acc[g][c]);
        }
    for (int g = 0; g < G; g++) {
        const float inv = row_sum[g] > 0.0f ? 1.0f / row_sum[g] : 0.0f;
        float o[16];
        for (int c = 0; c < C; c++) {
            _mm512_storeu_ps(o, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv)));
            for (int l = 0; l < 16; l++) op[g * dim + 16 * c + l] = float_to_bf16(o[l]);
        }
    }
}
#endif

/* The portable pair: any group <= 16, dim <= 512 with dim % 16 == 0. */
static void attend_pair_any(const float *qf, const uint16_t *kp, const uint16_t *vp, int64_t n,
                            float scale, float *scores, int64_t cap, uint16_t *op,
                            int64_t group, int64_t dim) {
    float row[512], acc[512];
    for (int64_t j = 0; j < n; j++) {  /* K once: every query row's score of key j */
        for (int64_t d = 0; d < dim; d++) row[d] = bf16_to_float(kp[j * dim + d]);
        for (int64_t g = 0; g < group; g++) scores[g * cap + j] = dot(qf + g * dim, row, dim) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        const float total = softmax_numerators(scores + g * cap, n);
        memset(acc, 0, sizeof(float) * (size_t)dim);
        for (int64_t j = 0; j < n; j++) {  /* V once per query row (the fast path reads it once) */
            const float p = scores[g * cap + j];
            for (int64_t d = 0; d < dim; d++) acc[d] += p * bf16_to_float(vp[j * dim + d]);
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < dim; d++) op[g * dim + d] = float_to_bf16(acc[d] * inv);
    }
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                          const int64_t *lens, uint16_t *out, int64_t kv_heads, int64_t group,
                          int64_t cap, int64_t dim, float scale, int64_t window, int64_t pairs,
                          int64_t threads) {
    if (group > 16 || dim > 512 || dim % 16) return -1;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * cap));
        float *qf = (float *)malloc(sizeof(float) * (size_t)(group * dim));
        if (!scores || !qf) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++) {
            if (!scores || !qf) continue;
            const int64_t b = pair / kv_heads, h = pair % kv_heads;
            const int64_t end = lens[b] < cap ? lens[b] : cap;
            const int64_t first = window > 0 && end > window ? end - window : 0;
            const int64_t n = end - first;
            const uint16_t *qp = q + pair * group * dim;
            const uint16_t *kp = k + ((b * kv_heads + h) * cap + first) * dim;
            const uint16_t *vp = v + ((b * kv_heads + h) * cap + first) * dim;
            uint16_t *op = out + pair * group * dim;
            for (int64_t i = 0; i < group * dim; i++) qf[i] = bf16_to_float(qp[i]);
#if defined(__AVX512F__)
#define PAIR(G_, C_) \
            if (group == G_ && dim == 16 * C_) { \
                attend_pair(qf, qp, kp, vp, n, scale, scores, cap, op, G_, C_); \
                continue; \
            }
            PAIR(1, 4) PAIR(2, 4) PAIR(4, 4) PAIR(8, 4) PAIR(1, 8) PAIR(2, 8) PAIR(4, 8) PAIR(8, 8)
#undef PAIR
#endif
            attend_pair_any(qf, kp, vp, n, scale, scores, cap, op, group, dim);
        }
        free(scores);
        free(qf);
    }
    return status;
}
