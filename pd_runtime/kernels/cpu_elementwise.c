/* Fused bf16 row ops for the CPU decoder layer (see pd_runtime/kernels/native.py): RMSNorm and the residual
 * add in front of it. Each reproduces the rounding steps of the torch
 * expressions it replaces in pd_runtime/model/llama.py (float32 math, bf16 results where torch
 * rounds), in one pass over a row instead of one pass per op; the float32 sum of squares adds
 * in its own fixed order, so a result can differ from torch's in the last bf16 bit, never with
 * the batch around a row. Rows are shared out over torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_bf16.h"

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w) per row: torch's
 * `(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(bf16).mul_(w)`.
 * With delta: first x = bf16(x + delta), written back to x (`h.add_(delta)`). */
static void norm_rows(uint16_t *x, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                      int64_t rows, int64_t dim, float eps, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * dim;
        if (delta) {
            const uint16_t *dr = delta + r * dim;
            for (int64_t d = 0; d < dim; d++) xr[d] = float_to_bf16(bf16_to_float(xr[d]) + bf16_to_float(dr[d]));
        }
        float part[16] = {0};
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16)
            for (int l = 0; l < 16; l++) {
                const float v = bf16_to_float(xr[d + l]);
                part[l] += v * v;
            }
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += part[l];
        for (; d < dim; d++) sum += bf16_to_float(xr[d]) * bf16_to_float(xr[d]);
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        uint16_t *orow = out + r * dim;
        for (d = 0; d < dim; d++)
            orow[d] = float_to_bf16(round_bf16(bf16_to_float(xr[d]) * scale) * bf16_to_float(w[d]));
    }
}

int rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t dim,
                  float eps, int64_t threads) {
    norm_rows((uint16_t *)x, 0, w, out, rows, dim, eps, threads);  /* x only read without delta */
    return 0;
}

int add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *w, uint16_t *out,
                      int64_t rows, int64_t dim, float eps, int64_t threads) {
    norm_rows(h, delta, w, out, rows, dim, eps, threads);
    return 0;
}
