/* Causal attention for fresh prompts on the CPU, bf16 (see pd_runtime/kernels/native.py).
 *
 * `num_seqs` prompts of n tokens each, back to back in the flat batch:
 *   q [num_seqs * n, heads, dim], k and v [num_seqs * n, kv_heads, dim]   bf16, each token's
 *   heads contiguous, tokens `*_stride` elements apart (views into the fused qkv output work)
 *   out [num_seqs * n, heads, dim] bf16, contiguous
 * Token i of a prompt attends to tokens 0..i of the same prompt; query head h reads KV head
 * h / (heads / kv_heads). Scores are q.k in float32 from bf16 pairs (vdpbf16ps), softmax in
 * float32, probabilities rounded to bf16 (as torch's matmul path rounds them) times V from bf16
 * pairs, accumulated in float32, rounded to bf16 once.
 *
 * Work items are (prompt, query head) pairs over torch's OpenMP threads; each packs its KV
 * head's K so that one 64-byte load holds a pair of dimensions for 16 keys (scores then come
 * 16 keys at a time with no horizontal sums) and V so that one load holds two keys for 16
 * dimensions (the product by probabilities then also runs on bf16 pairs). Needs AVX512F and
 * AVX512-BF16 and dim 64 or 128; returns -1 otherwise (the caller keeps torch's SDPA).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define QB 16  /* query rows per block */

/* One (prompt, query head): q rows qh (stride q_stride), K packed kp [dim/2][n_pad][2]
 * (dimension pairs), V packed vp [n_pad/2][dim][2] (key pairs), out rows oh (stride
 * out_stride). dim = 16 * C (compile-time at the calls). s: float scores, sb: their bf16. */
static inline __attribute__((always_inline)) void prefill_head(
        const uint16_t *qh, int64_t q_stride, const uint16_t *kp, const uint16_t *vp, uint16_t *oh,
        int64_t out_stride, int64_t n, int64_t n_pad, float scale, float *s, uint16_t *sb,
        const int C) {
    const int64_t dim = 16 * C;
    for (int64_t i0 = 0; i0 < n; i0 += QB) {
        const int64_t rows = n - i0 < QB ? n - i0 : QB;
        const int64_t keys = i0 + rows;                 /* the block's last row sees these */
        const int64_t keys_pad = (keys + 15) & ~(int64_t)15;
        /* scores s[r][j] = q_r . k_j * scale, 8 rows x 16 keys per register block */
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
            const int64_t rr = rows - r0 < 8 ? rows - r0 : 8;
            const uint32_t *qrow[8];
            for (int r = 0; r < 8; r++)
                qrow[r] = (const uint32_t *)(qh + (i0 + r0 + (r < rr ? r : 0)) * q_stride);
            for (int64_t j0 = 0; j0 < keys_pad; j0 += 16) {
                __m512 acc[8];
                for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
                for (int p = 0; p < 8 * C; p++) {  /* dim / 2 pairs */
                    const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(kp + (p * n_pad + j0) * 2));
                    for (int r = 0; r < 8; r++)
                        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)qrow[r][p]), kv);
                }
                for (int r = 0; r < rr; r++)
                    _mm512_storeu_ps(s + (r0 + r) * n_pad + j0, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
            }
        }
        /* causal softmax numerators, as bf16 for the V product (torch's matmul path rounds its
         * probabilities to bf16 the same way); masked keys get 0; row sums in float32 */
        float inv[QB];
        for (int64_t r = 0; r < rows; r++) {
            float *sr = s + r * n_pad, top = -INFINITY, total = 0.0f;
            uint16_t *br = sb + r * n_pad;
            const int64_t seen = i0 + r + 1;
            const int64_t span = (seen + 15) & ~(int64_t)15;
            __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < span; j += 16) {
                const __mmask16 live = j + 16 <= seen ? (__mmask16)0xffff : (__mmask16)((1u << (seen - j)) - 1u);
                m = _mm512_mask_max_ps(m, live, m, _mm512_loadu_ps(sr + j));
            }
            top = _mm512_reduce_max_ps(m);
            for (int64_t j = 0; j < span; j += 16) {
                const __mmask16 live = j + 16 <= seen ? (__mmask16)0xffff : (__mmask16)((1u << (seen - j)) - 1u);
                const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive16(
                    _mm512_sub_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(top))));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(br + j), (__m256i)_mm512_cvtneps_pbh(e));
            }
            total = _mm512_reduce_add_ps(sum);
            for (int64_t j = span; j < keys_pad; j++) br[j] = 0;
            inv[r] = 1.0f / total;
        }
        /* out rows = probabilities x V by key pairs (vdpbf16ps), 4 rows x C accumulators */
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t rr = rows - r0 < 4 ? rows - r0 : 4;
            const int64_t pairs = (i0 + r0 + rr + 1) / 2;  /* key pairs these rows can see */
            const uint32_t *prow[4];
            for (int r = 0; r < 4; r++) prow[r] = (const uint32_t *)(sb + (r0 + (r < rr ? r : 0)) * n_pad);
            __m512 acc[4][8];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
            for (int64_t jp = 0; jp < pairs; jp++) {
                __m512bh vv[8];
                for (int c = 0; c < C; c++)
                    vv[c] = (__m512bh)_mm512_loadu_si512((const void *)(vp + (jp * dim + 16 * c) * 2));
                for (int r = 0; r < 4; r++) {
                    const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)prow[r][jp]);
                    for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pj, vv[c]);
                }
            }
            for (int r = 0; r < rr; r++) {
                uint16_t *orow = oh + (i0 + r0 + r) * out_stride;
                float o[16];
                for (int c = 0; c < C; c++) {
                    _mm512_storeu_ps(o, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r0 + r])));
                    for (int l = 0; l < 16; l++) orow[16 * c + l] = float_to_bf16(o[l]);
                }
            }
        }
    }
}
#endif

