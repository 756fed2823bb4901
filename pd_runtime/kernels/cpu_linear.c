/* y = x @ W^T (+ bias) in float32 for the CPU, with W prepacked (pd_runtime/kernels/native.py
 * pack_linear): one fixed summation order per output element, whatever the row count, the
 * row's place in the call or the thread count, so the batch-invariant mode needs no padding.
 *
 * Why not torch's float32 GEMM: with one or a few rows (a decode step) it reads the weights at
 * a third of the memory bandwidth (measured on a 2-core AVX2 EPYC: 4 rows x 2816 x 512 ran at
 * 12 GB/s against 31 GB/s for one row), and a decode step is nothing but weight reads. Here
 * the weights stream once per call, in bfloat16 when the checkpoint's values are bf16 (exact:
 * a bf16 widens to float32 without rounding), which halves the bytes again.
 *
 * Layout: W [n, k] in panels of 16 output columns, panel p = [k][16], panels back to back;
 * n padded to a multiple of 16 with zero columns; bf16 panels when the weight's values are
 * all bf16, else float32. Float32 panels hold the columns in order, bf16 ones in the order the
 * widening unpack yields them (positions 0-3, 8-11 | 4-7, 12-15 of each 16: see widen16).
 *
 * Order: every y[m][j] = sum over k = 0, 1, ..., k-1 of x[m][k] * W[j][k], one fused
 * multiply-add at a time from 0.0, then + bias[j]. The k loop is cut in blocks of KC; between
 * blocks the partial sum waits in y, stored and reloaded exactly.
 */
#include <stdint.h>
#include <string.h>

#define NR 16  /* output columns per panel (two 8-lane vectors) */
#define MR 6   /* rows per register tile: 6 x 2 accumulators + 2 weights + 1 broadcast */
#ifndef KC
#define KC 512 /* k per block: a row tile's x (12 KiB) in L1, the panel slices (16-32 KiB each) in L2 */
#endif
#ifndef PB
#define PB 4   /* panels per L2 block */
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void widen16(const void *panel, int bf16,
                                                         int64_t kk, __m256 *w0, __m256 *w1) {
    if (bf16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + kk * NR));
        const __m256i zero = _mm256_setzero_si256();
        *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
        *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    } else {
        const float *f = (const float *)panel + kk * NR;
        *w0 = _mm256_loadu_ps(f);
        *w1 = _mm256_loadu_ps(f + 8);
    }
}

/* y[0:rows, 0:16 cols] (+)= x[0:rows, 0:kc] @ panels[0:cols][0:kc] (panels ps elements
 * apart); rows, cols and bf16 are constants in every instance below. One or two rows take
 * several panels at once: two accumulators alone would wait on the FMA latency. The
 * accumulators are named variables, not an array: GCC kept an array on the stack and stored
 * all of them every k (measured: a third of the FMA rate). */
#define ACC_INIT(r, c)                                                                        \
    __m256 a##r##c##0 = _mm256_setzero_ps(), a##r##c##1 = _mm256_setzero_ps();                \
    if (rows > r && cols > c && !first) {                                                     \
        a##r##c##0 = _mm256_loadu_ps(y + r * ys + c * NR);                                    \
        a##r##c##1 = _mm256_loadu_ps(y + r * ys + c * NR + 8);                                \
    }
#define ACC_FMA(r, c)                                                                         \
    if (rows > r && cols > c) {                                                               \
        const __m256 b = _mm256_broadcast_ss(x + r * xs + kk);                                \
        a##r##c##0 = _mm256_fmadd_ps(b, w0, a##r##c##0);                                      \
        a##r##c##1 = _mm256_fmadd_ps(b, w1, a##r##c##1);                                      \
    }
