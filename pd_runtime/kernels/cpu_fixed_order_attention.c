/* Attention with a fixed reduction order per query row, over the paged KV cache, for the CPU
 * (see pd_runtime/kernels/native.py and pd_runtime/kernels/fixed_order.py): the batch-invariant mode's only path.
 *
 *   q     [tokens, heads, dim]: each token's heads contiguous, tokens q_stride elements apart
 *   cache [2, blocks, kv_heads, block_size, dim] contiguous (one layer's K then V); with kv_int8
 *         each row is dim int8 values then its float32 scale (dim + 4 bytes): value = q * scale
 *   tables[seqs, width] int64 block ids; token t belongs to sequence seq[t] and sees that
 *         sequence's keys 0 .. len[t]-1 (its own K/V is already in the cache); with window > 0
 *         only the last `window` of them (a sliding window: keys before get probability 0)
 *   sinks [heads] float32 or NULL: each query head's learned logit (gpt-oss), which joins the
 *         softmax's max and total but has no value row (the row's probabilities sum below 1)
 *   out   [tokens, heads, dim] contiguous; elements bf16 (is_bf16) or float32
 *
 * One query row (a token and a head) gets the same bits whether it is a decode, a whole prompt,
 * a chunk over a cached prefix, a recomputation or a prefix-cache hit, and whatever else is in
 * the batch, because every row runs the same arithmetic over its own keys only:
 *   score_j = tree8(lane l: fma chain over d = l, l+8, ... of q_d k_jd) * scale
 *   p_j     = exp(score_j - max), total = tree8(lane l: sum of p_j, j = l, l+8, ... in order)
 *             (with a sink: max over the scores and the sink, total + exp(sink - max))
 *   out_d   = (fma chain over j = 0, 1, ... of p_j v_jd) * (1 / total), rounded once
 * where tree8(a) = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)). Keys are taken in groups
 * of 8 from key 0 (group boundaries never move), every group through the same vector code (no
 * scalar remainder that rounds differently); rows only choose which keys they stop at.
 * Multiplies and adds are fused only where written (fma below; contraction is off here).
 *
 * Work items are (run of up to `tile` consecutive tokens of one sequence, KV head): the G query
 * heads of each token share the KV head's keys, and a prefill run shares them across tokens, so
 * K and V are read (and widened to float32) once per item; items go over OpenMP threads.
 */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_vf8.h"

#define MAX_DIM 256

/* `count` (a multiple of 8) elements, bf16 or float32, widened to float32, exactly */
static inline void widen(const void *src, int is_bf16, float *dst, int64_t count) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma GCC unroll 8
        for (int64_t i = 0; i < count; i += 8) vf8_store(dst + i, vf8_load_bf16(s + i));
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)count);
    }
}

typedef struct {
    const char *q, *k, *v;
    const int64_t *tables, *seq, *len;
    char *out;
    int64_t q_stride, heads, kv_heads, dim, block_size, width, elem;
    int64_t kv_row;   /* bytes per cached K or V row */
    int block_shift;  /* log2(block_size) when a power of two, else -1 */
    int is_bf16, kv_int8;
    float scale;
    int64_t window;   /* 0: every key up to the row's own */
    float softcap;    /* > 0: a scaled score s becomes softcap * tanh(s / softcap) (Gemma 2) */
    const float *sinks;  /* NULL, or [heads]: a logit per query head with no value (gpt-oss) */
} Problem;

/* The first key row t sees. */
static inline int64_t first_key(const Problem *P, int64_t t) {
    const int64_t n = P->len[t];
    return P->window > 0 && n > P->window ? n - P->window : 0;
}

/* `rows` cached rows (kv_row bytes apart) widened to float32 into dst[r * dim]: bf16/float32
 * exactly, int8 rows as value x the row's scale (one rounding, the same for every reader) */
static inline void widen_kv(const Problem *P, const char *src, float *dst, int64_t rows) {
    if (!P->kv_int8) {
        widen(src, P->is_bf16, dst, rows * P->dim);
        return;
    }
    const int64_t dim = P->dim;
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *v = (const int8_t *)(src + r * P->kv_row);
        float scale;
        memcpy(&scale, v + dim, sizeof(float));
        float *d = dst + r * dim;
        for (int64_t i = 0; i < dim; i++) d[i] = (float)v[i] * scale;
    }
}

static const float zero_row[MAX_DIM];

/* Where key j of a sequence's KV head h sits in `base` (K or V), in bytes. */
static inline int64_t key_offset(const Problem *P, const int64_t *table, int64_t h, int64_t j) {
    const int64_t bs = P->block_size;
    const int64_t block = P->block_shift >= 0 ? j >> P->block_shift : j / bs;  /* no idiv */
    return ((table[block] * P->kv_heads + h) * bs + j - block * bs) * P->kv_row;
}

