/* y (M, N) = x (M, K) @ W^T (+ bias) for a few rows M (1..4), bfloat16 in and out, float32
 * accumulation, rounded to bfloat16 (round to nearest even) once per output element.
 *
 * Decode linears are memory-bound: every weight is read once per step and each weight row is
 * dotted with all M input rows while it is in registers, so M rows cost one pass over W.
 * With AVX512_BF16, four weight rows are in flight at once (four independent load streams and
 * 4 * M accumulators), 32 bf16 pairs per vdpbf16ps; the sixteen lanes of the four rows'
 * accumulators are reduced together (hsum4) and four outputs stored at a time. Other CPUs get
 * a plain C loop the compiler vectorises. N is split across OpenMP threads in static chunks.
 * gemv_w8 is the same for int8 weights with a scale per output row (--quantization int8/w8a8):
 * half the bytes of bfloat16, widened to float32 in registers, so still one pass over W.
 * See flowyard/engine/gemv_kernel.py for why and for measurements.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One output of the int8 kernel for all M rows: the portable path and the N % 4 tail. */
static void tail_w8(const float *xf, long K, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
                    uint16_t *y, long ldy, long n, int M) {
    const int8_t *wr = w + n * K;
    for (int m = 0; m < M; m++) {
        const float *xr = xf + m * K;
        float acc = 0.0f;
        for (long k = 0; k < K; k++) acc += xr[k] * (float)wr[k];
        y[m * ldy + n] = f32_to_bf16(acc * bf16_to_f32(scale[n]) + (bias ? bf16_to_f32(bias[n]) : 0.0f));
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMV_IMPL 1

/* The sums of a, b, c and d's sixteen lanes each, as one 4-lane vector [a, b, c, d]. */
static inline __attribute__((always_inline)) __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#ifndef PF_BLOCKS
#define PF_BLOCKS 2
#endif
#define LOADBH(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))
#define LOADBH_MASK(m, p) ((__m512bh)_mm512_maskz_loadu_epi16((m), (const void *)(p)))

/* Outputs n..n+3 for all M rows. */
static inline __attribute__((always_inline)) void block4(
    const uint16_t *x, long ldx, const uint16_t *w, long K, const uint16_t *bias, uint16_t *y,
    long ldy, long n, const int M) {
    __m512 acc[4][4];
    for (int m = 0; m < 4; m++)
        for (int r = 0; r < 4; r++) acc[m][r] = _mm512_setzero_ps();
    const uint16_t *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    long k = 0;
    const long pf = PF_BLOCKS * 4 * K;  /* prefetch the rows PF_BLOCKS blocks ahead */
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w0 + pf + k), _MM_HINT_T1);
        _mm_prefetch((const char *)(w1 + pf + k), _MM_HINT_T1);
        _mm_prefetch((const char *)(w2 + pf + k), _MM_HINT_T1);
        _mm_prefetch((const char *)(w3 + pf + k), _MM_HINT_T1);
        __m512bh a0 = LOADBH(w0 + k), a1 = LOADBH(w1 + k), a2 = LOADBH(w2 + k), a3 = LOADBH(w3 + k);
        for (int m = 0; m < M; m++) {
            __m512bh xv = LOADBH(x + m * ldx + k);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, a0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, a1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xv, a2);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xv, a3);
        }
    }
    if (k < K) {
        __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh a0 = LOADBH_MASK(mk, w0 + k), a1 = LOADBH_MASK(mk, w1 + k);
        __m512bh a2 = LOADBH_MASK(mk, w2 + k), a3 = LOADBH_MASK(mk, w3 + k);
        for (int m = 0; m < M; m++) {
            __m512bh xv = LOADBH_MASK(mk, x + m * ldx + k);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, a0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, a1);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xv, a2);
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], xv, a3);
        }
    }
    __m128 b = _mm_setzero_ps();
    if (bias) b = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(bias + n))), 16));
    for (int m = 0; m < M; m++) {
        __m128 s = _mm_add_ps(hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), b);
        __m128bh o = _mm_cvtneps_pbh(s);
        _mm_storel_epi64((__m128i *)(y + m * ldy + n), (__m128i)o);
    }
}