int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                           const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t num_seqs,
                           int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                           int64_t threads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if ((dim != 64 && dim != 128) || heads % kv_heads || n < 1) return -1;
    const int64_t group = heads / kv_heads, n_pad = (n + 15) & ~(int64_t)15;
    const int64_t items = num_seqs * heads, out_stride = heads * dim;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        uint16_t *kp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(n_pad * dim));
        uint16_t *vp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(n_pad * dim));
        float *s = (float *)malloc(sizeof(float) * (size_t)(QB * n_pad));
        uint16_t *sb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(QB * n_pad));
        if (!kp || !vp || !s || !sb) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (!kp || !vp || !s || !sb) continue;
            const int64_t seq = item / heads, h = item % heads, kvh = h / group;
            const uint16_t *kh = k + seq * n * k_stride + kvh * dim;
            const uint16_t *vh = v + seq * n * v_stride + kvh * dim;
            /* pairs of dimensions, 16 keys per 64 bytes: kp[p][j][e] = k_j[2p + e] */
            memset(kp, 0, sizeof(uint16_t) * (size_t)(n_pad * dim));
            for (int64_t j = 0; j < n; j++)
                for (int64_t p = 0; p < dim / 2; p++) {
                    kp[(p * n_pad + j) * 2] = kh[j * k_stride + 2 * p];
                    kp[(p * n_pad + j) * 2 + 1] = kh[j * k_stride + 2 * p + 1];
                }
            /* pairs of keys per dimension: vp[jp][d][e] = v_{2jp + e}[d] */
            memset(vp, 0, sizeof(uint16_t) * (size_t)(n_pad * dim));
            for (int64_t j = 0; j < n; j++)
                for (int64_t d = 0; d < dim; d++) vp[((j / 2) * dim + d) * 2 + (j & 1)] = vh[j * v_stride + d];
            const uint16_t *qh = q + seq * n * q_stride + h * dim;
            uint16_t *oh = out + seq * n * out_stride + h * dim;
            if (dim == 64)
                prefill_head(qh, q_stride, kp, vp, oh, out_stride, n, n_pad, scale, s, sb, 4);
            else
                prefill_head(qh, q_stride, kp, vp, oh, out_stride, n, n_pad, scale, s, sb, 8);
        }
        free(kp);
        free(vp);
        free(s);
        free(sb);
    }
    return status;
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out;
    (void)num_seqs; (void)n; (void)heads; (void)kv_heads; (void)dim; (void)scale; (void)threads;
    return -1;
#endif
}