static inline void prefetch(const char *p, int64_t bytes) {
#pragma GCC unroll 8
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

/* the 8 keys of group g (key 8g + k) of a sequence's KV head: float32 rows into dst[k * dim];
 * keys at or past `n` read as zeros (their scores are never used). The next group's rows are
 * prefetched: reading the cache is what this kernel waits on. (Staging only converts, so the
 * whole-group path and the key-by-key path give the same values.) */
static inline void stage_keys(const Problem *P, const char *base, const int64_t *table,
                              int64_t h, int64_t g, int64_t n, float *dst) {
    const int64_t dim = P->dim, row_bytes = P->kv_row, j0 = 8 * g;
    if (j0 + 8 <= n && P->block_size % 8 == 0) {  /* the group lies in one block: contiguous */
        widen_kv(P, base + key_offset(P, table, h, j0), dst, 8);
        if (j0 + 16 <= n)
            prefetch(base + key_offset(P, table, h, j0 + 8), 8 * row_bytes);
        return;
    }
    for (int k = 0; k < 8; k++) {
        const int64_t j = j0 + k;
        if (j >= n) {
            memcpy(dst + k * dim, zero_row, sizeof(float) * (size_t)dim);
            continue;
        }
        widen_kv(P, base + key_offset(P, table, h, j), dst + k * dim, 1);
        if (j + 8 < n) prefetch(base + key_offset(P, table, h, j + 8), row_bytes);
    }
}

/* One item: tokens t0 .. t0+count-1 (one sequence, ascending positions), KV head h.
 * Scratch: qf [rows][dim], kf [8][dim], s [rows][span], acc [rows][dim]. */
static void attend_item(const Problem *P, int64_t t0, int64_t count, int64_t h, float *qf,
                        float *kf, float *s, float *acc, int64_t span) {
    const int64_t dim = P->dim, chunks = dim / 8, group = P->heads / P->kv_heads;
    const int64_t rows = count * group;
    const int64_t *table = P->tables + P->seq[t0] * P->width;
    int64_t n_max = 0;
    int64_t lo_min = INT64_MAX;  /* the earliest key any row sees (a window moves it) */
    for (int64_t i = 0; i < count; i++) {
        n_max = P->len[t0 + i] > n_max ? P->len[t0 + i] : n_max;
        lo_min = first_key(P, t0 + i) < lo_min ? first_key(P, t0 + i) : lo_min;
    }
    const int64_t groups = (n_max + 7) / 8, g_first = lo_min / 8;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = t0 + r / group, head = h * group + r % group;
        widen(P->q + (t * P->q_stride + head * dim) * P->elem, P->is_bf16, qf + r * dim, dim);
    }
    /* scores, 8 keys at a time; a row skips the groups wholly past its keys */
    for (int64_t g = g_first; g < groups; g++) {
        stage_keys(P, P->k, table, h, g, n_max, kf);
        for (int64_t r = 0; r < rows; r++) {
            if (8 * g >= P->len[t0 + r / group] || 8 * g + 8 <= first_key(P, t0 + r / group))
                continue;
            const float *qr = qf + r * dim;
            vf8 a[8];
            for (int k = 0; k < 8; k++) a[k] = vf8_zero();
            for (int64_t c = 0; c < chunks; c++) {
                const vf8 qc = vf8_load(qr + 8 * c);
                for (int k = 0; k < 8; k++) a[k] = vf8_fma(qc, vf8_load(kf + k * dim + 8 * c), a[k]);
            }
            float *sg = s + r * span + 8 * g;
            vf8_store(sg, vf8_mul(vf8_tree8x8(a), vf8_set1(P->scale)));
            if (P->softcap > 0.0f)
                for (int k = 0; k < 8; k++) sg[k] = P->softcap * tanhf(sg[k] / P->softcap);
        }
    }
    /* softmax numerators in place (keys past the row's end, or before its window, become 0);
     * 1 / total into inv. Groups wholly before the window are left out (their scores were not
     * computed): the same for a row whatever else is in its item. */
    float inv[64];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = P->len[t0 + r / group], full = (n + 7) / 8;
        const int64_t lo = first_key(P, t0 + r / group), g0 = lo / 8;
        float *sr = s + r * span;
        vf8 m = vf8_set1(-INFINITY);
        for (int64_t g = g0; g < full; g++)
            m = vf8_max(m, vf8_keep(vf8_set1(-INFINITY),
                                    vf8_keep(vf8_load(sr + 8 * g), vf8_set1(-INFINITY),
                                             (int)(n - 8 * g)),
                                    (int)(lo - 8 * g)));
        const float sink = P->sinks ? P->sinks[h * group + r % group] : -INFINITY;
        const float best = max8(m), top_s = best > sink ? best : sink;
        const vf8 top = vf8_set1(top_s);
        vf8 sum = vf8_zero();
        for (int64_t g = g0; g < full; g++) {
            const vf8 e = vf8_keep(vf8_zero(),
                                   vf8_keep(vf8_exp_nonpositive(vf8_sub(vf8_load(sr + 8 * g), top)),
                                            vf8_zero(), (int)(n - 8 * g)),
                                   (int)(lo - 8 * g));
            vf8_store(sr + 8 * g, e);
            sum = vf8_add(sum, e);
        }
        const float total = tree8(sum) + (P->sinks ? expf(sink - top_s) : 0.0f);
        inv[r] = total > 0.0f ? 1.0f / total : 0.0f;
        memset(acc + r * dim, 0, sizeof(float) * (size_t)dim);
    }
    /* out = sum_j p_j v_j, each element's chain in key order, V widened 8 keys at a time */
    for (int64_t g = g_first; g < groups; g++) {
        stage_keys(P, P->v, table, h, g, n_max, kf);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t live = P->len[t0 + r / group] - 8 * g;
            if (live <= 0 || 8 * g + 8 <= first_key(P, t0 + r / group)) continue;
            const float *pr = s + r * span + 8 * g;
            float *ar = acc + r * dim;
            if (live >= 8) {  /* the common case, unrolled; the same chain as below */
                vf8 p[8];
                for (int k = 0; k < 8; k++) p[k] = vf8_set1(pr[k]);
                for (int64_t c = 0; c < chunks; c++) {
                    vf8 o = vf8_load(ar + 8 * c);
                    for (int k = 0; k < 8; k++) o = vf8_fma(p[k], vf8_load(kf + k * dim + 8 * c), o);
                    vf8_store(ar + 8 * c, o);
                }
                continue;
            }
            for (int64_t c = 0; c < chunks; c++) {
                vf8 o = vf8_load(ar + 8 * c);
                for (int k = 0; k < live; k++) o = vf8_fma(vf8_set1(pr[k]), vf8_load(kf + k * dim + 8 * c), o);
                vf8_store(ar + 8 * c, o);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = t0 + r / group, head = h * group + r % group;
        const int64_t at = (t * P->heads + head) * dim;
        const float *ar = acc + r * dim;
        if (P->is_bf16) {
            uint16_t *o = (uint16_t *)P->out + at;
            for (int64_t d = 0; d < dim; d++) o[d] = float_to_bf16(ar[d] * inv[r]);
        } else {
            float *o = (float *)P->out + at;
            for (int64_t d = 0; d < dim; d++) o[d] = ar[d] * inv[r];
        }
    }
}