/* Output n for all M rows (the N % 4 tail). */
static void block1(const uint16_t *x, long ldx, const uint16_t *w, long K, const uint16_t *bias,
                   uint16_t *y, long ldy, long n, int M) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const uint16_t *w0 = w + n * K;
    for (long k = 0; k < K; k += 32) {
        __mmask32 mk = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);
        __m512bh a0 = LOADBH_MASK(mk, w0 + k);
        for (int m = 0; m < M; m++) acc[m] = _mm512_dpbf16_ps(acc[m], LOADBH_MASK(mk, x + m * ldx + k), a0);
    }
    for (int m = 0; m < M; m++) {
        float s = _mm512_reduce_add_ps(acc[m]) + (bias ? bf16_to_f32(bias[n]) : 0.0f);
        y[m * ldy + n] = f32_to_bf16(s);
    }
}

static void rows(const uint16_t *x, long ldx, const uint16_t *w, long K, const uint16_t *bias,
                 uint16_t *y, long ldy, long n0, long n1, int M) {
    long n = n0;
    switch (M) {  /* a constant M per loop, so block4 unrolls it */
    case 1: for (; n + 4 <= n1; n += 4) block4(x, ldx, w, K, bias, y, ldy, n, 1); break;
    case 2: for (; n + 4 <= n1; n += 4) block4(x, ldx, w, K, bias, y, ldy, n, 2); break;
    case 3: for (; n + 4 <= n1; n += 4) block4(x, ldx, w, K, bias, y, ldy, n, 3); break;
    default: for (; n + 4 <= n1; n += 4) block4(x, ldx, w, K, bias, y, ldy, n, 4); break;
    }
    for (; n < n1; n++) block1(x, ldx, w, K, bias, y, ldy, n, M);
}

/* int8 weights (per-output-row scale): widen 16 codes to float32 and FMA with x, widened once
 * per call into xf (M rows of K floats). Four weight rows in flight, as block4. */
static inline __attribute__((always_inline)) void block4_w8(
    const float *xf, long K, const int8_t *w, const uint16_t *scale, const uint16_t *bias, uint16_t *y,
    long ldy, long n, const int M) {
    __m512 acc[4][4];
    for (int m = 0; m < 4; m++)
        for (int r = 0; r < 4; r++) acc[m][r] = _mm512_setzero_ps();
    const int8_t *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const long pf = PF_BLOCKS * 4 * K;
    for (long k = 0; k < K; k += 16) {
        __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        if ((k & 63) == 0) {
            _mm_prefetch((const char *)(w0 + pf + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(w1 + pf + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(w2 + pf + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(w3 + pf + k), _MM_HINT_T1);
        }
        __m512 a0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, w0 + k)));
        __m512 a1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, w1 + k)));
        __m512 a2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, w2 + k)));
        __m512 a3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, w3 + k)));
        for (int m = 0; m < M; m++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, xf + m * K + k);
            acc[m][0] = _mm512_fmadd_ps(xv, a0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(xv, a1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(xv, a2, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(xv, a3, acc[m][3]);
        }
    }
    __m128 sc = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(scale + n))), 16));
    __m128 b = _mm_setzero_ps();
    if (bias) b = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(bias + n))), 16));
    for (int m = 0; m < M; m++) {
        __m128 s = _mm_fmadd_ps(hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), sc, b);
        __m128bh o = _mm_cvtneps_pbh(s);
        _mm_storel_epi64((__m128i *)(y + m * ldy + n), (__m128i)o);
    }
}