#define ACC_STORE(r, c)                                                                       \
    if (rows > r && cols > c) {                                                               \
        if (bias != NULL) {                                                                   \
            a##r##c##0 = _mm256_add_ps(a##r##c##0, _mm256_loadu_ps(bias + c * NR));           \
            a##r##c##1 = _mm256_add_ps(a##r##c##1, _mm256_loadu_ps(bias + c * NR + 8));       \
        }                                                                                     \
        _mm256_storeu_ps(y + r * ys + c * NR, a##r##c##0);                                    \
        _mm256_storeu_ps(y + r * ys + c * NR + 8, a##r##c##1);                                \
    }
#define ROWS(M, c) M(0, c) M(1, c) M(2, c) M(3, c) M(4, c) M(5, c)
#define PANEL_FMA(c)                                                                          \
    if (cols > c) {                                                                           \
        __m256 w0, w1;                                                                        \
        widen16((const char *)panel + c * ps * (bf16 ? 2 : 4), bf16, kk, &w0, &w1);           \
        ROWS(ACC_FMA, c)                                                                      \
    }

static inline __attribute__((always_inline)) void tile(
    const int rows, const int cols, const int bf16, const float *x, int64_t xs,
    const void *panel, int64_t ps, int64_t kc, float *y, int64_t ys, int first,
    const float *bias) {
    ROWS(ACC_INIT, 0) ROWS(ACC_INIT, 1) ROWS(ACC_INIT, 2) ROWS(ACC_INIT, 3)
    for (int64_t kk = 0; kk < kc; kk++) {
        PANEL_FMA(0) PANEL_FMA(1) PANEL_FMA(2) PANEL_FMA(3)
    }
    ROWS(ACC_STORE, 0) ROWS(ACC_STORE, 1) ROWS(ACC_STORE, 2) ROWS(ACC_STORE, 3)
}

typedef void (*tile_fn)(const float *, int64_t, const void *, int64_t, int64_t, float *,
                        int64_t, int, const float *);
#define TILE(rows, cols, bf16)                                                                \
    static void tile_##rows##_##cols##_##bf16(const float *x, int64_t xs, const void *p,       \
                                              int64_t ps, int64_t kc, float *y, int64_t ys,    \
                                              int first, const float *bias) {                  \
        tile(rows, cols, bf16, x, xs, p, ps, kc, y, ys, first, bias);                          \
    }
#define TILES(bf16)                                                                           \
    TILE(1, 1, bf16) TILE(1, 2, bf16) TILE(1, 3, bf16) TILE(1, 4, bf16) TILE(2, 1, bf16)     \
    TILE(2, 2, bf16) TILE(2, 3, bf16) TILE(3, 1, bf16) TILE(3, 2, bf16) TILE(4, 1, bf16)     \
    TILE(5, 1, bf16) TILE(6, 1, bf16)
TILES(0)
TILES(1)
#define TILE_ROW(rows, bf16)                                                                  \
    {NULL, tile_##rows##_1_##bf16, MAYBE_##rows##_2(bf16), MAYBE_##rows##_3(bf16),            \
     MAYBE_##rows##_4(bf16)}
#define MAYBE_1_2(b) tile_1_2_##b
#define MAYBE_1_3(b) tile_1_3_##b
#define MAYBE_1_4(b) tile_1_4_##b
#define MAYBE_2_2(b) tile_2_2_##b
#define MAYBE_2_3(b) tile_2_3_##b
#define MAYBE_2_4(b) NULL
#define MAYBE_3_2(b) tile_3_2_##b
#define MAYBE_3_3(b) NULL
#define MAYBE_3_4(b) NULL
#define MAYBE_4_2(b) NULL
#define MAYBE_4_3(b) NULL
#define MAYBE_4_4(b) NULL
#define MAYBE_5_2(b) NULL
#define MAYBE_5_3(b) NULL
#define MAYBE_5_4(b) NULL
#define MAYBE_6_2(b) NULL
#define MAYBE_6_3(b) NULL
#define MAYBE_6_4(b) NULL
/* tiles[bf16][rows][cols], NULL beyond 12 accumulators; max_cols[rows]: the widest one. */
static const tile_fn tiles[2][MR + 1][5] = {
    {{NULL}, TILE_ROW(1, 0), TILE_ROW(2, 0), TILE_ROW(3, 0), TILE_ROW(4, 0), TILE_ROW(5, 0),
     TILE_ROW(6, 0)},
    {{NULL}, TILE_ROW(1, 1), TILE_ROW(2, 1), TILE_ROW(3, 1), TILE_ROW(4, 1), TILE_ROW(5, 1),
     TILE_ROW(6, 1)},
};
static const int max_cols[MR + 1] = {0, 4, 3, 2, 1, 1, 1};

/* Panels [p0, p1) of y (row stride ys = padded n), all rows. */
static void panels(const float *x, int64_t xs, const void *w, int bf16, const float *bias,
                   float *y, int64_t ys, int64_t rows, int64_t k, int64_t p0, int64_t p1) {
    const int64_t esize = bf16 ? 2 : 4, ps = k * NR;
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        const int last = k0 + kc >= k;
        for (int64_t pb = p0; pb < p1; pb += PB) {
            const int64_t pe = pb + PB < p1 ? pb + PB : p1;
            for (int64_t m = 0; m < rows; m += MR) {
                const int mr = (int)(rows - m < MR ? rows - m : MR);
                for (int64_t p = pb; p < pe;) {
                    const int cols = (int)(pe - p < max_cols[mr] ? pe - p : max_cols[mr]);
                    tiles[bf16][mr][cols](x + m * xs + k0, xs,
                                          (const char *)w + (p * ps + k0 * NR) * esize, ps, kc,
                                          y + m * ys + p * NR, ys, k0 == 0,
                                          last && bias ? bias + p * NR : NULL);
                    p += cols;
                }
            }
        }
    }
}

int linear_f32(const float *x, int64_t xs, const void *w, int64_t bf16, const float *bias,
               float *y, int64_t rows, int64_t n_padded, int64_t k, int64_t threads) {
    const int64_t np = n_padded / NR;
    if (n_padded % NR || rows < 0 || k < 1)
        return -2;
    if (threads <= 1 || np < 2) {
        panels(x, xs, w, (int)bf16, bias, y, n_padded, rows, k, 0, np);
        return 0;
    }
    if (threads > np)
        threads = np;
    /* Runs of PB panels handed out as threads come free, not a fixed share each: a thread
       whose core another process also runs on (a decode worker's steps beside a prefill
       worker that borrows every core) then does less of the work instead of holding the
       others at the join. Each panel is still computed whole, in the same order, by one
       thread: the bits do not depend on the split. */
    const int64_t runs = (np + PB - 1) / PB;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < runs; r++) {
        const int64_t p0 = r * PB, p1 = p0 + PB < np ? p0 + PB : np;
        panels(x, xs, w, (int)bf16, bias, y, n_padded, rows, k, p0, p1);
    }
    return 0;
}

#else /* no AVX2 + FMA: the caller keeps torch's GEMM */

int linear_f32(const float *x, int64_t xs, const void *w, int64_t bf16, const float *bias,
               float *y, int64_t rows, int64_t n_padded, int64_t k, int64_t threads) {
    (void)x; (void)xs; (void)w; (void)bf16; (void)bias; (void)y; (void)rows; (void)n_padded;
    (void)k; (void)threads;
    return -1;
}

#endif
