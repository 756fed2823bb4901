/* silu(gate) * up of the MLP, for the CPU in bf16 or float32 (see pd_runtime/kernels/native.py): every
 * element through the same 8-lane code (pd_runtime/kernels/cpu_vf8.h), wherever it sits in the batch.
 *
 * torch's own silu rounds differently in its vector loop and in its scalar remainder (measured:
 * float32 rows of 100 elements changed with the row count), so in the batch-invariant mode the
 * MLP takes this instead. x is the fused projection [rows, 2 * inter] (gate, then up), rows
 * x_stride elements apart; out [rows, inter] contiguous. bf16 rounds where torch's
 * `F.silu(gate).mul_(up)` does: silu to bf16, then the product to bf16.
 */
#pragma GCC optimize("fp-contract=off")

#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_vf8.h"

/* x / (1 + exp(-x)) with exp of -|x| only: for x < 0 it is x e / (1 + e), e = exp(x) */
static inline vf8 silu8(vf8 x) {
    const vf8 e = vf8_exp_nonpositive(vf8_min(x, vf8_sub(vf8_zero(), x)));
    return vf8_div(vf8_if_nonnegative(x, x, vf8_mul(x, e)), vf8_add(vf8_set1(1.0f), e));
}

static inline void load8(const char *src, int is_bf16, int64_t n, float *dst) {
    memset(dst, 0, sizeof(float) * 8);
    if (is_bf16)
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_float(((const uint16_t *)src)[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

int silu_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter,
             int64_t is_bf16, int64_t threads) {
    const int64_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)x + r * x_stride * elem, *up = gate + inter * elem;
        char *o = (char *)out + r * inter * elem;
        for (int64_t c = 0; c < inter; c += 8) {
            const int64_t n = inter - c < 8 ? inter - c : 8;
            float g[8], u[8], s[8];
            load8(gate + c * elem, (int)is_bf16, n, g);
            load8(up + c * elem, (int)is_bf16, n, u);
            vf8_store(s, silu8(vf8_load(g)));
            if (is_bf16) {
                uint16_t *ob = (uint16_t *)o + c;
                for (int64_t i = 0; i < n; i++)
                    ob[i] = float_to_bf16(bf16_to_float(float_to_bf16(s[i])) * u[i]);
            } else {
                vf8_store(s, vf8_mul(vf8_load(s), vf8_load(u)));
                memcpy((float *)o + c, s, sizeof(float) * (size_t)n);
            }
        }
    }
    return 0;
}
