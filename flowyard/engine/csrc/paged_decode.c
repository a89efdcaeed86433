/* Paged decode attention on the CPU, reading K/V blocks where they lie in the cache.
 *
 * One task per (sequence, KV head): the query heads sharing that KV head ride together, so
 * each K and V row is loaded (and widened to float32) once for all of them. Scores, softmax
 * and the weighted sum run in float32; the output is rounded once to the cache's type. Tasks
 * are spread over the OpenMP threads of the process (PyTorch's own libgomp, see
 * paged_kernel.py).
 *
 * With AVX-512 (head_dim a multiple of 16) a task makes one pass over its K and V, 16 tokens
 * at a time, flash-decoding style: the tile's 16 dot products per query row are reduced together
 * by a transpose-add tree (no per-token horizontal sum), an online softmax keeps a running max
 * and sum per row and rescales the output accumulators when the max grows, and the tile's V rows
 * are added right after its K rows. K and V are widened in registers (bf16 q and K use
 * AVX512_BF16's dot product, still summed in float32), q and the accumulators stay in registers,
 * and the next tile's blocks are prefetched while one is worked on: about 2x the three-pass
 * kernel, near the memory's bandwidth for bf16 caches (benchmarks/results/paged_kernel_speed.md).
 * Elsewhere the portable C below does the same math in three passes (scores, softmax, weighted
 * sum).
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

#if defined(__AVX512F__)
#include <immintrin.h>

#define TILE 16  /* tokens per step of the one-pass kernel: one score per lane */
#define AHEAD 1  /* tiles whose rows are prefetched ahead of the one worked on (1 to 3 measure alike) */

/* 16 elements of a cache row -> float32. bf16: the top half of a float. e5m2: as in widen(),
 * but the sign-extended byte shifted by 21 puts copies of the sign on bits 31..28, and the AND
 * keeps bit 31 and the 7 exponent/mantissa bits; the caller multiplies by 2^112 (for V it is
 * folded into the softmax weights, once per tile instead of once per element). */
static inline __m512 load16(const char *p, int kvc) {
    if (kvc == 1)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (kvc == 2)
        return _mm512_castsi512_ps(_mm512_and_si512(
            _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)), 21),
            _mm512_set1_epi32((int)0x8FE00000u)));
    return _mm512_loadu_ps((const float *)p);
}

/* Transpose-add tree: 16 partial-sum vectors (slots) -> one vector of their 16 sums, 15 adds
 * and their shuffles instead of 16 horizontal sums. Each step halves the lanes per slot; the
 * result holds slot i + 4k in element 4i + k, so tile_rows puts token 4i + k in slot i + 4k. */
static inline __m512 fold1(__m512 a, __m512 b) {  /* 256-bit halves: a's 8 sums, b's 8 sums */
    return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 3, 2)));
}
static inline __m512 fold2(__m512 ab, __m512 cd) {  /* 128-bit lane i: token i's 4 sums */
    return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline __m512 fold3(__m512 u, __m512 w) {  /* lane i: 2 sums of u's token, 2 of w's */
    return _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, u, w),
                         _mm512_shuffle_ps(u, w, _MM_SHUFFLE(1, 0, 3, 2)));
}
static inline __m512 fold4(__m512 x, __m512 y) {  /* element 4i + k: slot i + 4k's sum */
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* exp(x) for x <= 0, ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), a degree-7
 * Taylor polynomial for e^r, and scalef for 2^n (which gives 0, not garbage, far below -87). */
static inline __m512 exp512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Prefetch cursor over the lines of a tile's rows (K and V alike) */
struct pf { const char *k, *v; const size_t *o; int lpr, j, b, left; };
static inline void pf_step(struct pf *p, int n) {
    for (; n > 0 && p->left > 0; n--, p->left--) {
        _mm_prefetch(p->k + p->o[p->j] + 64 * p->b, _MM_HINT_T0);
        _mm_prefetch(p->v + p->o[p->j] + 64 * p->b, _MM_HINT_T0);
        if (++p->b == p->lpr) p->b = 0, p->j++;
    }
}

