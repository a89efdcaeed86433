/* Paged decode attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * One task per (sequence, KV head): the query heads sharing that KV head ride together, so
 * each K and V row is loaded (and widened to float32) once for all of them. Scores, softmax
 * and the weighted sum run in float32; the output is rounded once to the cache's type. Tasks
 * are spread over the OpenMP threads of the process (PyTorch's own libgomp, see
 * paged_kernel.py).
 *
 * Layouts (contiguous):
 *   q, out   (B, kv_heads, group, D)                 elements of the cache's type
 *   k, v     (num_blocks, block_size, kv_heads, D)    one layer's K or V cache
 *   tables   (B, max_blocks) int64 block ids;  lens (B,) int64 context lengths >= 1
 * dtype codes: 0 = float32, 1 = bfloat16, 2 = float8_e5m2 (the cache only: vLLM's fp8 KV on
 * CPU; half the bytes per step at the price of a 2-bit mantissa).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256
#define MAX_ROWS 64  /* query heads per task */

static inline size_t esize(int code) { return code == 0 ? 4 : code == 1 ? 2 : 1; }

/* src row of n elements (dtype code as above) -> float32 */
static inline void widen(const void *src, float *dst, int n, int code) {
    if (code == 2) {  /* an e5m2 byte is the top byte of an IEEE half */
        const uint8_t *b = (const uint8_t *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            /* exponent and mantissa into a float's place, then rebias 15 -> 127 by multiplying:
             * right for normals and subnormals alike. Inf/NaN bytes would come out finite, as
             * this -ffast-math kernel assumes anyway (PyTorch saturates finite K/V). */
            const uint32_t u = ((uint32_t)b[i] & 0x7fu) << 21;
            float f;
            memcpy(&f, &u, 4);
            f *= 0x1p112f;
            uint32_t r;
            memcpy(&r, &f, 4);
            r |= ((uint32_t)b[i] & 0x80u) << 24;
            memcpy(&dst[i], &r, 4);
        }
    } else if (code == 1) {
        const uint16_t *h = (const uint16_t *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            const uint32_t u = (uint32_t)h[i] << 16;
            float f;
            memcpy(&f, &u, 4);  /* not a pointer cast: that breaks strict aliasing */
            dst[i] = f;
        }
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

static inline void narrow(const float *src, void *dst, int n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    for (int i = 0; i < n; i++) {  /* round to nearest even, as PyTorch does */
        uint32_t u;
        memcpy(&u, &src[i], 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) h[i] = (uint16_t)((u >> 16) | 0x40);
        else h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* One sequence's heads h0 .. h0 + nh - 1 (with their `group` query heads each), block by block:
 * a block's rows of all these heads are adjacent in memory, so a task that takes every head of
 * a sequence streams each block once. Written for any D; `attend_d64`/`attend_d128` below are
 * the same code with D a constant, which lets the compiler keep rows in vector registers. */
static inline __attribute__((always_inline)) int attend(
        const char *q, const char *k, const char *v, const int64_t *table, int64_t L, char *out,
        int block_size, int kv_heads, int h0, int nh, int group, const int D, float scale, int bf16,
        int kvc) {
    const size_t es = bf16 ? 2 : 4, kes = esize(kvc);
    const size_t tok = (size_t)kv_heads * D * kes, blk = (size_t)block_size * tok;
    const int R = nh * group;  /* query rows of this task: head-major, like q */
    float qf[MAX_ROWS][MAX_D], acc[MAX_ROWS][MAX_D], row[MAX_D], inv[MAX_ROWS];
    float *s = (float *)malloc(sizeof(float) * (size_t)(L * R));
    if (!s) return -2;
    for (int r = 0; r < R; r++) {
        widen(q + (size_t)r * D * es, qf[r], D, bf16);
        for (int d = 0; d < D; d++) qf[r][d] *= scale;
    }
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {  /* scores, block by block */
        const char *kb = k + (size_t)table[t0 / block_size] * blk + (size_t)h0 * D * kes;
        const int n = L - t0 < block_size ? (int)(L - t0) : block_size;
        for (int i = 0; i < n; i++) {
            for (int hh = 0; hh < nh; hh++) {
                widen(kb + i * tok + (size_t)hh * D * kes, row, D, kvc);
                for (int g = 0; g < group; g++) {
                    const int r = hh * group + g;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; d++) dot += qf[r][d] * row[d];
                    s[r * L + t0 + i] = dot;
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {  /* softmax */
        float *sr = s + r * L, m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; t++) m = sr[t] > m ? sr[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) {
            sr[t] = expf(sr[t] - m);
            sum += sr[t];
        }
        inv[r] = 1.f / sum;
        memset(acc[r], 0, sizeof(float) * (size_t)D);
    }
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {  /* weighted sum of V */
        const char *vb = v + (size_t)table[t0 / block_size] * blk + (size_t)h0 * D * kes;
        const int n = L - t0 < block_size ? (int)(L - t0) : block_size;
        for (int i = 0; i < n; i++) {
            for (int hh = 0; hh < nh; hh++) {
                widen(vb + i * tok + (size_t)hh * D * kes, row, D, kvc);
                for (int g = 0; g < group; g++) {
                    const int r = hh * group + g;
                    const float p = s[r * L + t0 + i];
#pragma omp simd
                    for (int d = 0; d < D; d++) acc[r][d] += p * row[d];
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        for (int d = 0; d < D; d++) acc[r][d] *= inv[r];
        narrow(acc[r], out + (size_t)r * D * es, D, bf16);
    }
    free(s);
    return 0;
}

#define ATTEND_FIXED(NAME, DIM)                                                                   \
    static int NAME(const char *q, const char *k, const char *v, const int64_t *table, int64_t L,  \
                    char *out, int block_size, int kv_heads, int h0, int nh, int group, int D,     \
                    float scale, int bf16, int kvc) {                                              \
        (void)D;                                                                                   \
        return attend(q, k, v, table, L, out, block_size, kv_heads, h0, nh, group, DIM, scale,     \
                      bf16, kvc);                                                                  \
    }
ATTEND_FIXED(attend_d64, 64)
ATTEND_FIXED(attend_d128, 128)

static int attend_any(const char *q, const char *k, const char *v, const int64_t *table, int64_t L,
                      char *out, int block_size, int kv_heads, int h0, int nh, int group, int D,
                      float scale, int bf16, int kvc) {
    return attend(q, k, v, table, L, out, block_size, kv_heads, h0, nh, group, D, scale, bf16, kvc);
}

/* Tasks are whole sequences when there are enough of them to share out, else (sequence, KV
 * head) pairs so that a few long sequences still use every thread. */
int paged_decode(const void *q, const void *k, const void *v, const int64_t *tables,
                 const int64_t *lens, void *out, int B, int max_blocks, int block_size,
                 int kv_heads, int group, int D, float scale, int threads, int bf16, int kvc) {
    const int split = B < 2 * threads ? kv_heads : 1, nh = kv_heads / split;
    if (D > MAX_D || nh * group > MAX_ROWS) return -1;
    const size_t es = bf16 ? 2 : 4, task_q = (size_t)nh * group * D * es;
    int (*fn)(const char *, const char *, const char *, const int64_t *, int64_t, char *, int, int,
              int, int, int, int, float, int, int) = D == 64 ? attend_d64 : D == 128 ? attend_d128 : attend_any;
    int err = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int task = 0; task < B * split; task++) {
        const int b = task / split, h0 = task % split * nh;
        if (fn((const char *)q + task * task_q, k, v, tables + (int64_t)b * max_blocks, lens[b],
               (char *)out + task * task_q, block_size, kv_heads, h0, nh, group, D, scale, bf16, kvc))
            err = -2;
    }
    return err;
}