static void rows_w8(const float *xf, long K, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
                    uint16_t *y, long ldy, long n0, long n1, int M) {
    long n = n0;
    switch (M) {
    case 1: for (; n + 4 <= n1; n += 4) block4_w8(xf, K, w, scale, bias, y, ldy, n, 1); break;
    case 2: for (; n + 4 <= n1; n += 4) block4_w8(xf, K, w, scale, bias, y, ldy, n, 2); break;
    case 3: for (; n + 4 <= n1; n += 4) block4_w8(xf, K, w, scale, bias, y, ldy, n, 3); break;
    default: for (; n + 4 <= n1; n += 4) block4_w8(xf, K, w, scale, bias, y, ldy, n, 4); break;
    }
    for (; n < n1; n++) tail_w8(xf, K, w, scale, bias, y, ldy, n, M);
}

#else
#define GEMV_IMPL 0

/* Portable: widen to float and let the compiler vectorise the k loop. */
static void rows(const uint16_t *x, long ldx, const uint16_t *w, long K, const uint16_t *bias,
                 uint16_t *y, long ldy, long n0, long n1, int M) {
    for (long n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        float s[4] = {0, 0, 0, 0};
        for (int m = 0; m < M; m++) {
            const uint16_t *xr = x + m * ldx;
            float acc = 0.0f;
            for (long k = 0; k < K; k++) acc += bf16_to_f32(xr[k]) * bf16_to_f32(wr[k]);
            s[m] = acc;
        }
        float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
        for (int m = 0; m < M; m++) y[m * ldy + n] = f32_to_bf16(s[m] + b);
    }
}

static void rows_w8(const float *xf, long K, const int8_t *w, const uint16_t *scale, const uint16_t *bias,
                    uint16_t *y, long ldy, long n0, long n1, int M) {
    for (long n = n0; n < n1; n++) tail_w8(xf, K, w, scale, bias, y, ldy, n, M);
}
#endif

/* Which implementation this build has: 1 AVX512_BF16, 0 portable C. */
int gemv_bf16_impl(void) { return GEMV_IMPL; }

/* Threads worth forking for N outputs (a small N is not worth a fork). */
static int team(long N, int threads) {
    if (threads < 1) threads = 1;
    return N / 4 < 8L * threads ? 1 : threads;
}

/* Thread t of nt's share [n0, n1) of the N outputs, in whole blocks of four. */
static void share(long N, int t, int nt, long *n0, long *n1) {
    long blocks = N / 4;
    *n0 = 4 * (blocks * t / nt);
    *n1 = t == nt - 1 ? N : 4 * (blocks * (t + 1) / nt);
}

#ifndef _OPENMP
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif

/* x: M rows of K bf16, row stride ldx (elements); w: (N, K) contiguous; bias: N or NULL;
 * y: (M, N) contiguous. Returns 0, or -1 for arguments it does not take. */
int gemv_bf16(const void *x, long ldx, const void *w, const void *bias, void *y, int M, long N,
              long K, int threads) {
    if (M < 1 || M > 4 || N < 1 || K < 1 || ldx < K) return -1;
    const int nt = team(N, threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        long n0, n1;
        share(N, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        rows((const uint16_t *)x, ldx, (const uint16_t *)w, K, (const uint16_t *)bias, (uint16_t *)y, N, n0,
             n1, M);
    }
    return 0;
}

/* As gemv_bf16 with int8 weights w (N, K) times a bfloat16 scale per output row: y = (x @ w^T)
 * * scale (+ bias). xf: a caller-owned buffer of at least M * K floats for x widened once. */
int gemv_w8(const void *x, long ldx, const void *w, const void *scale, const void *bias, void *y, int M,
            long N, long K, float *xf, int threads) {
    if (M < 1 || M > 4 || N < 1 || K < 1 || ldx < K || !scale || !xf) return -1;
    const uint16_t *xs = (const uint16_t *)x;
    for (int m = 0; m < M; m++)
        for (long k = 0; k < K; k++) xf[m * K + k] = bf16_to_f32(xs[m * ldx + k]);
    const int nt = team(N, threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        long n0, n1;
        share(N, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        rows_w8(xf, K, (const int8_t *)w, (const uint16_t *)scale, (const uint16_t *)bias, (uint16_t *)y, N,
                n0, n1, M);
    }
    return 0;
}