/* Tokens per item: up to `tile`, rows (tokens x group) at most 64. Returns 0, -1 for shapes the
 * kernel does not take, -2 when scratch memory runs out. */
int fixed_order_attention(const void *q, int64_t q_stride, const void *cache, int64_t num_blocks,
                          const int64_t *tables, int64_t width, const int64_t *seq,
                          const int64_t *len, void *out, int64_t tokens, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t block_size, int64_t is_bf16,
                          float scale, int64_t tile, int64_t threads, int64_t kv_int8,
                          int64_t window, float softcap, const float *sinks) {
    if (dim % 8 || dim > MAX_DIM || kv_heads < 1 || heads % kv_heads || tokens < 1)
        return -1;
    const int64_t group = heads / kv_heads, elem = is_bf16 ? 2 : 4;
    if (group > 64) return -1;
    tile = tile < 1 ? 1 : tile;
    if (tile * group > 64) tile = 64 / group;
    const int64_t kv_row = kv_int8 ? dim + (int64_t)sizeof(float) : dim * elem;
    const int64_t kv_bytes = num_blocks * kv_heads * block_size * kv_row;
    int block_shift = -1;
    for (int b = 0; b < 31; b++)
        if ((int64_t)1 << b == block_size) block_shift = b;
    Problem P = {(const char *)q, (const char *)cache, (const char *)cache + kv_bytes, tables,
                 seq, len, (char *)out, q_stride, heads, kv_heads, dim, block_size, width, elem,
                 kv_row, block_shift, (int)is_bf16, (int)(kv_int8 != 0), scale, window,
                 softcap, sinks};
    /* runs: consecutive tokens of one sequence, cut every `tile` tokens */
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(tokens + 1));
    if (!starts) return -2;
    int64_t runs = 0, span = 8;
    for (int64_t t = 0; t < tokens; t++) {
        if (t == 0 || seq[t] != seq[t - 1] || t - starts[runs - 1] == tile) starts[runs++] = t;
        const int64_t padded = (len[t] + 7) / 8 * 8;
        span = padded > span ? padded : span;
    }
    starts[runs] = tokens;
    const int64_t items = runs * kv_heads, rows = tile * group;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float *qf = (float *)malloc(sizeof(float) * (size_t)(rows * dim));
        float *kf = (float *)malloc(sizeof(float) * (size_t)(8 * dim));
        float *s = (float *)malloc(sizeof(float) * (size_t)(rows * span));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(rows * dim));
        const int ok = qf && kf && s && acc;
        if (!ok) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ok) continue;
            const int64_t run = item / kv_heads, h = item % kv_heads;
            attend_item(&P, starts[run], starts[run + 1] - starts[run], h, qf, kf, s, acc, span);
        }
        free(qf);
        free(kf);
        free(s);
        free(acc);
    }
    free(starts);
    return status;
}