/* How a copy of tile_rows reads K: the cache's dtype code (0-2), or one of these */
#define K_BF16_DOT 3  /* bf16 q and K: _mm512_dpbf16_ps on the raw pairs, float32 sums */
#define K_FP8_QREBIAS 4  /* fp8 K with its 2^112 rebias folded into q (one multiply fewer) */

/* One tile (nt <= 16 tokens) of one KV head for G <= 4 of its query rows (q pre-scaled, rows
 * MAX_D apart, like acc; l holds 16 lanes per row): scores, online softmax, weighted sum of V.
 * K and V rows are widened in registers, and q, the partial sums and the accumulators stay in
 * registers: G is a constant in each copy. */static inline __attribute__((always_inline)) void tile_rows(
        const char *const *kr, const char *const *vr, int nt, struct pf *pf, int pfn, int first,
        const float *qf, const uint16_t *qh, float qscale, float *acc, float *m, float *l, const int D,
        const int kmode, const int G) {
    const int C = D / 16, kvc = kmode == K_BF16_DOT ? 1 : kmode == K_FP8_QREBIAS ? 2 : kmode;
    const size_t kes = esize(kvc);
    const __mmask16 live = (__mmask16)((1u << nt) - 1);
    /* fp8 rows come out 2^-112 small (load16): K's are rebiased as they are widened or through q
     * (their products with q would be subnormal, and every subnormal result costs a microcode
     * assist), V's through the weights p, which keeps the products in range. */
    const __m512 rebias = _mm512_set1_ps(0x1p112f);
    const float vscale = kvc == 2 ? 0x1p112f : 1.f;
    /* scores: token 4i + quad goes to slot 4 quad + i, so that the tree's output is in token order */
    __m512 u[4][4];
    for (int quad = 0; quad < 4; quad++) {
        pf_step(pf, pfn);
        __m512 t[2][4];
        for (int pair = 0; pair < 2; pair++) {
            __m512 P[2][4];
            for (int e = 0; e < 2; e++) {
                const int j = 4 * (2 * pair + e) + quad;
                if (j >= nt) {  /* past the context: a zero score, masked below */
                    for (int g = 0; g < G; g++) P[e][g] = _mm512_setzero_ps();
                    continue;
                }
#if defined(__AVX512BF16__)
                if (kmode == K_BF16_DOT) {  /* 32 products per instruction, no widening */
                    for (int g = 0; g < G; g++) {
                        __m512 d = _mm512_setzero_ps();
                        for (int c = 0; c < C / 2; c++)
                            d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_load_si512(qh + g * MAX_D + 32 * c),
                                                 (__m512bh)_mm512_loadu_si512(kr[j] + 64 * c));
                        P[e][g] = d;
                    }
                    continue;
                }
#endif
                __m512 kv[MAX_D / 16];
                for (int c = 0; c < C; c++) {
                    kv[c] = load16(kr[j] + 16 * c * kes, kvc);
                    if (kmode == 2) kv[c] = _mm512_mul_ps(kv[c], rebias);
                }
                for (int g = 0; g < G; g++) {
                    __m512 d = _mm512_mul_ps(_mm512_load_ps(qf + g * MAX_D), kv[0]);
                    for (int c = 1; c < C; c++) d = _mm512_fmadd_ps(_mm512_load_ps(qf + g * MAX_D + 16 * c), kv[c], d);
                    P[e][g] = d;
                }
            }
            for (int g = 0; g < G; g++) t[pair][g] = fold1(P[0][g], P[1][g]);
        }
        for (int g = 0; g < G; g++) u[quad][g] = fold2(t[0][g], t[1][g]);
    }
    float pw[4][TILE] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {  /* online softmax */
        __m512 sc = fold4(fold3(u[0][g], u[1][g]), fold3(u[2][g], u[3][g]));
        if (kmode == K_BF16_DOT) sc = _mm512_mul_ps(sc, _mm512_set1_ps(qscale));
        float *ag = acc + g * MAX_D, *lg = l + g * TILE;
        /* the max is reduced only when a lane exceeds it: after the first tiles, rarely */
        if (first) {
            m[g] = _mm512_mask_reduce_max_ps(live, sc);
        } else if (_mm512_mask_cmp_ps_mask(live, sc, _mm512_set1_ps(m[g]), _CMP_GT_OQ)) {
            const float mt = _mm512_mask_reduce_max_ps(live, sc);
            const __m512 a = _mm512_set1_ps(expf(m[g] - mt));  /* rescale the sums so far */
            for (int c = 0; c < C; c++) _mm512_store_ps(ag + 16 * c, _mm512_mul_ps(a, _mm512_load_ps(ag + 16 * c)));
            _mm512_store_ps(lg, _mm512_mul_ps(a, _mm512_load_ps(lg)));
            m[g] = mt;
        }
        const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_maskz_sub_ps(live, sc, _mm512_set1_ps(m[g]))));
        _mm512_store_ps(lg, _mm512_add_ps(p, _mm512_load_ps(lg)));
        _mm512_store_ps(pw[g], _mm512_mul_ps(p, _mm512_set1_ps(vscale)));
    }
    pf_step(pf, pfn);
    __m512 a[4][MAX_D / 16];  /* weighted sum of V */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) a[g][c] = _mm512_load_ps(acc + g * MAX_D + 16 * c);
    for (int j = 0; j < nt; j++) {
        __m512 vv[MAX_D / 16];
        for (int c = 0; c < C; c++) vv[c] = load16(vr[j] + 16 * c * kes, kvc);
        for (int g = 0; g < G; g++) {
            const __m512 pj = _mm512_set1_ps(pw[g][j]);
            for (int c = 0; c < C; c++) a[g][c] = _mm512_fmadd_ps(pj, vv[c], a[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) _mm512_store_ps(acc + g * MAX_D + 16 * c, a[g][c]);
}

/* The one-pass kernel for heads h0 .. h0 + nh - 1 of one sequence (D a multiple of 16): tile by
 * tile, head by head, the head's query rows four at a time (tile_rows). Instantiated below for
 * D = 64 and 128 (constant trip counts, everything in registers) and any other D. */
static inline __attribute__((always_inline)) int attend16(
        const char *q, const char *k, const char *v, const int64_t *table, int64_t L, char *out,
        int block_size, int kv_heads, int h0, int nh, int group, const int D, float scale, int bf16,
        const int kvc) {
    const size_t es = bf16 ? 2 : 4, hb = (size_t)D * esize(kvc);
    const size_t tok = (size_t)kv_heads * hb, blk = (size_t)block_size * tok;
    const int R = nh * group;
    float qf[MAX_ROWS][MAX_D] __attribute__((aligned(64)));
    uint16_t qh[MAX_ROWS][MAX_D] __attribute__((aligned(64)));  /* q's bf16 bits (K_BF16_DOT) */
    float acc[MAX_ROWS][MAX_D] __attribute__((aligned(64)));
    float l[MAX_ROWS][TILE] __attribute__((aligned(64))), m[MAX_ROWS];  /* running sum, max */
    size_t ring[AHEAD + 1][TILE];  /* byte offsets of the rows (head h0) of the tiles in flight */
    float qmax = 0.f;
    for (int r = 0; r < R; r++) {
        widen(q + (size_t)r * D * es, qf[r], D, bf16);
        for (int d = 0; d < D; d++) qf[r][d] *= scale, qmax = fmaxf(qmax, fabsf(qf[r][d]));
        if (bf16) memcpy(qh[r], q + (size_t)r * D * es, sizeof(uint16_t) * (size_t)D);
        memset(acc[r], 0, sizeof(float) * (size_t)D);
        memset(l[r], 0, sizeof(l[r]));
    }
    /* K's reading: bf16 q and cache take the dot-product instruction where there is one; fp8
     * folds the rebias into q unless that could overflow (|q| * scale >= 2^14: never in practice) */
#if defined(__AVX512BF16__)
    const int dot = kvc == 1 && bf16 && D % 32 == 0;
#else
    const int dot = 0;
#endif
    const int qrebias = kvc == 2 && qmax < 0x1p14f;
    if (qrebias)
        for (int r = 0; r < R; r++)
            for (int d = 0; d < D; d++) qf[r][d] *= 0x1p112f;
    const int64_t tiles = (L + TILE - 1) / TILE;
    int64_t bi = 0, bo = 0;  /* block index and row of the next token to locate: no divisions */
    for (int64_t ti = -AHEAD; ti < tiles; ti++) {
        /* locate the rows of tile ta, to be prefetched while tile ti is worked on (struct pf) */
        const int64_t ta = ti + AHEAD;
        const int na = ta >= tiles ? 0 : L - ta * TILE < TILE ? (int)(L - ta * TILE) : TILE;
        size_t *o = ring[ta % (AHEAD + 1)];
        for (int j = 0; j < na; j++) {  /* a tile may span blocks (block_size 8) */
            o[j] = (size_t)table[bi] * blk + (size_t)bo * tok + (size_t)h0 * hb;
            if (++bo == block_size) bo = 0, bi++;
        }
        struct pf pf = {k, v, o, (int)((nh * hb + 63) / 64), 0, 0, 0};
        pf.left = na * pf.lpr;
        if (ti < 0) {  /* the first tiles: nothing to overlap with */
            pf_step(&pf, pf.left);
            continue;
        }
        const int pfn = (pf.left + 5 * nh - 1) / (5 * nh);  /* lines per step: 5 steps per head */
        const int64_t t0 = ti * TILE;
        const int nt = L - t0 < TILE ? (int)(L - t0) : TILE;
        const size_t *off = ring[ti % (AHEAD + 1)];
        for (int hh = 0; hh < nh; hh++) {
            const char *kr[TILE], *vr[TILE];
            for (int j = 0; j < nt; j++) kr[j] = k + off[j] + hh * hb, vr[j] = v + off[j] + hh * hb;
            for (int g0 = 0; g0 < group; g0 += 4) {
                const int r = hh * group + g0, n = group - g0 < 4 ? group - g0 : 4;
#define ROWS(KM, G) tile_rows(kr, vr, nt, &pf, g0 ? 0 : pfn, t0 == 0, qf[r], qh[r], scale, acc[r], \
                             m + r, l[r], D, KM, G)
#define ROWS_G(KM) if (n == 4) ROWS(KM, 4); else if (n == 3) ROWS(KM, 3); else if (n == 2) ROWS(KM, 2); \
                   else ROWS(KM, 1)
                if (kvc == 1 && dot) ROWS_G(K_BF16_DOT);
                else if (kvc == 2 && qrebias) ROWS_G(K_FP8_QREBIAS);
                else ROWS_G(kvc);
#undef ROWS_G
#undef ROWS
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(l[r]));
        for (int d = 0; d < D; d++) acc[r][d] *= inv;
        narrow(acc[r], out + (size_t)r * D * es, D, bf16);
    }
    return 0;
}

#define ATTEND16(NAME, DIM, KVC)                                                                  \
    static int NAME(const char *q, const char *k, const char *v, const int64_t *table, int64_t L,  \
                    char *out, int block_size, int kv_heads, int h0, int nh, int group, int D,     \
                    float scale, int bf16, int kvc) {                                              \
        (void)D;                                                                                   \
        (void)kvc;                                                                                 \
        return attend16(q, k, v, table, L, out, block_size, kv_heads, h0, nh, group, DIM, scale,   \
                        bf16, KVC);                                                                \
    }
ATTEND16(attend16_d64_f32, 64, 0)
ATTEND16(attend16_d64_bf16, 64, 1)
ATTEND16(attend16_d64_fp8, 64, 2)
ATTEND16(attend16_d128_f32, 128, 0)
ATTEND16(attend16_d128_bf16, 128, 1)
ATTEND16(attend16_d128_fp8, 128, 2)
ATTEND16(attend16_any_f32, D, 0)
ATTEND16(attend16_any_bf16, D, 1)
ATTEND16(attend16_any_fp8, D, 2)
#endif

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
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        typeof(fn) f16[3][3] = {{attend16_d64_f32, attend16_d64_bf16, attend16_d64_fp8},
                                {attend16_d128_f32, attend16_d128_bf16, attend16_d128_fp8},
                                {attend16_any_f32, attend16_any_bf16, attend16_any_fp8}};
        fn = f16[D == 64 ? 0 : D == 128 ? 1 : 2][kvc];
    }
#endif
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
