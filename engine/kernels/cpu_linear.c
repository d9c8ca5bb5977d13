/* Small-batch linear layers on the CPU: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * Decode reads every weight once per token, so the CPU side of a plan is bound by how fast it streams
 * weights from DRAM. This kernel keeps the weights in their own precision (bf16, fp16 or fp32), multiplies
 * them with the activations in float32 (16 lanes with AVX-512, bf16 pairs through AVX512-BF16's dot product
 * where the CPU has it, 8 lanes with AVX2 and FMA), accumulates in float32 and rounds the result once to
 * the output precision, as a BLAS call would. A build with none of these leaves matmuls to PyTorch.
 *
 * Work is cut into chunks of rows that a small pthread pool of its own claims from a shared counter:
 * workers spin briefly after a job (consecutive matmuls of one layer follow each other within
 * microseconds) and then sleep on a condition variable, so an idle engine costs no CPU.
 *
 * Built on the machine that runs it (`-O3 -march=native`), see engine/kernels/__init__.py.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_THREADS 256
#define MAX_BATCH 1024  /* matmuls in one sl_linear_batch call */
#define ROWS 4      /* output rows computed together (one activation load feeds four weight rows) */
#define MTILE 4     /* tokens computed together */
/* Rows of fewer elements than this prefetch the next row block's same columns as they go: on a MoE
 * expert's matrices (2048 and 768 elements a row, 3-6 MB each) the hardware prefetcher retrains at every
 * block of ROWS short rows. On two cores here a 768-element matrix read 13-15 GB/s at one row without it
 * and 20-21 with it, and a Qwen3-30B-A3B layer's 8 routed experts took 3.7-4.4 ms without and 3.2-3.6
 * with; 4096-element rows showed no gain (engine.bench.cpu_matmul, engine.bench.moe_cpu_experts,
 * docs/benchmarks/README.md, session 9). */
#define SHORT_ROW 4096
/* Longer rows prefetch their own reads `pf_words` elements ahead (past a row's end: the next row block's same
 * row), `sl_set_prefetch`; 0 turns it off. On two cores of an AMD EPYC with AVX512-BF16 (session 27,
 * docs/benchmarks/cpu_prefetch/long_rows/) the hardware prefetcher alone left a Llama-3-8B down projection
 * [4096, 14336] at 38 GB/s for one token, its gate/up [28672, 4096] at 22 GB/s for four, and the
 * transfer-coded matmul at 22-23 GB/s of weights; 512 elements ahead read 47, 39, and 39-45. */
#define PF_WORDS_DEFAULT 512
static int pf_words = PF_WORDS_DEFAULT;

/* The element `pf` past column k of a row of K, counted from that row's start: in the row, or past its end
 * in the same row of the next row block (ROWS rows on). */
static inline int64_t pf_offset(int64_t K, int64_t k, int64_t pf) {
    int64_t c = k + pf;
    return c < K ? c : (int64_t)ROWS * K + c - K;
}

/* ---- scalar conversions ------------------------------------------------------------------------- */
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
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) { u = sign; }
        else {
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            u = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) { u = sign | 0x7f800000u | (man << 13); }
    else { u = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    /* portable round-to-nearest-even conversion */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000;
    int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t man = u & 0x7fffff;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = 1u << (shift - 1), rest = man & ((1u << shift) - 1), r = man >> shift;
        if (rest > half || (rest == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = (uint32_t)(exp << 10) | (man >> 13), rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
#endif
}

/* ---- dot products of ROWS weight rows with up to MTILE activation rows ------------------------- */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* A bf16 matrix [N, K] in transfer-coded form (engine/sharding/transfer_code.py), read in place by the
 * matmul: every row lies in one coded chunk (chunks end only at row ends), chunk c holds rows from
 * first_row[c] on as low bytes and 4-bit codes (sign and the exponent's top bits as an offset from
 * base[c]; 7: an escape, its word in the sub-layer's escape block, whose positions count words from the
 * sub-layer's start). */
typedef struct {
    int64_t n_chunks;
    const int64_t *first_row;    /* ascending, first_row[0] = 0 */
    const uint8_t *const *lo;    /* per chunk: the low byte of each word, from its first row on */
    const uint8_t *const *nib;   /* per chunk: the codes, two a byte (word 2i low), from its first row on */
    const uint8_t *base;         /* per chunk */
    const int32_t *esc_pos;      /* ascending */
    const uint16_t *esc_val;
    int64_t n_esc;
    int64_t word0;               /* the matrix's first word in the sub-layer */
} coded_mat;

typedef struct {
    int dtype;
    const void *x, *w, *bias;
    void *y;
    int64_t M, N, K;
    const uint32_t *xp;   /* x packed for the AMX tiles (amx_prepare), or NULL */
    const coded_mat *cw;  /* the weights transfer-coded (bf16, AVX512-BF16 only; w unused), or NULL */
} linear_job;

static inline float load_elem(int dtype, const void *p, int64_t i) {
    if (dtype == DT_F32) return ((const float *)p)[i];
    if (dtype == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store_elem(int dtype, void *p, int64_t i, float v) {
    if (dtype == DT_F32) ((float *)p)[i] = v;
    else if (dtype == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((uint16_t *)p)[i] = f32_to_f16(v);
}

#if defined(__AVX512F__)
/* 16 lanes of weights (or activations) as float32, masked past the row's end */
static inline __m512 load16(int dtype, const void *p, int64_t k, __mmask16 m) {
    if (dtype == DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + k);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + k);
    if (dtype == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* float32 -> bf16 bits (low 16 of each lane), round to nearest even, NaN quieted (as f32_to_bf16) */
static inline __m512i bf16_round_bits(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_srli_epi32(r, 16);
}

/* acc[r][t] over k in [0, K): the generic AVX-512 path (fp32 FMA after widening) */
static inline __attribute__((always_inline)) void
dots_avx512_impl(int dtype, const void *x, const void *w, int64_t K, const int nr, const int nt, int64_t n0,
                 float out[ROWS][MTILE]) {
    size_t es = dtype == DT_F32 ? 4 : 2;
    __m512 acc[ROWS][MTILE];
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < MTILE; t++) acc[r][t] = _mm512_setzero_ps();
    const char *wb = (const char *)w + (size_t)n0 * K * es;
    const int64_t pf = pf_words;
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[MTILE];
        for (int t = 0; t < nt; t++) xv[t] = load16(dtype, (const char *)x + (size_t)t * K * es, k, m);
        for (int r = 0; r < nr; r++) {
            __m512 wv = load16(dtype, wb + (size_t)r * K * es, k, m);
            if (K < SHORT_ROW) _mm_prefetch(wb + ((size_t)(r + ROWS) * K + k) * es, _MM_HINT_T0);
            else if (pf) _mm_prefetch(wb + ((size_t)r * K + pf_offset(K, k, pf)) * es, _MM_HINT_T0);
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* CPUs with AVX2 and FMA but no AVX-512 (most desktop Intel parts, AMD before Zen 4). Without this path
 * such a build multiplied element by element: on two cores here, built for Haswell, a bf16 matrix of
 * Llama-3-8B's FFN at one token read 2.7 GB/s, PyTorch held to AVX2 15-18, this path 21.9
 * (docs/benchmarks/cpu_avx2/). */
static inline __m256 load8(int dtype, const void *p, int64_t k) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)p + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
    if (dtype == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#if defined(__F16C__)
    return _mm256_cvtph_ps(h);
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = f16_to_f32(((const uint16_t *)p)[k + i]);
    return _mm256_loadu_ps(f);
#endif
}

/* the last n < 8 elements of a row from k, zero past them (AVX2 masks no 16-bit loads) */
static inline __m256 load8_tail(int dtype, const void *p, int64_t k, int64_t n) {
    size_t es = dtype == DT_F32 ? 4 : 2;
    float buf[8] = {0};
    memcpy(buf, (const char *)p + (size_t)k * es, (size_t)n * es);
    return load8(dtype, buf, 0);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* acc[r][t] over k in [0, K): 8 lanes widened to float32 and FMA, as dots_avx512_impl with 16 */
static inline __attribute__((always_inline)) void
dots_avx2_impl(int dtype, const void *x, const void *w, int64_t K, const int nr, const int nt, int64_t n0,
               float out[ROWS][MTILE]) {
    size_t es = dtype == DT_F32 ? 4 : 2;
    __m256 acc[ROWS][MTILE];
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < MTILE; t++) acc[r][t] = _mm256_setzero_ps();
    const char *wb = (const char *)w + (size_t)n0 * K * es;
    const int64_t pf = pf_words, line = 64 / (int64_t)es, full = K & ~(int64_t)7;
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[MTILE];
        const int tail = k >= full;
        for (int t = 0; t < nt; t++) {
            const char *xt = (const char *)x + (size_t)t * K * es;
            xv[t] = tail ? load8_tail(dtype, xt, k, K - k) : load8(dtype, xt, k);
        }
        for (int r = 0; r < nr; r++) {
            const char *wr = wb + (size_t)r * K * es;
            __m256 wv = tail ? load8_tail(dtype, wr, k, K - k) : load8(dtype, wr, k);
            if (k % line == 0) {       /* (a prefetch a cache line, as the AVX-512 path's) */
                if (K < SHORT_ROW) _mm_prefetch(wb + ((size_t)(r + ROWS) * K + k) * es, _MM_HINT_T0);
                else if (pf) _mm_prefetch(wb + ((size_t)r * K + pf_offset(K, k, pf)) * es, _MM_HINT_T0);
            }
            for (int t = 0; t < nt; t++) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) out[r][t] = hsum8(acc[r][t]);
}
#define HAVE_DOTS_AVX2 1
#endif

#if defined(__AVX512BF16__)
/* bf16 x bf16 pairs multiplied exactly and summed in float32 by vdpbf16ps: half the instructions of the
 * widening path, so the kernel stays bound by DRAM, not by the conversion. */
static inline __attribute__((always_inline)) void
dots_bf16_dp_impl(const void *x, const void *w, int64_t K, const int nr, const int nt, int64_t n0,
                  float out[ROWS][MTILE]) {
    __m512 acc[ROWS][MTILE];
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < MTILE; t++) acc[r][t] = _mm512_setzero_ps();
    const uint16_t *wb = (const uint16_t *)w + (size_t)n0 * K;
    const int64_t pf = pf_words;
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[MTILE];
        for (int t = 0; t < nt; t++)
            xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)x + (size_t)t * K + k);
        for (int r = 0; r < nr; r++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, wb + (size_t)r * K + k);
            if (K < SHORT_ROW) _mm_prefetch((const char *)(wb + (size_t)(r + ROWS) * K + k), _MM_HINT_T0);
            else if (pf) _mm_prefetch((const char *)(wb + (size_t)r * K + pf_offset(K, k, pf)), _MM_HINT_T0);
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv[t], wv);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

#if defined(__AVX512BF16__)
static uint16_t coded_escape(const coded_mat *cm, int64_t pos) {
    int64_t lo = 0, hi = cm->n_esc - 1;
    while (lo <= hi) {
        int64_t mid = (lo + hi) / 2;
        if (cm->esc_pos[mid] < pos) lo = mid + 1;
        else if (cm->esc_pos[mid] > pos) hi = mid - 1;
        else return cm->esc_val[mid];
    }
    return 0;   /* (not reached: every escape code has its word) */
}

/* 32 words of row `row` from word k: the low bytes as they are, the high bytes rebuilt from the codes,
 * escapes taken from the escape block; lanes past K are zero. The same words as the raw matrix holds. */
static inline int64_t coded_chunk_of(const coded_mat *cm, int64_t row) {
    int64_t c = cm->n_chunks - 1;
    while (c > 0 && cm->first_row[c] > row) c--;
    return c;
}

static inline __attribute__((always_inline)) __m512i
coded_words(const coded_mat *cm, int64_t row, int64_t K, int64_t k, __mmask32 m) {
    int64_t c = coded_chunk_of(cm, row), rr = row - cm->first_row[c];
    const uint8_t *lo = cm->lo[c] + rr * K + k, *nb = cm->nib[c] + (rr * K + k) / 2;
    __mmask16 mn = K - k >= 32 ? (__mmask16)0xffff : (__mmask16)((1u << ((K - k + 1) / 2)) - 1);
    __m512i lo16 = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, lo));
    __m512i t = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mn, nb));
    __m512i code = _mm512_or_si512(_mm512_and_si512(t, _mm512_set1_epi32(0xF)),
                                   _mm512_slli_epi32(_mm512_and_si512(t, _mm512_set1_epi32(0xF0)), 12));
    __m512i off = _mm512_and_si512(code, _mm512_set1_epi16(7));
    __m512i hi = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(code, _mm512_set1_epi16(8)), 12),
                                 _mm512_slli_epi16(_mm512_add_epi16(off, _mm512_set1_epi16(cm->base[c])), 8));
    __m512i w = _mm512_maskz_mov_epi16(m, _mm512_or_si512(hi, lo16));
    __mmask32 esc = _mm512_cmpeq_epi16_mask(off, _mm512_set1_epi16(7)) & m;
    if (esc) {
        uint16_t tmp[32];
        _mm512_storeu_si512(tmp, w);
        int64_t at = cm->word0 + row * K + k;
        for (int i = 0; i < 32; i++)
            if (esc >> i & 1) tmp[i] = coded_escape(cm, at + i);
        w = _mm512_loadu_si512(tmp);
    }
    return w;
}

#if defined(__AVX512VBMI__)
/* One row's coded bytes and the table of its chunk's high bytes (code -> byte; escapes 0), found once per
 * row block, not per 64 words. */
typedef struct {
    const uint8_t *lo, *nib;
    __m512i lut;
} coded_row;

static inline __attribute__((always_inline)) coded_row coded_row_at(const coded_mat *cm, int64_t row, int64_t K) {
    int64_t c = coded_chunk_of(cm, row), rr = row - cm->first_row[c];
    uint8_t t[16];
    int b = cm->base[c];
    for (int i = 0; i < 7; i++) {
        t[i] = (uint8_t)(b + i);
        t[8 + i] = (uint8_t)(0x80 | (b + i));
    }
    t[7] = t[15] = 0;
    coded_row r = {cm->lo[c] + rr * K, cm->nib[c] + rr * K / 2,
                   _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t))};
    return r;
}

/* 64 words of a row from word k at once, as two vectors of 32 in order (byte permutes: the codes
 * interleaved, their high bytes from the row's table, then low and high bytes interleaved). */
static inline __attribute__((always_inline)) void
coded_words64(const coded_mat *cm, const coded_row *cr, int64_t row, int64_t K, int64_t k, __m512i *w0,
              __m512i *w1) {
    int64_t left = K - k;
    __mmask64 ml = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    __mmask32 mn = left >= 64 ? ~(__mmask32)0 : (__mmask32)((1ull << ((left + 1) / 2)) - 1);
    __m256i n = left >= 64 ? _mm256_loadu_si256((const __m256i *)(cr->nib + k / 2))
                           : _mm256_maskz_loadu_epi8(mn, cr->nib + k / 2);
    __m256i ev = _mm256_and_si256(n, _mm256_set1_epi8(0x0F));
    __m256i od = _mm256_and_si256(_mm256_srli_epi16(n, 4), _mm256_set1_epi8(0x0F));
    const __m512i ci = _mm512_set_epi8(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                       55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16,
                                       47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    __m512i code = _mm512_permutexvar_epi8(ci, _mm512_inserti64x4(_mm512_castsi256_si512(ev), od, 1));
    __m512i hi = _mm512_shuffle_epi8(cr->lut, code);
    __m512i l = left >= 64 ? _mm512_loadu_si512(cr->lo + k) : _mm512_maskz_loadu_epi8(ml, cr->lo + k);
    const __m512i i0 = _mm512_set_epi8(95, 31, 94, 30, 93, 29, 92, 28, 91, 27, 90, 26, 89, 25, 88, 24,
                                       87, 23, 86, 22, 85, 21, 84, 20, 83, 19, 82, 18, 81, 17, 80, 16,
                                       79, 15, 78, 14, 77, 13, 76, 12, 75, 11, 74, 10, 73, 9, 72, 8,
                                       71, 7, 70, 6, 69, 5, 68, 4, 67, 3, 66, 2, 65, 1, 64, 0);
    const __m512i i1 = _mm512_add_epi8(i0, _mm512_set1_epi8(32));
    __m512i a = _mm512_permutex2var_epi8(l, i0, hi), z = _mm512_permutex2var_epi8(l, i1, hi);
    __mmask64 esc = _mm512_cmpeq_epi8_mask(_mm512_or_si512(code, _mm512_set1_epi8(8)), _mm512_set1_epi8(15)) & ml;
    if (__builtin_expect(esc != 0, 0)) {
        uint16_t tmp[64];
        _mm512_storeu_si512(tmp, a);
        _mm512_storeu_si512(tmp + 32, z);
        int64_t at = cm->word0 + row * K + k;
        for (__mmask64 e = esc; e; e &= e - 1) {
            int i = __builtin_ctzll(e);
            tmp[i] = coded_escape(cm, at + i);
        }
        a = _mm512_loadu_si512(tmp);
        z = _mm512_loadu_si512(tmp + 32);
    }
    *w0 = a;
    *w1 = z;
}
#endif

/* dots_bf16_dp_impl over a coded matrix: the same products in the same order, so the same bits. */
static inline __attribute__((always_inline)) void
dots_coded_impl(const void *x, const coded_mat *cm, int64_t K, const int nr, const int nt, int64_t n0,
                float out[ROWS][MTILE]) {
    __m512 acc[ROWS][MTILE];
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < MTILE; t++) acc[r][t] = _mm512_setzero_ps();
#if defined(__AVX512VBMI__)
    coded_row rows[ROWS];
    for (int r = 0; r < nr; r++) rows[r] = coded_row_at(cm, n0 + r, K);
    const int64_t pf = pf_words;
    for (int64_t k = 0; k < K; k += 64) {
        int64_t left = K - k;
        __mmask32 m0 = left >= 32 ? ~(__mmask32)0 : (__mmask32)((1ull << left) - 1);
        __mmask32 m1 = left >= 64 ? ~(__mmask32)0 : left > 32 ? (__mmask32)((1ull << (left - 32)) - 1) : 0;
        __m512bh x0[MTILE], x1[MTILE];
        for (int t = 0; t < nt; t++) {
            x0[t] = (__m512bh)_mm512_maskz_loadu_epi16(m0, (const uint16_t *)x + (size_t)t * K + k);
            x1[t] = (__m512bh)_mm512_maskz_loadu_epi16(m1, (const uint16_t *)x + (size_t)t * K + k + 32);
        }
        for (int r = 0; r < nr; r++) {
            __m512i w0, w1;
            if (pf) {         /* (a row's two streams: its low bytes, a line a step, and its codes, half one) */
                int64_t ahead = pf_offset(K, k, pf);
                _mm_prefetch((const char *)(rows[r].lo + ahead), _MM_HINT_T0);
                if ((k & 127) == 0) _mm_prefetch((const char *)(rows[r].nib + ahead / 2), _MM_HINT_T0);
            }
            coded_words64(cm, &rows[r], n0 + r, K, k, &w0, &w1);
            w0 = _mm512_maskz_mov_epi16(m0, w0);     /* (lanes past K: zero, as the raw kernel loads them) */
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], x0[t], (__m512bh)w0);
            if (m1) {
                w1 = _mm512_maskz_mov_epi16(m1, w1);
                for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], x1[t], (__m512bh)w1);
            }
        }
    }
#else
    const int64_t pf = pf_words;
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[MTILE];
        for (int t = 0; t < nt; t++)
            xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)x + (size_t)t * K + k);
        for (int r = 0; r < nr; r++) {
            if (pf && (k & 63) == 0) {     /* (as the byte-permute path: a line of low bytes, half one of codes) */
                int64_t c = coded_chunk_of(cm, n0 + r), rr = n0 + r - cm->first_row[c], ahead = pf_offset(K, k, pf);
                _mm_prefetch((const char *)(cm->lo[c] + rr * K + ahead), _MM_HINT_T0);
                if ((k & 127) == 0) _mm_prefetch((const char *)(cm->nib[c] + (rr * K + ahead) / 2), _MM_HINT_T0);
            }
            __m512bh wv = (__m512bh)coded_words(cm, n0 + r, K, k, m);
            for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv[t], wv);
        }
    }
#endif
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

/* Full row blocks get compile-time tile sizes, so the accumulators stay in registers. */
#define DISPATCH(CALL)                                                                                    \
    do {                                                                                                  \
        if (nr == ROWS) {                                                                                 \
            switch (nt) {                                                                                 \
            case 1: CALL(ROWS, 1); break;                                                                 \
            case 2: CALL(ROWS, 2); break;                                                                 \
            case 3: CALL(ROWS, 3); break;                                                                 \
            default: CALL(ROWS, MTILE); break;                                                            \
            }                                                                                             \
        } else {                                                                                          \
            CALL(nr, nt);                                                                                 \
        }                                                                                                 \
    } while (0)

#if defined(__AVX512F__)
static void dots_avx512(int dtype, const void *x, const void *w, int64_t K, int nr, int nt, int64_t n0,
                        float out[ROWS][MTILE]) {
#define AVX512_CALL(R, T) dots_avx512_impl(dtype, x, w, K, R, T, n0, out)
    DISPATCH(AVX512_CALL);
}
#endif

#if defined(__AVX512BF16__)
static void dots_bf16_dp(const void *x, const void *w, int64_t K, int nr, int nt, int64_t n0,
                         float out[ROWS][MTILE]) {
#define BF16_CALL(R, T) dots_bf16_dp_impl(x, w, K, R, T, n0, out)
    DISPATCH(BF16_CALL);
}

static void dots_coded(const void *x, const coded_mat *cm, int64_t K, int nr, int nt, int64_t n0,
                       float out[ROWS][MTILE]) {
#define CODED_CALL(R, T) dots_coded_impl(x, cm, K, R, T, n0, out)
    DISPATCH(CODED_CALL);
}
#endif

#if defined(HAVE_DOTS_AVX2)
static void dots_avx2(int dtype, const void *x, const void *w, int64_t K, int nr, int nt, int64_t n0,
                      float out[ROWS][MTILE]) {
#define AVX2_CALL(R, T) dots_avx2_impl(dtype, x, w, K, R, T, n0, out)
    DISPATCH(AVX2_CALL);
}
#endif

static __attribute__((unused)) void dots_scalar(int dtype, const void *x, const void *w, int64_t K, int nr, int nt, int64_t n0,
                        float out[ROWS][MTILE]) {
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < nt; t++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++)
                s += load_elem(dtype, w, (n0 + r) * K + k) * load_elem(dtype, x, (int64_t)t * K + k);
            out[r][t] = s;
        }
}

/* ---- AMX tiles for matmuls of many rows (bf16) ----------------------------------------------------
 * From MIN_AMX_ROWS rows (a prompt's routed experts: about 32 rows each at 512 tokens), the dot products
 * above grow with the rows and the kernel stops being bound by DRAM. Where the CPU has AMX (and the OS
 * lends the tile state: sl_amx_ready), such a matmul runs on the tile unit instead: 32 weight rows (two
 * A tiles, read as they lie in memory) against 32 tokens (two B tiles: the activations packed into pairs
 * of k once per job, before its rows are shared out: amx_prepare), into four float32 accumulator tiles: C^T = W X^T, 16 x 16 each, then rounded
 * once to bf16 as the vector path rounds. The tile configuration is loaded at the start of every run and
 * released at its end, so another library's tile use on the same thread (oneDNN inside PyTorch) never
 * meets a stale configuration. */
#define MIN_AMX_ROWS 17          /* fewer rows keep the vector path (and its bits: a batch's decode) */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_state = -1;                    /* -1 not asked, 0 unusable, 1 ready */
static uint32_t *amx_buf;                     /* the packed activations of the current job's matmuls */
static size_t amx_buf_cap;                    /* (in uint32; one job at a time: the Python side's lock) */
#define AMX_KEEP (16u << 20)                  /* a larger buffer is given back after its job */

static inline int64_t amx_blocks(int64_t M) { return (M + 31) / 32; }

static void amx_begin(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

/* Block b (tokens 32b .. 32b+31) of x [M, K] (bf16) as pairs of k: xp[kp * 32 + t] = (x[32b+t][2kp],
 * x[32b+t][2kp+1]), tokens past M zero; the block starts at j->xp + b * K / 2 * 32. */
static void amx_pack_block(const linear_job *j, int64_t b) {
    const int64_t K2 = j->K / 2, m0 = 32 * b;
    const int mc = (int)(j->M - m0 < 32 ? j->M - m0 : 32);
    const uint32_t *src = (const uint32_t *)j->x + m0 * K2;
    uint32_t *dst = (uint32_t *)j->xp + b * K2 * 32;
    for (int64_t kp = 0; kp < K2; kp++) {
        uint32_t *d = dst + kp * 32;
        int t = 0;
        for (; t < mc; t++) d[t] = src[t * K2 + kp];
        for (; t < 32; t++) d[t] = 0;
    }
}

typedef struct {
    const linear_job *jobs;
    const int64_t *first;     /* jobs[i]'s blocks are chunks first[i] .. first[i+1]-1 */
    int n_jobs;
} amx_pack_plan;

static void amx_pack_chunk(const void *arg, int64_t c) {
    const amx_pack_plan *p = (const amx_pack_plan *)arg;
    int lo = 0, hi = p->n_jobs - 1;           /* the job whose blocks hold chunk c */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (p->first[mid] <= c) lo = mid;
        else hi = mid - 1;
    }
    amx_pack_block(&p->jobs[lo], c - p->first[lo]);
}

/* y[m0 + t][n0 + r] for r < 16 * NB weight rows from n0, t < mc tokens, from the accumulator tiles */
static inline void amx_store(const float c[2][2][16 * 16], int NB, const linear_job *j, int64_t n0, int64_t m0,
                             int mc) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (int a = 0; a < NB; a++) {
        __m512 bias = j->bias ? load16(DT_BF16, j->bias, n0 + 16 * a, 0xffff) : _mm512_setzero_ps();
        for (int t = 0; t < mc; t++) {
            /* column t of tile (a, t / 16): the 16 weight rows' outputs for token t */
            __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(t % 16)), c[a][t / 16], 4);
            v = _mm512_add_ps(v, bias);
            _mm256_storeu_si256((__m256i *)((uint16_t *)j->y + (m0 + t) * j->N + n0 + 16 * a),
                                _mm512_cvtepi32_epi16(bf16_round_bits(v)));
        }
    }
}

/* 16 * NB weight rows from n0 against the 32 packed tokens (NB 1 or 2) */
static inline __attribute__((always_inline)) void amx_block(const linear_job *j, const uint32_t *xp, int64_t n0,
                                                            const int NB, float c[2][2][16 * 16]) {
    const uint16_t *w = (const uint16_t *)j->w + n0 * j->K;
    const int64_t K = j->K, stride = K * 2;
    _tile_zero(0);
    _tile_zero(1);
    if (NB == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(6, xp + k / 2 * 32, 128);
        _tile_loadd(7, xp + k / 2 * 32 + 16, 128);
        _tile_loadd(4, w + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (NB == 2) {
            _tile_loadd(5, w + 16 * K + k, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0][0], 64);
    _tile_stored(1, c[0][1], 64);
    if (NB == 2) {
        _tile_stored(2, c[1][0], 64);
        _tile_stored(3, c[1][1], 64);
    }
}

/* Rows [n_begin, n_end) of j (its x packed: amx_prepare) on the tiles, in blocks of 16; returns the first
 * row left (fewer than 16 at the end) for the vector path. Each block of 32 tokens in turn meets the
 * chunk's weight rows, which stay in the cache between blocks. */
static int64_t amx_rows(const linear_job *j, int64_t n_begin, int64_t n_end) {
    int64_t n_stop = n_begin + (n_end - n_begin) / 16 * 16;
    if (n_stop == n_begin) return n_begin;
    float c[2][2][16 * 16] __attribute__((aligned(64)));
    amx_begin();
    for (int64_t b = 0; b < amx_blocks(j->M); b++) {
        const uint32_t *xp = j->xp + b * (j->K / 2) * 32;
        int mc = (int)(j->M - 32 * b < 32 ? j->M - 32 * b : 32);
        for (int64_t n = n_begin; n < n_stop;) {
            if (n_stop - n >= 32) {
                amx_block(j, xp, n, 2, c);
                amx_store(c, 2, j, n, 32 * b, mc);
                n += 32;
            } else {
                amx_block(j, xp, n, 1, c);
                amx_store(c, 1, j, n, 32 * b, mc);
                n += 16;
            }
        }
    }
    _tile_release();
    return n_stop;
}

static inline int amx_applies(const linear_job *j) {
    return amx_state == 1 && !j->cw && j->dtype == DT_BF16 && j->M >= MIN_AMX_ROWS && j->K % 32 == 0;
}

static void run_pool(void (*task)(const void *, int64_t), const void *arg, int64_t chunks);

/* Packs the x of every job the tiles take (as one pool job where `pooled`) and points its xp there; a job
 * keeps xp NULL (the vector path) where there is no memory for it. */
static void amx_prepare(linear_job *jobs, int n_jobs, int pooled) {
    int64_t first[MAX_BATCH + 1], at = 0, chunks = 0;
    size_t words = 0;
    for (int i = 0; i < n_jobs; i++)
        if (amx_applies(&jobs[i])) words += (size_t)amx_blocks(jobs[i].M) * (jobs[i].K / 2) * 32;
    if (words > amx_buf_cap) {
        free(amx_buf);
        amx_buf = aligned_alloc(64, (words * 4 + 63) / 64 * 64);
        amx_buf_cap = amx_buf ? words : 0;
    }
    if (!amx_buf) return;
    for (int i = 0; i < n_jobs; i++) {
        first[i] = chunks;
        if (!amx_applies(&jobs[i])) continue;
        jobs[i].xp = amx_buf + at;
        at += amx_blocks(jobs[i].M) * (jobs[i].K / 2) * 32;
        chunks += amx_blocks(jobs[i].M);
    }
    first[n_jobs] = chunks;
    amx_pack_plan plan = {jobs, first, n_jobs};
    if (pooled) {
        run_pool(amx_pack_chunk, &plan, chunks);
    } else {
        for (int64_t c = 0; c < chunks; c++) amx_pack_chunk(&plan, c);
    }
}

static void amx_done(void) {
    if (amx_buf_cap * 4 > AMX_KEEP) {
        free(amx_buf);
        amx_buf = NULL;
        amx_buf_cap = 0;
    }
}

/* Whether the tile path is in use: asks the OS for the tile state once (Linux's arch_prctl) and checks a
 * product against the vector path's arithmetic; 1 ready, 0 not. Call before the pool runs any job. */
int sl_amx_ready(void) {
    if (amx_state >= 0) return amx_state;
    amx_state = 0;
    if (syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) != 0) return 0;
    enum { TM = 40, TN = 48, TK = 64 };
    static uint16_t x[TM * TK], w[TN * TK], y[TM * TN];
    for (int i = 0; i < TM * TK; i++) x[i] = f32_to_bf16((float)((i * 7) % 13 - 6) / 8.0f);
    for (int i = 0; i < TN * TK; i++) w[i] = f32_to_bf16((float)((i * 5) % 11 - 5) / 16.0f);
    linear_job j = {DT_BF16, x, w, NULL, y, TM, TN, TK, NULL};
    amx_state = 1;
    amx_prepare(&j, 1, 0);
    int64_t left = j.xp ? amx_rows(&j, 0, TN) : 0;
    amx_done();
    amx_state = 0;
    if (left != TN) return 0;
    for (int m = 0; m < TM; m++)
        for (int n = 0; n < TN; n++) {
            float s = 0.0f;           /* small integers over powers of two: every order sums exactly */
            for (int k = 0; k < TK; k++) s += bf16_to_f32(x[m * TK + k]) * bf16_to_f32(w[n * TK + k]);
            if (y[m * TN + n] != f32_to_bf16(s)) return 0;
        }
    amx_state = 1;
    return 1;
}
#else
static inline int amx_applies(const linear_job *j) { (void)j; return 0; }
static int64_t amx_rows(const linear_job *j, int64_t n_begin, int64_t n_end) { (void)j; (void)n_end; return n_begin; }
static void amx_prepare(linear_job *jobs, int n_jobs, int pooled) { (void)jobs; (void)n_jobs; (void)pooled; }
static void amx_done(void) {}
int sl_amx_ready(void) { return 0; }
#endif

static void linear_rows(const linear_job *j, int64_t n_begin, int64_t n_end) {
    size_t es = j->dtype == DT_F32 ? 4 : 2;
    float out[ROWS][MTILE];
    if (j->xp) n_begin = amx_rows(j, n_begin, n_end);   /* (the rest: fewer than 16 rows) */
    /* rows outside, tokens inside: a block of ROWS weight rows is read from DRAM once and reused from the
     * cache for every tile of tokens */
    for (int64_t n = n_begin; n < n_end; n += ROWS) {
        int nr = (int)(n_end - n < ROWS ? n_end - n : ROWS);
        for (int64_t m0 = 0; m0 < j->M; m0 += MTILE) {
            int nt = (int)(j->M - m0 < MTILE ? j->M - m0 : MTILE);
            const void *xm = (const char *)j->x + (size_t)m0 * j->K * es;
#if defined(__AVX512BF16__)
            if (j->cw) dots_coded(xm, j->cw, j->K, nr, nt, n, out);
            else if (j->dtype == DT_BF16) dots_bf16_dp(xm, j->w, j->K, nr, nt, n, out);
            else dots_avx512(j->dtype, xm, j->w, j->K, nr, nt, n, out);
#elif defined(__AVX512F__)
            dots_avx512(j->dtype, xm, j->w, j->K, nr, nt, n, out);
#elif defined(HAVE_DOTS_AVX2)
            dots_avx2(j->dtype, xm, j->w, j->K, nr, nt, n, out);
#else
            dots_scalar(j->dtype, xm, j->w, j->K, nr, nt, n, out);
#endif
            for (int r = 0; r < nr; r++) {
                float b = j->bias ? load_elem(j->dtype, j->bias, n + r) : 0.0f;
                for (int t = 0; t < nt; t++) store_elem(j->dtype, j->y, (m0 + t) * j->N + n + r, out[r][t] + b);
            }
        }
    }
}

/* ---- the thread pool ---------------------------------------------------------------------------- */
/* A job is cut into chunks of whole ROWS blocks (about CHUNK_BYTES of weights each) that the caller and
 * the workers claim one at a time from a shared counter, so a thread that wakes late (a sleeping worker on
 * a virtual machine, a core taken by a game) only claims fewer chunks: the job ends when its chunks are
 * done, not when the last thread has woken. The counter carries the job's number in its high half; a
 * claim is a compare-and-swap against that number, so a worker that wakes after its job has ended never
 * touches the next one's chunks through stale fields. */
#define CHUNK_BYTES (256 * 1024)

static struct {
    int n;                       /* threads including the caller */
    pthread_t th[MAX_THREADS];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint gen;             /* bumped once per job */
    atomic_ullong next;          /* (job number << 32) | next chunk to claim */
    atomic_llong done;           /* chunks finished in the current job */
    atomic_int stop;
    void (*task)(const void *arg, int64_t chunk);   /* the current job: runs one of its chunks */
    const void *arg;
    int64_t chunks;
    int spin;                    /* pause instructions a worker spins before sleeping */
    unsigned start_gen;          /* gen when the workers were created: a job may be posted before they run */
} pool = {0, {0}, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL, 0, 20000, 0};

#ifdef SL_POOL_TEST
/* Test builds only (tests/engine/test_pool_race.py): stalls that hold the pool's race windows open. A worker
 * that finds every chunk of its job claimed waits `worker_stall_us` before it compares again; the caller
 * waits `post_stall_us` between setting a new job's fields and publishing its counter. */
#include <unistd.h>
static atomic_int test_worker_stall_us, test_post_stall_us;
static __thread int pool_worker;
#endif

/* Claim and run chunks of job `job_no` until none is left (or another job is current). */
static void run_chunks(unsigned job_no) {
    for (;;) {
        unsigned long long v = atomic_load_explicit(&pool.next, memory_order_acquire);
        if ((unsigned)(v >> 32) != job_no) return;
        int64_t c = (int64_t)(v & 0xffffffffu);
#ifdef SL_POOL_TEST
        if (pool_worker && c >= pool.chunks && atomic_load(&test_worker_stall_us))
            usleep((useconds_t)atomic_load(&test_worker_stall_us));
#endif
        if (c >= pool.chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.next, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* the job cannot end before this chunk is done, so its fields stay valid */
        pool.task(pool.arg, c);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_acq_rel);
    }
}

static void *worker(void *arg) {
    (void)arg;
#ifdef SL_POOL_TEST
    pool_worker = 1;
#endif
    unsigned seen = pool.start_gen;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen && spins < pool.spin) {
            CPU_RELAX();
            spins++;
        }
        if (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen) {
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.gen) == seen && !atomic_load(&pool.stop)) pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        if (atomic_load(&pool.stop)) return NULL;
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);   /* the current job, even if some were missed */
        run_chunks(seen);
    }
}

static void pool_stop(void) {
    if (pool.n <= 1) { pool.n = 1; return; }
    pthread_mutex_lock(&pool.mu);
    atomic_store(&pool.stop, 1);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 1; i < pool.n; i++) pthread_join(pool.th[i], NULL);
    atomic_store(&pool.stop, 0);
    pool.n = 1;
}

/* How far ahead a long row's reads are prefetched, in elements (0: not at all; negative: unchanged); returns
 * the distance in use. */
int sl_set_prefetch(int words) {
    if (words >= 0) pf_words = words;
    return pf_words;
}

/* (Re)start the pool with `threads` threads (the caller counts as one); returns the count in use. */
int sl_set_threads(int threads, int spin) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (spin >= 0) pool.spin = spin;
    if (threads == pool.n) return pool.n;
    pool_stop();
    pool.n = threads;
    pool.start_gen = atomic_load(&pool.gen);
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&pool.th[i], NULL, worker, NULL) != 0) {
            pool.n = i;
            break;
        }
    }
    return pool.n;
}

/* Runs `task(arg, c)` for c in [0, chunks) on the pool (the caller takes chunks too); returns when all
 * are done. */
static void run_pool(void (*task)(const void *, int64_t), const void *arg, int64_t chunks) {
    unsigned job_no = atomic_load(&pool.gen) + 1;
    /* Close the last job's counter before its fields change: a worker that read `next` while that job was
     * current (every chunk claimed) and is about to compare its chunk number with `pool.chunks` would
     * otherwise see this job's larger count, win its compare-and-swap on the old value and run a chunk past
     * the old job's end (a garbage job pointer: a general protection fault in a worker) and count it
     * done in this job. With the counter at "this job, nothing to claim" first, that swap fails. */
    atomic_store_explicit(&pool.next, ((unsigned long long)job_no << 32) | 0xffffffffull, memory_order_seq_cst);
    atomic_thread_fence(memory_order_seq_cst);
    pool.task = task;
    pool.arg = arg;
    pool.chunks = chunks;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
#ifdef SL_POOL_TEST
    if (atomic_load(&test_post_stall_us)) usleep((useconds_t)atomic_load(&test_post_stall_us));
#endif
    atomic_store_explicit(&pool.next, (unsigned long long)job_no << 32, memory_order_release);
    pthread_mutex_lock(&pool.mu);
    atomic_store_explicit(&pool.gen, job_no, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_chunks(job_no);
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks; spins++) {
        CPU_RELAX();
        if (spins > 4096) sched_yield();   /* a chunk's thread was preempted (a loaded machine): let it run */
    }
}

/* n_jobs matmuls of one shape, chunked as one job: chunk c is rows of matmul c / per */
typedef struct {
    const linear_job *jobs;
    int64_t rows, per;
} linear_plan;

static void linear_chunk(const void *arg, int64_t c) {
    const linear_plan *p = (const linear_plan *)arg;
    const linear_job *j = &p->jobs[c / p->per];
    int64_t n0 = (c % p->per) * p->rows;
    linear_rows(j, n0, n0 + p->rows < j->N ? n0 + p->rows : j->N);
}

/* Runs `n_jobs` matmuls of one shape (N, K) and dtype as one pool job. */
static int run_jobs(linear_job *jobs, int n_jobs) {
    if (pool.n == 0) sl_set_threads(1, -1);
    int64_t N = jobs[0].N, K = jobs[0].K;
    size_t es = jobs[0].dtype == DT_F32 ? 4 : 2;
    int small = pool.n <= 1 || N * K * n_jobs < (1 << 16);   /* too small to be worth waking the pool */
    int64_t q = ROWS;                                  /* chunks of whole row blocks */
    for (int i = 0; i < n_jobs && q == ROWS; i++)
        if (amx_applies(&jobs[i])) q = 32;             /* (the tiles' blocks: their x packed first) */
    if (q == 32) amx_prepare(jobs, n_jobs, !small);
    if (small) {
        for (int i = 0; i < n_jobs; i++) linear_rows(&jobs[i], 0, N);
        if (q == 32) amx_done();
        return 0;
    }
    int64_t rows = (int64_t)(CHUNK_BYTES / ((size_t)(K > 0 ? K : 1) * es));
    rows = rows < q ? q : rows / q * q;
    int64_t per = (N + rows - 1) / rows;
    if (per * n_jobs < 4 * pool.n && N > q) {          /* small matrices: smaller chunks, so all threads share */
        int64_t want = (N * n_jobs + 4 * pool.n - 1) / (4 * pool.n);
        rows = want < q ? q : (want + q - 1) / q * q;
        per = (N + rows - 1) / rows;
    }
    linear_plan plan = {jobs, rows, per};
    run_pool(linear_chunk, &plan, per * n_jobs);
    if (q == 32) amx_done();
    return 0;
}

/* y = x @ w.T (+ bias); dtype 0 fp32, 1 bf16, 2 fp16; all arrays contiguous, row-major. */
int sl_linear(int dtype, const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
              int64_t K) {
    if (dtype < 0 || dtype > 2 || M < 0 || N < 0 || K < 0) return -1;
    linear_job j = {dtype, x, w, bias, y, M, N, K, NULL, NULL};
    return run_jobs(&j, 1);
}

/* y = x @ w.T (+ bias) for a bf16 matrix in transfer-coded form (`coded_mat`), the same bits as sl_linear
 * over the raw matrix; -1 where it does not apply (no AVX512-BF16, an odd K). */
int sl_linear_coded(const void *x, const coded_mat *cw, const void *bias, void *y, int64_t M, int64_t N,
                    int64_t K) {
#if defined(__AVX512BF16__)
    if (M < 0 || N < 0 || K < 0 || K % 2 || !cw || cw->n_chunks < 1 || cw->first_row[0] != 0) return -1;
    linear_job j = {DT_BF16, x, NULL, bias, y, M, N, K, NULL, cw};
    return run_jobs(&j, 1);
#else
    (void)x; (void)cw; (void)bias; (void)y; (void)M; (void)N; (void)K;
    return -1;
#endif
}

int sl_coded_ready(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* y[i] = x[i] @ w[i].T for i < n_jobs, every w[i] [N, K] and x[i] [M[i], K] (the experts a step routes
 * to: one pool job instead of one per expert). No bias. */
int sl_linear_batch(int dtype, int n_jobs, const void *const *x, const void *const *w, void *const *y,
                    const int64_t *M, int64_t N, int64_t K) {
    if (dtype < 0 || dtype > 2 || n_jobs < 0 || n_jobs > MAX_BATCH || N < 0 || K < 0) return -1;
    if (n_jobs == 0 || N == 0) return 0;
    linear_job jobs[MAX_BATCH];
    for (int i = 0; i < n_jobs; i++) {
        if (M[i] < 0) return -1;
        linear_job j = {dtype, x[i], w[i], NULL, y[i], M[i], N, K, NULL, NULL};
        jobs[i] = j;
    }
    return run_jobs(jobs, n_jobs);
}

/* out[j] = start[j] + y[i][j] * wt[i] for i = 0 .. m-1 in turn (j < N; start NULL: zero; start may be out):
 * each step in float32, rounded to the dtype (bf16 or fp16) before the next, as m calls of PyTorch's
 * out.addcmul_(y[i], wt[i]) do; a MoE layer adds its experts' weighted outputs to their sum this way, in
 * ascending expert order. The product of two 16-bit values is exact in float32, so a fused and a separate
 * multiply-add give the same sums. */
static inline float round_to(int dtype, float v) {
    return dtype == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
}

int sl_weighted_sum(int dtype, void *out, const void *start, const void *y, const void *wt, int64_t m, int64_t N) {
    if ((dtype != DT_BF16 && dtype != DT_F16) || m < 0 || N < 0) return -1;
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__F16C__)
    for (; j + 16 <= N; j += 16) {
        __m512 acc = start ? load16(dtype, start, j, 0xffff) : _mm512_setzero_ps();
        for (int64_t i = 0; i < m; i++) {
            __m512 p = _mm512_mul_ps(load16(dtype, (const uint16_t *)y + i * N, j, 0xffff),
                                     _mm512_set1_ps(load_elem(dtype, wt, i)));
            acc = _mm512_add_ps(acc, p);
            if (dtype == DT_BF16) {        /* rounded to bf16 after every step, as one addcmul_ each would */
                acc = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round_bits(acc), 16));
            } else {
                acc = _mm512_cvtph_ps(_mm512_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
        }
        if (dtype == DT_BF16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + j),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(acc), 16)));
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + j),
                                _mm512_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; j < N; j++) {
        float acc = start ? load_elem(dtype, start, j) : 0.0f;
        for (int64_t i = 0; i < m; i++) {
            float p = load_elem(dtype, y, i * N + j) * load_elem(dtype, wt, i);
            acc = round_to(dtype, acc + p);
        }
        store_elem(dtype, out, j, acc);
    }
    return 0;
}

typedef struct {
    int dtype;
    void *out;
    const void *y;
    const int64_t *rows;
    int64_t m, N, cols;       /* columns per chunk */
} scatter_job;

static void scatter_cols(const scatter_job *s, int64_t j0, int64_t j1) {
    const int dtype = s->dtype;
    const int64_t N = s->N;
    size_t es = dtype == DT_F32 ? 4 : 2;
    for (int64_t i = 0; i < s->m; i++) {
        char *o = (char *)s->out + (size_t)s->rows[i] * N * es;
        const char *src = (const char *)s->y + (size_t)i * N * es;
        int64_t j = j0;
        if (dtype == DT_F32) {
            float *of = (float *)o;
            const float *sf = (const float *)src;
            for (; j < j1; j++) of[j] += sf[j];
            continue;
        }
#if defined(__AVX512F__) && defined(__F16C__)
        for (; j + 16 <= j1; j += 16) {
            __m512 acc = _mm512_add_ps(load16(dtype, o, j, 0xffff), load16(dtype, src, j, 0xffff));
            if (dtype == DT_BF16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)o + j), _mm512_cvtepi32_epi16(bf16_round_bits(acc)));
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)o + j),
                                    _mm512_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        for (; j < j1; j++) store_elem(dtype, o, j, load_elem(dtype, o, j) + load_elem(dtype, src, j));
    }
}

static void scatter_chunk(const void *arg, int64_t c) {
    const scatter_job *s = (const scatter_job *)arg;
    int64_t j0 = c * s->cols;
    scatter_cols(s, j0, j0 + s->cols < s->N ? j0 + s->cols : s->N);
}

/* out[rows[i]][j] += y[i][j] for i = 0 .. m-1 in turn (j < N), each add in float32 rounded to the dtype
 * before the next, as PyTorch's out.index_add_(0, rows[i:i+1], y[i:i+1]) one index at a time: a batch's
 * or a prompt's MoE step adds its routed pairs' weighted outputs (sorted by expert) to their tokens' sums
 * this way, each token's in ascending expert order. PyTorch's own index_add_ over all of them at once sums
 * a row's repeated 16-bit additions at a wider precision, and one call per expert cost a thread wake-up
 * each. With `pooled` (the caller holds the pool) a large one is cut by columns across the pool: every
 * element still takes its adds in the same order, so the bits do not depend on the threads. */
int sl_scatter_add(int dtype, void *out, const void *y, const int64_t *rows, int64_t m, int64_t N, int pooled) {
    if (dtype < 0 || dtype > 2 || m < 0 || N < 0) return -1;
    scatter_job s = {dtype, out, y, rows, m, N, N};
    if (!pooled || pool.n <= 1 || m * N < (1 << 18) || N < 256) {
        scatter_cols(&s, 0, N);
        return 0;
    }
    int64_t chunks = 4 * pool.n, cols = (N + chunks - 1) / chunks;
    cols = (cols + 63) / 64 * 64;            /* whole cache lines of 16-bit values per chunk */
    s.cols = cols;
    run_pool(scatter_chunk, &s, (N + cols - 1) / cols);
    return 0;
}

/* ---- paged decode attention --------------------------------------------------------------------- */
/* One new query token per sequence attends over its first L cached keys and values, read straight from the
 * paged pool through the sequence's block table (engine/sharding/kvcache.py): a decode step needs no
 * gathered copy of the context, and none of the dozen PyTorch ops a read and SDPA cost.
 *
 * Pools: k, v [n_blocks, KV_BLOCK, kv_heads, d], contiguous. Query head i reads KV head i / (heads /
 * kv_heads), as PyTorch's grouped attention does. Scores, softmax (max subtracted) and the weighted sum of
 * values run in float32; the output is rounded once to the dtype.
 *
 * Work items: (sequence, KV head, up to ATT_QG of its query heads, a chunk of keys). The heads of an item
 * share every key and value row it loads. A context longer than one chunk leaves each chunk's (max, sum,
 * weighted values) in a buffer and the item that finishes last merges them in chunk order, so the result
 * depends on neither the thread count nor which thread ran what. */
#define KV_BLOCK 16       /* tokens per block: BLOCK_SIZE in engine/sharding/kvcache.py */
#define ATT_CHUNK 256     /* most keys per work item (a multiple of KV_BLOCK) */
#define ATT_QG 8          /* query heads per work item */
#define ATT_MAX_D 256     /* head_dim limit: an item's scratch lives on its thread's stack */

typedef struct {
    int dtype;
    const void *const *q;                 /* per sequence: its query row of head 0 */
    void *const *out;                     /* per sequence: its output row of head 0 */
    const int64_t *const *tables;
    const int64_t *lengths;
    const void *k, *v;
    int64_t heads, kv_heads, d, q_stride, out_stride;   /* strides between heads, in elements */
    int64_t groups;                       /* items per KV head and chunk: ceil((heads / kv_heads) / ATT_QG) */
    float scale;
    int n_seqs;
    const int64_t *first;                 /* per sequence: its first item (n_seqs + 1 entries) */
    float *partial;                       /* per item: its heads' (max, sum, d values), `slot` floats; multi-chunk only */
    int64_t slot;
    atomic_int *pending;                  /* per (sequence, KV head, group): chunks not yet finished */
} attn_job;

#if defined(__AVX512F__)
/* exp(x) for x <= 0 within about an ulp: 2^n * e^r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);   /* exp(-104) is below float's range; NaN passes */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The 16 lane sums of v[0..15], lane t holding the sum of v[t]: a transposing tree of adds, a third of
 * the instructions of 16 separate reductions. */
static inline __m512 hsum16(__m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)       /* 256-bit halves: [v2i lo+hi, v2i+1 lo+hi] */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)       /* 128-bit block j: four partial sums of vector 4i + j */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)       /* block j: [x, y, x, y] of vectors 8i + j and 8i + j + 4 */
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
    /* block j, lane k: the total of vector j + 4k */
    __m512 t = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, t);
}

static inline void store16(int dtype, void *p, int64_t i, __m512 x, __mmask16 m) {
    if (dtype == DT_F32) _mm512_mask_storeu_ps((float *)p + i, m, x);
    else if (dtype == DT_BF16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(bf16_round_bits(x)));
    else _mm256_mask_storeu_epi16((uint16_t *)p + i, m,
                                  _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline __mmask16 tail16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* Scores of nq query heads against one block's 16 rows (rows past nt are read but masked later): sc[g][i]
 * = scale * q_g . k_i. krow: the block's row of token 0, rows `rs` elements apart. */
static void block_scores(const attn_job *j, const char *krow, int64_t rs, int nq, const void *const *qrow,
                         float qf[][ATT_MAX_D], float sc[][ATT_CHUNK], int at) {
    const int64_t d = j->d;
    const size_t es = j->dtype == DT_F32 ? 4 : 2;
#if defined(__AVX512BF16__)
    if (j->dtype == DT_BF16) {        /* bf16 pairs through vdpbf16ps, straight from the pool */
        for (int g = 0; g < nq; g++) {
            __m512 acc[16];
            for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 32) {
                __mmask32 m = d - c >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (d - c)) - 1);
                __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)qrow[g] + c);
                for (int t = 0; t < 16; t++)
                    acc[t] = _mm512_dpbf16_ps(acc[t], qv,
                        (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)(krow + (size_t)t * rs * 2) + c));
            }
            _mm512_storeu_ps(&sc[g][at], _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(j->scale)));
        }
        return;
    }
#endif
    /* widen the block's keys to float32 once; every head then reads them from L1 */
    float kf[16][ATT_MAX_D] __attribute__((aligned(64)));
    (void)qrow;
    for (int t = 0; t < 16; t++)
        for (int64_t c = 0; c < d; c += 16)
            _mm512_store_ps(&kf[t][c], load16(j->dtype, krow + (size_t)t * rs * es, c, tail16(d - c)));
    for (int g = 0; g < nq; g++) {
        __m512 acc[16];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
            __m512 qv = _mm512_load_ps(&qf[g][c]);
            for (int t = 0; t < 16; t++) acc[t] = _mm512_fmadd_ps(qv, _mm512_load_ps(&kf[t][c]), acc[t]);
        }
        _mm512_storeu_ps(&sc[g][at], _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(j->scale)));
    }
}

/* acc[g][:] += sum_t p[g][at + t] * v_t for the first nt rows of one block (NQ heads at once: one value
 * load feeds every head) */
static inline __attribute__((always_inline)) void
block_values_impl(int dtype, int64_t d, const char *vrow, int64_t rs, int nt, const int NQ,
                  float sc[][ATT_CHUNK], int at, float acc[][ATT_MAX_D]) {
    const size_t es = dtype == DT_F32 ? 4 : 2;
    for (int64_t c = 0; c < d; c += 16) {
        __mmask16 m = tail16(d - c);
        __m512 a[ATT_QG];
        for (int g = 0; g < NQ; g++) a[g] = _mm512_load_ps(&acc[g][c]);
        for (int t = 0; t < nt; t++) {
            __m512 v = load16(dtype, vrow + (size_t)t * rs * es, c, m);
            for (int g = 0; g < NQ; g++) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(sc[g][at + t]), v, a[g]);
        }
        for (int g = 0; g < NQ; g++) _mm512_store_ps(&acc[g][c], a[g]);
    }
}

static void block_values(const attn_job *j, const char *vrow, int64_t rs, int nt, int nq,
                         float sc[][ATT_CHUNK], int at, float acc[][ATT_MAX_D]) {
#define VALUES_CASE(N) case N: block_values_impl(j->dtype, j->d, vrow, rs, nt, N, sc, at, acc); break
    switch (nq) {
    VALUES_CASE(1); VALUES_CASE(2); VALUES_CASE(3); VALUES_CASE(4);
    VALUES_CASE(5); VALUES_CASE(6); VALUES_CASE(7); default: VALUES_CASE(8);
    }
#undef VALUES_CASE
}

/* softmax numerators of the first n scores of each head (max subtracted, in place); returns max and sum */
static void chunk_softmax(float sc[][ATT_CHUNK], int nq, int n, float *mx, float *sum) {
    for (int g = 0; g < nq; g++) {
        __m512 mm = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < n; i += 16) mm = _mm512_mask_max_ps(mm, tail16(n - i), mm, _mm512_loadu_ps(&sc[g][i]));
        float M = _mm512_reduce_max_ps(mm);
        __m512 s = _mm512_setzero_ps(), vm = _mm512_set1_ps(M);
        for (int i = 0; i < n; i += 16) {
            __mmask16 k = tail16(n - i);
            __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(&sc[g][i]), vm)));
            _mm512_storeu_ps(&sc[g][i], e);
            s = _mm512_add_ps(s, e);
        }
        mx[g] = M;
        sum[g] = _mm512_reduce_add_ps(s);
    }
}

/* out = acc / sum, rounded to the dtype */
static void store_row(int dtype, void *out, const float *acc, float sum, int64_t d) {
    __m512 inv = _mm512_set1_ps(sum);
    for (int64_t c = 0; c < d; c += 16)
        store16(dtype, out, c, _mm512_div_ps(_mm512_maskz_loadu_ps(tail16(d - c), acc + c), inv), tail16(d - c));
}
#else
/* Without AVX-512: plain C shaped for the compiler's vectorizer (an AVX2 build gets 8-lane FMA code): rows
 * widened to float32 scratch first, dot products in LANES partial sums, exp by a polynomial. */
#define LANES 8

/* row of `d` elements as float32, zero-padded to dp (a multiple of LANES) */
static void widen_row(int dtype, const void *src, float *dst, int64_t d, int64_t dp) {
    int64_t c = 0;
    if (dtype == DT_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)d);
        c = d;
    } else if (dtype == DT_BF16) {
        const uint16_t *h = (const uint16_t *)src;
        uint32_t *u = (uint32_t *)dst;
        for (; c < d; c++) u[c] = (uint32_t)h[c] << 16;
    } else {
        const uint16_t *h = (const uint16_t *)src;
#if defined(__F16C__)
        for (; c + 8 <= d; c += 8) _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + c))));
#endif
        for (; c < d; c++) dst[c] = f16_to_f32(h[c]);
    }
    for (; c < dp; c++) dst[c] = 0.0f;
}

static inline int64_t padded(int64_t d) { return (d + LANES - 1) / LANES * LANES; }

static void block_scores(const attn_job *j, const char *krow, int64_t rs, int nq, const void *const *qrow,
                         float qf[][ATT_MAX_D], float sc[][ATT_CHUNK], int at) {
    const size_t es = j->dtype == DT_F32 ? 4 : 2;
    const int64_t dp = padded(j->d);
    float kf[16][ATT_MAX_D] __attribute__((aligned(64)));
    (void)qrow;
    for (int t = 0; t < 16; t++) widen_row(j->dtype, krow + (size_t)t * rs * es, kf[t], j->d, dp);
    for (int g = 0; g < nq; g++)
        for (int t = 0; t < 16; t++) {
            float acc[LANES] = {0};
            for (int64_t c = 0; c < dp; c += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += qf[g][c + l] * kf[t][c + l];
            for (int w = LANES / 2; w > 0; w /= 2)
                for (int l = 0; l < w; l++) acc[l] += acc[l + w];
            sc[g][at + t] = acc[0] * j->scale;
        }
}

static void block_values(const attn_job *j, const char *vrow, int64_t rs, int nt, int nq,
                         float sc[][ATT_CHUNK], int at, float acc[][ATT_MAX_D]) {
    const size_t es = j->dtype == DT_F32 ? 4 : 2;
    const int64_t dp = padded(j->d);
    float vf[ATT_MAX_D] __attribute__((aligned(64)));
    for (int t = 0; t < nt; t++) {
        widen_row(j->dtype, vrow + (size_t)t * rs * es, vf, j->d, dp);
        for (int g = 0; g < nq; g++) {
            const float p = sc[g][at + t];
            for (int64_t c = 0; c < dp; c++) acc[g][c] += p * vf[c];
        }
    }
}

/* exp(x) for x <= 0 within about an ulp (as exp512); below -87 it gives exp(-87), about 1e-38: nothing
 * beside the max's own 1 */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;                         /* NaN passes */
    const float shift = 12582912.0f;                     /* 1.5 * 2^23: t's low bits hold round(x * log2 e) */
    float t = x * 1.44269504088896341f + shift, n = t - shift;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t u;
    memcpy(&u, &t, 4);
    u = (u - 0x4B400000u + 127u) << 23;                  /* 2^n */
    float scale;
    memcpy(&scale, &u, 4);
    return p * scale;
}

static void chunk_softmax(float sc[][ATT_CHUNK], int nq, int n, float *mx, float *sum) {
    for (int g = 0; g < nq; g++) {
        float M = -INFINITY;
        for (int i = 0; i < n; i++) M = sc[g][i] > M ? sc[g][i] : M;
        for (int i = 0; i < n; i++) sc[g][i] = exp_neg(sc[g][i] - M);
        float s[LANES] = {0};
        int i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) s[l] += sc[g][i + l];
        for (; i < n; i++) s[0] += sc[g][i];
        for (int w = LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; l++) s[l] += s[l + w];
        mx[g] = M;
        sum[g] = s[0];
    }
}

static void store_row(int dtype, void *out, const float *acc, float sum, int64_t d) {
    for (int64_t c = 0; c < d; c++) store_elem(dtype, out, c, acc[c] / sum);
}
#endif

/* One query row as float32, zero-padded to a multiple of 16 lanes (unused where bf16 pairs multiply) */
static void widen_query(int dtype, const void *q, float *dst, int64_t d) {
#if defined(__AVX512BF16__)
    if (dtype == DT_BF16) return;
#endif
    int64_t c = 0;
    for (; c < d; c++) dst[c] = load_elem(dtype, q, c);
    for (; c % 16; c++) dst[c] = 0.0f;
}

/* How a context of L keys is cut: the fewest chunks of at most ATT_CHUNK keys, of about equal sizes in whole
 * blocks (257 keys: 144 + 113, not 256 + 1, so the pool's threads share them). A function of L alone. */
static inline int64_t chunk_keys(int64_t L, int64_t *n_chunks) {
    int64_t n = (L + ATT_CHUNK - 1) / ATT_CHUNK;
    int64_t size = ((L + n - 1) / n + KV_BLOCK - 1) / KV_BLOCK * KV_BLOCK;
    *n_chunks = (L + size - 1) / size;
    return size;
}

static void attn_item(const void *arg, int64_t item) {
    const attn_job *j = (const attn_job *)arg;
    int s = 0;
    while (item >= j->first[s + 1]) s++;
    int64_t nch;
    const int64_t L = j->lengths[s], size = chunk_keys(L, &nch), local = item - j->first[s];
    const int64_t c = local % nch, grp = local / nch % j->groups, h = local / nch / j->groups;
    const int64_t per_kv = j->heads / j->kv_heads, g0 = h * per_kv + grp * ATT_QG;
    const int nq = (int)(per_kv - grp * ATT_QG < ATT_QG ? per_kv - grp * ATT_QG : ATT_QG);
    const int64_t t0 = c * size, n = (L - t0 < size ? L - t0 : size);
    const size_t es = j->dtype == DT_F32 ? 4 : 2;
    const int64_t rs = j->kv_heads * j->d;                         /* elements between a block's rows */
    const void *qrow[ATT_QG];
    float qf[ATT_QG][ATT_MAX_D] __attribute__((aligned(64)));    /* widened (paths that multiply in float32) */
    for (int g = 0; g < nq; g++) {
        qrow[g] = (const char *)j->q[s] + (size_t)((g0 + g) * j->q_stride) * es;
        widen_query(j->dtype, qrow[g], qf[g], j->d);
    }

    float sc[ATT_QG][ATT_CHUNK] __attribute__((aligned(64)));
    float acc[ATT_QG][ATT_MAX_D] __attribute__((aligned(64)));
    float mx[ATT_QG], sum[ATT_QG];
    const int64_t *table = j->tables[s] + t0 / KV_BLOCK;
    for (int64_t b = 0; b < n; b += KV_BLOCK) {
        int64_t row = table[b / KV_BLOCK] * KV_BLOCK * rs + h * j->d;
        block_scores(j, (const char *)j->k + (size_t)row * es, rs, nq, qrow, qf, sc, (int)b);
    }
    chunk_softmax(sc, nq, (int)n, mx, sum);
    for (int g = 0; g < nq; g++) memset(acc[g], 0, sizeof(float) * (size_t)j->d);
    for (int64_t b = 0; b < n; b += KV_BLOCK) {
        int64_t row = table[b / KV_BLOCK] * KV_BLOCK * rs + h * j->d;
        int nt = (int)(n - b < KV_BLOCK ? n - b : KV_BLOCK);
        block_values(j, (const char *)j->v + (size_t)row * es, rs, nt, nq, sc, (int)b, acc);
    }
    if (nch == 1) {
        for (int g = 0; g < nq; g++)
            store_row(j->dtype, (char *)j->out[s] + (size_t)((g0 + g) * j->out_stride) * es, acc[g], sum[g], j->d);
        return;
    }
    /* one chunk of several: leave its part; the last chunk of this (sequence, KV head, group) to finish merges */
    const int64_t width = 2 + j->d;
    float *mine = j->partial + (size_t)(item * j->slot);
    for (int g = 0; g < nq; g++) {
        mine[g * width] = mx[g];
        mine[g * width + 1] = sum[g];
        memcpy(mine + g * width + 2, acc[g], sizeof(float) * (size_t)j->d);
    }
    atomic_int *left = &j->pending[((int64_t)s * j->kv_heads + h) * j->groups + grp];
    if (atomic_fetch_sub_explicit(left, 1, memory_order_acq_rel) != 1) return;
    const float *chunk0 = j->partial + (size_t)((item - c) * j->slot);   /* this group's chunk 0 */
    for (int g = 0; g < nq; g++) {
        float M = -INFINITY, total = 0.0f;
        for (int64_t i = 0; i < nch; i++) {
            float m = chunk0[i * j->slot + g * width];
            M = m > M ? m : M;
        }
        for (int64_t x = 0; x < j->d; x++) acc[g][x] = 0.0f;
        for (int64_t i = 0; i < nch; i++) {
            const float *part = chunk0 + i * j->slot + g * width;
            float w = expf(part[0] - M);
            total += w * part[1];
            for (int64_t x = 0; x < j->d; x++) acc[g][x] += w * part[2 + x];
        }
        store_row(j->dtype, (char *)j->out[s] + (size_t)((g0 + g) * j->out_stride) * es, acc[g], total, j->d);
    }
}

static struct { void *p; size_t bytes; } att_scratch;   /* sl_paged_attention's, grown as needed */

/* Decode attention of n_seqs sequences, one query token each, over the paged pools k and v [n_blocks,
 * KV_BLOCK, kv_heads, d] (contiguous, the dtype of q). Sequence i: query q[i] (head h at q[i] + h *
 * q_stride elements), output out[i] (likewise, out_stride), block table tables[i], keys 0..lengths[i]-1.
 * Returns 0, or -1 (nothing written) on arguments it does not take: a block id outside the pool, a length
 * past the table, heads not a multiple of kv_heads, head_dim above ATT_MAX_D. One call at a time, as
 * for the pool's other jobs (engine/kernels/__init__.py holds a lock around every call). */
int sl_paged_attention(int dtype, int n_seqs, const void *const *q, void *const *out,
                       const int64_t *const *tables, const int64_t *table_lens, const int64_t *lengths,
                       const void *k, const void *v, int64_t n_blocks, int64_t heads, int64_t kv_heads,
                       int64_t d, int64_t q_stride, int64_t out_stride, float scale) {
    if (dtype < 0 || dtype > 2 || n_seqs < 1 || kv_heads < 1 || heads < kv_heads || heads % kv_heads
        || d < 1 || d > ATT_MAX_D)
        return -1;
    const int64_t per_kv = heads / kv_heads, groups = (per_kv + ATT_QG - 1) / ATT_QG;
    int64_t items = 0;
    int multi = 0;
    for (int s = 0; s < n_seqs; s++) {
        int64_t L = lengths[s];
        if (L < 1 || L > table_lens[s] * KV_BLOCK) return -1;
        for (int64_t b = 0; b < (L + KV_BLOCK - 1) / KV_BLOCK; b++)
            if (tables[s][b] < 0 || tables[s][b] >= n_blocks) return -1;
        int64_t nch;
        chunk_keys(L, &nch);
        multi |= nch > 1;
        items += kv_heads * groups * nch;
    }
    /* scratch: item boundaries, chunk counters, chunk results; kept between calls (a long context's results
     * are megabytes, whose fresh pages would cost more than the attention) */
    const int64_t per_item = per_kv < ATT_QG ? per_kv : ATT_QG, slot = per_item * (2 + d);
    const int64_t n_groups = (int64_t)n_seqs * kv_heads * groups;
    size_t first_bytes = sizeof(int64_t) * (size_t)(n_seqs + 1);
    size_t pending_bytes = multi ? (sizeof(atomic_int) * (size_t)n_groups + 63) / 64 * 64 : 0;
    size_t need = (first_bytes + 63) / 64 * 64 + pending_bytes + (multi ? sizeof(float) * (size_t)(items * slot) : 0);
    if (need > att_scratch.bytes) {
        free(att_scratch.p);
        att_scratch.p = aligned_alloc(64, (need + 63) / 64 * 64);
        att_scratch.bytes = att_scratch.p ? (need + 63) / 64 * 64 : 0;
        if (!att_scratch.p) return -1;
    }
    char *at = att_scratch.p;
    int64_t *first = (int64_t *)at;
    atomic_int *pending = multi ? (atomic_int *)(at + (first_bytes + 63) / 64 * 64) : NULL;
    float *partial = multi ? (float *)(at + (first_bytes + 63) / 64 * 64 + pending_bytes) : NULL;
    first[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        int64_t nch;
        chunk_keys(lengths[s], &nch);
        first[s + 1] = first[s] + kv_heads * groups * nch;
        for (int64_t i = 0; multi && i < kv_heads * groups; i++) atomic_init(&pending[s * kv_heads * groups + i], (int)nch);
    }
    attn_job job = {dtype, q, out, tables, lengths, k, v, heads, kv_heads, d, q_stride, out_stride, groups, scale,
                    n_seqs, first, partial, slot, pending};
    if (pool.n == 0) sl_set_threads(1, -1);
    int64_t work = 0;                     /* key and value elements read */
    for (int s = 0; s < n_seqs; s++) work += lengths[s] * kv_heads * d;
    if (pool.n <= 1 || items < 2 || work < (1 << 15)) {   /* too small to be worth waking the pool */
        for (int64_t i = 0; i < items; i++) attn_item(&job, i);
    } else {
        run_pool(attn_item, &job, items);
    }
    return 0;
}

/* Whether sl_paged_attention is built with vector code that beats PyTorch's SDPA (AVX-512, or AVX2 with
 * FMA and F16C): 1, else 0 (an SSE2-only build was slower for fp16 there; other CPUs are unmeasured). */
int sl_paged_attention_fast(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
    return 1;
#else
    return 0;
#endif
}

/* ---- RMS norm of decode rows -------------------------------------------------------------------------
 * out[r] = w(r) * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)), with the rounding steps of the engine's PyTorch
 * rms_norm: the row is squared, averaged and scaled in float32; with a weight of the activations' dtype
 * the scaled row is rounded to that dtype first and the product rounded again (one 16-bit multiply), with
 * a float32 weight the product is taken in float32 and rounded once. w(r) is w1, or w2 for the rows whose
 * index modulo `period` is `split` or more (the key heads after the query heads of a q/k norm). Only the
 * order of the float32 sum of squares differs from PyTorch's (its last bits). One thread: a row is a few
 * thousand elements. */
int sl_rms_norm(int dtype, int wdtype, const void *x, const void *w1, const void *w2, void *out, int64_t rows,
                int64_t n, int64_t period, int64_t split, float eps) {
    if (rows < 0 || n <= 0 || (wdtype != dtype && wdtype != DT_F32)) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const void *w = (w2 && period > 0 && r % period >= split) ? w2 : w1;
        int64_t at = r * n;
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int l = 0; l < 16; l++) {
                float v = load_elem(dtype, x, at + i + l);
                acc[l] += v * v;
            }
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += acc[l];
        for (; i < n; i++) {
            float v = load_elem(dtype, x, at + i);
            sum += v * v;
        }
        float scale = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i < n; i++) {
            float y = load_elem(dtype, x, at + i) * scale;
            float wv = load_elem(wdtype, w, i);
            if (wdtype == dtype && dtype != DT_F32) y = round_to(dtype, y);
            store_elem(dtype, out, at + i, wv * y);
        }
    }
    return 0;
}

#define MOE_MAX_K 64

/* The top k of softmax(logits) (E of them, rdtype), as moe.route picks them: probabilities in float32
 * (exp of each logit less the largest, times the reciprocal of their sum), the k largest in descending order,
 * the lower expert first on a tie (a stable sort), renormalised to sum to 1 where norm_topk. p: E floats of
 * scratch. The layer call and the routing of one token on the CPU both come here, so they agree to the bit. */
static void route_top(int rdtype, const void *logits, float *p, int64_t E, int64_t k, int norm_topk,
                      int64_t *top, float *tw) {
    float mx = -INFINITY, total = 0.0f, kept = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        p[e] = load_elem(rdtype, logits, e);
        if (p[e] > mx) mx = p[e];
    }
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        total += p[e];
    }
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < k; i++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (p[e] < 0.0f) continue;                    /* (taken) */
            if (best < 0 || p[e] > p[best]) best = e;
        }
        top[i] = best;
        tw[i] = p[best] * inv;
        p[best] = -1.0f;
        kept += tw[i];
    }
    if (norm_topk)
        for (int64_t i = 0; i < k; i++) tw[i] = tw[i] / kept;
}

/* The routing of `rows` tokens (moe.route on the CPU, a step of a few tokens): logits [rows][E] (rdtype),
 * top_i [rows][k] experts, top_w [rows][k] their weights in wdtype. */
int sl_moe_route(int rdtype, const void *logits, int64_t rows, int64_t E, int64_t k, int norm_topk, int wdtype,
                 int64_t *top_i, void *top_w) {
    if (rdtype < 0 || rdtype > 2 || wdtype < 0 || wdtype > 2 || k < 1 || k > MOE_MAX_K || E < k || rows < 0)
        return -1;
    float *p = malloc(E * sizeof(float));
    if (!p) return -1;
    size_t les = rdtype == DT_F32 ? 4 : 2, wes = wdtype == DT_F32 ? 4 : 2;
    float tw[MOE_MAX_K];
    for (int64_t r = 0; r < rows; r++) {
        route_top(rdtype, (const char *)logits + (size_t)r * E * les, p, E, k, norm_topk, top_i + r * k, tw);
        for (int64_t i = 0; i < k; i++) store_elem(wdtype, (char *)top_w + (size_t)r * k * wes, i, tw[i]);
    }
    free(p);
    return 0;
}

/* out[j] = silu(gate[j]) * up[j] for 16-bit gate and up, as PyTorch's F.silu(gate) * up computes it: silu
 * as x / (1 + exp(-x)) in float32 rounded to the dtype, then the product (exact in float32) rounded. exp is
 * the correctly rounded float32 value (exp_neg8 in 16-lane steps, the C library's expf in the tail). The
 * same results as PyTorch's for every finite 16-bit gate, both paths (a test runs them all). It runs in a
 * decode step's serial part, so the 16-lane path matters (engine.bench.moe_layer_cpu times it). */
#if defined(__AVX512F__)
/* exp(-x) of 8 floats, rounded once to float32 from a double-precision evaluation: the correctly rounded
 * value, as the C library's expf gives it (argument reduction by ln 2 in two parts, then the Taylor series
 * to the 11th power, within 1e-15 on |r| <= ln 2 / 2). x is held to [-100, 150] first (exp(100) is beyond
 * float32 and exp(-150) below its smallest value, so the results saturate as expf's do; a NaN stays NaN). */
static inline __m256 exp_neg8(__m256 x) {
    __m512d d = _mm512_cvtps_pd(x);
    d = _mm512_max_pd(_mm512_set1_pd(-100.0), _mm512_min_pd(_mm512_set1_pd(150.0), d));
    d = _mm512_sub_pd(_mm512_setzero_pd(), d);
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(d, _mm512_set1_pd(1.4426950408889634)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), d);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
    __m512d p = _mm512_set1_pd(1.0 / 39916800.0);
    static const double inv_fact[] = {1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,
                                      1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
    for (int i = 0; i < 11; i++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(inv_fact[i]));
    return _mm512_cvtpd_ps(_mm512_scalef_pd(p, n));
}
#endif

int sl_silu_mul(int dtype, const void *gate, const void *up, void *out, int64_t n) {
    if (dtype != DT_BF16 && dtype != DT_F16) return -1;
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__F16C__)
    for (; j + 16 <= n; j += 16) {
        __m512 g = load16(dtype, gate, j, 0xffff);
        __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(exp_neg8(_mm512_castps512_ps256(g))),
                                      exp_neg8(_mm512_extractf32x8_ps(g, 1)), 1);
        __m512 sv = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        sv = dtype == DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round_bits(sv), 16))
                              : _mm512_cvtph_ps(_mm512_cvtps_ph(sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        store16(dtype, out, j, _mm512_mul_ps(sv, load16(dtype, up, j, 0xffff)), 0xffff);
    }
#endif
    for (; j < n; j++) {
        float g = load_elem(dtype, gate, j);
        float s = round_to(dtype, g / (1.0f + expf(-g)));
        store_elem(dtype, out, j, s * load_elem(dtype, up, j));
    }
    return 0;
}

/* ---- a step of a few tokens through a whole MoE layer (every expert of the layer on the CPU) --------
 * out[r] = x[r] + the token's routed experts' weighted outputs, for t tokens (1 to MOE_MAX_T): h =
 * rms_norm(x) with norm_w, the router's logits h @ router.T (a 16-bit router; a float32 one scores in
 * float32), each token's top k (route_top), the routed experts' SwiGLU, their weighted sum and the residual
 * add. One call instead of a dozen PyTorch ops and five library calls a layer: a decode step of a
 * Qwen3-30B-A3B shape runs 24-48 such layers.
 * Every value is rounded where the tensor path rounds it, with this library's own norm, matmuls, routing,
 * silu (sl_silu_mul) and sums, so the two agree to the bit:
 * - one token (moe.router_block, moe._experts_decode, moe.finish): the experts in ascending order, each
 *   weighted output added to the sum in one multiply-add rounded to the dtype (sl_weighted_sum);
 * - several (moe._experts_batch): the (token, expert) pairs sorted by expert then token, each expert one
 *   matmul job over its tokens' rows, each pair's output times its weight rounded, then added to its token's
 *   sum in that order, each add rounded (sl_scatter_add).
 * gate[e], up[e]: expert e's [I, H] matrices, or gate[e] its [2I, H] gate and up stacked and up NULL;
 * down[e]: its [H, I] matrix. Returns 0, or -1 (nothing written) for an unsupported dtype or size. */
#define MOE_MAX_T 16
int sl_moe_layer(int dtype, int ndtype, int rdtype, const void *x, int64_t t, const void *norm_w, float eps,
                 const void *router, int64_t E, int64_t k, int norm_topk, const void *const *gate,
                 const void *const *up, const void *const *down, int64_t H, int64_t I, void *out) {
    if ((dtype != DT_BF16 && dtype != DT_F16) || (rdtype != dtype && rdtype != DT_F32)
        || (ndtype != dtype && ndtype != DT_F32) || k < 1 || k > MOE_MAX_K || E < k || H <= 0 || I <= 0
        || t < 1 || t > MOE_MAX_T)
        return -1;
    if (pool.n == 0) sl_set_threads(1, -1);
    const size_t es = 2;
    const int fused = up == NULL;
    const int64_t m = t * k;                              /* (token, expert) pairs */
    size_t bytes = (size_t)t * H * es + (size_t)t * H * 4 + (size_t)t * E * 4 + (size_t)E * 4
                   + (size_t)m * (H + 2 * I + I + 2 * H) * es + (size_t)t * H * es;
    char *buf = malloc(bytes);
    if (!buf) return -1;
    void *h = buf;                                        /* [t][H] dtype */
    float *h32 = (float *)((char *)h + (size_t)t * H * es);   /* [t][H] h widened (a float32 router's input) */
    void *logits = h32 + (size_t)t * H;                   /* [t][E] rdtype */
    float *p = (float *)logits + (size_t)t * E;           /* [E] probabilities */
    uint16_t *hx = (uint16_t *)(p + E);                   /* [m][H] each pair's row of h */
    uint16_t *gu = hx + (size_t)m * H;                    /* [m][2I]: gate | up (fused), or gate [m][I], up [m][I] */
    uint16_t *act = gu + (size_t)m * 2 * I;               /* [m][I] */
    uint16_t *y = act + (size_t)m * I;                    /* [m][H] */
    uint16_t *yw = y + (size_t)m * H;                     /* [m][H] weighted (several tokens) */
    uint16_t *sum = yw + (size_t)m * H;                   /* [t][H] */

    sl_rms_norm(dtype, ndtype, x, norm_w, NULL, h, t, H, 0, 0, eps);
    linear_job rj = {rdtype, h, router, NULL, logits, t, E, H, NULL, NULL};
    if (rdtype == DT_F32) {
        for (int64_t i = 0; i < t * H; i++) h32[i] = load_elem(dtype, h, i);
        rj.x = h32;
    }
    run_jobs(&rj, 1);
    int64_t top[MOE_MAX_T * MOE_MAX_K];
    float tw[MOE_MAX_T * MOE_MAX_K];
    const size_t les = rdtype == DT_F32 ? 4 : 2;
    for (int64_t r = 0; r < t; r++)
        route_top(rdtype, (const char *)logits + (size_t)r * E * les, p, E, k, norm_topk, top + r * k, tw + r * k);
    /* the pairs sorted by expert, then token: expert, token and weight (rounded to the dtype) of each */
    int64_t pe[MOE_MAX_T * MOE_MAX_K], pt[MOE_MAX_T * MOE_MAX_K];
    uint16_t wt[MOE_MAX_T * MOE_MAX_K];
    int64_t n = 0;
    for (int64_t i = 0; i < m; i++) {                     /* insertion by (expert, token): m <= 1024 */
        int64_t e = top[i], tok = i / k, j = n++;
        while (j > 0 && (pe[j - 1] > e || (pe[j - 1] == e && pt[j - 1] > tok))) {
            pe[j] = pe[j - 1]; pt[j] = pt[j - 1]; wt[j] = wt[j - 1]; j--;
        }
        pe[j] = e; pt[j] = tok;
        store_elem(dtype, wt, j, tw[i]);
    }
    /* one matmul job per routed expert over its pairs' rows (one token: the rows are h itself) */
    for (int64_t i = 0; i < m; i++) memcpy(hx + i * H, (const uint16_t *)h + pt[i] * H, H * es);
    linear_job *jobs = malloc(2 * (size_t)m * sizeof(linear_job));
    if (!jobs) { free(buf); return -1; }
    int64_t starts[MOE_MAX_T * MOE_MAX_K + 1], experts[MOE_MAX_T * MOE_MAX_K], nx = 0;
    for (int64_t i = 0; i < m; i++)
        if (!i || pe[i] != pe[i - 1]) { starts[nx] = i; experts[nx++] = pe[i]; }
    starts[nx] = m;
    for (int64_t q = 0; q < nx; q++) {
        int64_t a = starts[q], c = starts[q + 1] - a, e = experts[q];
        if (fused) {
            linear_job j = {dtype, hx + a * H, gate[e], NULL, gu + a * 2 * I, c, 2 * I, H, NULL, NULL};
            jobs[q] = j;
        } else {
            linear_job jg = {dtype, hx + a * H, gate[e], NULL, gu + a * I, c, I, H, NULL, NULL};
            linear_job ju = {dtype, hx + a * H, up[e], NULL, gu + (m + a) * I, c, I, H, NULL, NULL};
            jobs[q] = jg;
            jobs[nx + q] = ju;
        }
    }
    run_jobs(jobs, fused ? (int)nx : (int)(2 * nx));
    if (fused)
        for (int64_t i = 0; i < m; i++) sl_silu_mul(dtype, gu + i * 2 * I, gu + i * 2 * I + I, act + i * I, I);
    else
        sl_silu_mul(dtype, gu, gu + m * I, act, m * I);
    for (int64_t q = 0; q < nx; q++) {
        int64_t a = starts[q], c = starts[q + 1] - a;
        linear_job j = {dtype, act + a * I, down[experts[q]], NULL, y + a * H, c, H, I, NULL, NULL};
        jobs[q] = j;
    }
    run_jobs(jobs, (int)nx);
    if (t == 1) {
        sl_weighted_sum(dtype, sum, NULL, y, wt, k, H);
    } else {
        for (int64_t i = 0; i < m; i++) {
            float w = load_elem(dtype, wt, i);
            for (int64_t j = 0; j < H; j++)
                store_elem(dtype, yw, i * H + j, load_elem(dtype, y, i * H + j) * w);
        }
        memset(sum, 0, (size_t)t * H * es);               /* (+0.0 in bf16 and fp16) */
        sl_scatter_add(dtype, sum, yw, pt, m, H, 0);
    }
    for (int64_t j = 0; j < t * H; j++)
        store_elem(dtype, out, j, load_elem(dtype, x, j) + load_elem(dtype, sum, j));
    free(jobs);
    free(buf);
    return 0;
}

/* ---- one decode token's attention sub-layer on the CPU in one call ----------------------------------
 * out = x + o(attention(rope(q), cache + rope(k), cache + v)), where q, k, v come from h = rms_norm(x) through
 * the stacked q/k/v projection (with its bias where given) and, where given, the q and k norms; the new key
 * and value are written to the paged pool at position `pos` (row table[pos / KV_BLOCK] * KV_BLOCK + pos %
 * KV_BLOCK), and the query attends over positions 0..pos through sl_paged_attention. Every value is rounded
 * where the tensor path (dense.attention_qkv, KVCache.write_many, KVCache.attend_decode,
 * dense.attention_out) rounds it, with this library's own norm, matmuls and attention, so the two agree to
 * the bit: RoPE as x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype. The tensor
 * path spends about 36 PyTorch ops and four library calls on this. cos, sin: the position's [d] rows in the
 * dtype. Returns 0, or -1 (nothing written) for an unsupported dtype or size. */
/* ---- phase timers of the layer calls (off unless asked: engine.bench.cpu_call_phases) -----------------
 * Seconds spent in each phase of sl_attn_decode (0 norm, 1 q/k/v job, 2 q/k norms + RoPE + cache write,
 * 3 attention, 4 output job + residual) and of sl_ffn_layer (0 norm, 1 gate/up job, 2 silu times up,
 * 3 down job + residual), summed over calls since the last read. */
#include <time.h>
static _Atomic int phase_timing = 0;
static double attn_phase_s[5], ffn_phase_s[4];
static int64_t attn_phase_calls, ffn_phase_calls;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define PHASE(arr, i, t) do { if (timing) { double t1_ = now_s(); (arr)[i] += t1_ - (t); (t) = t1_; } } while (0)

void sl_phase_timing(int on) { atomic_store(&phase_timing, on ? 1 : 0); }

/* Copy out and reset: out[0..4] attention phases, out[5] attention calls, out[6..9] FFN phases, out[10]
 * FFN calls. */
void sl_phase_read(double *out) {
    for (int i = 0; i < 5; i++) { out[i] = attn_phase_s[i]; attn_phase_s[i] = 0; }
    out[5] = (double)attn_phase_calls; attn_phase_calls = 0;
    for (int i = 0; i < 4; i++) { out[6 + i] = ffn_phase_s[i]; ffn_phase_s[i] = 0; }
    out[10] = (double)ffn_phase_calls; ffn_phase_calls = 0;
}

/* The same for `B` decode tokens of `B` sequences at once (a continuous batch's step): x [B][H], cos and
 * sin [B][d] (each token's position), token b written at pos[b] of the pool rows of its table tables[b]
 * (table_lens[b] blocks) and attending over 0..pos[b]; out [B][H]. The projections are one matmul job of B
 * rows each, the attention one job over the B sequences, as the tensor path runs them (kernels.linear over
 * the step's rows, KVCache.attend_decode over its sequences): the same bits. */
#define ATTN_MAX_B 64
static int attn_decode_many(int dtype, int ndtype, const void *x, int64_t B, int64_t H, const void *norm_w,
                            float eps, const void *qkv_w, const void *qkv_b, int64_t nh, int64_t nkv, int64_t d,
                            int qndtype, const void *qn_w, const void *kn_w, const void *cos, const void *sin,
                            void *k_pool, void *v_pool, int64_t n_blocks, const int64_t *const *tables,
                            const int64_t *table_lens, const int64_t *pos, float scale, const void *o_w, void *out,
                            const coded_mat *cqkv, const coded_mat *co);

int sl_attn_decode_many(int dtype, int ndtype, const void *x, int64_t B, int64_t H, const void *norm_w, float eps,
                        const void *qkv_w, const void *qkv_b, int64_t nh, int64_t nkv, int64_t d, int qndtype,
                        const void *qn_w, const void *kn_w, const void *cos, const void *sin, void *k_pool,
                        void *v_pool, int64_t n_blocks, const int64_t *const *tables, const int64_t *table_lens,
                        const int64_t *pos, float scale, const void *o_w, void *out) {
    return attn_decode_many(dtype, ndtype, x, B, H, norm_w, eps, qkv_w, qkv_b, nh, nkv, d, qndtype, qn_w, kn_w, cos,
                            sin, k_pool, v_pool, n_blocks, tables, table_lens, pos, scale, o_w, out, NULL, NULL);
}

/* sl_attn_decode_many with the stacked q/k/v projection and the output projection read in place from their
 * transfer-coded form (bf16, AVX512-BF16): the same bits. */
int sl_attn_decode_many_coded(int ndtype, const void *x, int64_t B, int64_t H, const void *norm_w, float eps,
                              const coded_mat *qkv, const void *qkv_b, int64_t nh, int64_t nkv, int64_t d,
                              int qndtype, const void *qn_w, const void *kn_w, const void *cos, const void *sin,
                              void *k_pool, void *v_pool, int64_t n_blocks, const int64_t *const *tables,
                              const int64_t *table_lens, const int64_t *pos, float scale, const coded_mat *o,
                              void *out) {
#if defined(__AVX512BF16__)
    if (!qkv || !o || H % 2 || (nh * d) % 2) return -1;
    return attn_decode_many(DT_BF16, ndtype, x, B, H, norm_w, eps, NULL, qkv_b, nh, nkv, d, qndtype, qn_w, kn_w, cos,
                            sin, k_pool, v_pool, n_blocks, tables, table_lens, pos, scale, NULL, out, qkv, o);
#else
    (void)ndtype; (void)x; (void)B; (void)H; (void)norm_w; (void)eps; (void)qkv; (void)qkv_b; (void)nh; (void)nkv;
    (void)d; (void)qndtype; (void)qn_w; (void)kn_w; (void)cos; (void)sin; (void)k_pool; (void)v_pool;
    (void)n_blocks; (void)tables; (void)table_lens; (void)pos; (void)scale; (void)o; (void)out;
    return -1;
#endif
}

static int attn_decode_many(int dtype, int ndtype, const void *x, int64_t B, int64_t H, const void *norm_w,
                            float eps, const void *qkv_w, const void *qkv_b, int64_t nh, int64_t nkv, int64_t d,
                            int qndtype, const void *qn_w, const void *kn_w, const void *cos, const void *sin,
                            void *k_pool, void *v_pool, int64_t n_blocks, const int64_t *const *tables,
                            const int64_t *table_lens, const int64_t *pos, float scale, const void *o_w, void *out,
                            const coded_mat *cqkv, const coded_mat *co) {
    if ((dtype != DT_BF16 && dtype != DT_F16) || (ndtype != dtype && ndtype != DT_F32) || H <= 0 || nh < 1
        || nkv < 1 || nh % nkv || d < 2 || d % 2 || d > ATT_MAX_D || B < 1 || B > ATTN_MAX_B
        || (qn_w && (qndtype != dtype && qndtype != DT_F32)))
        return -1;
    int64_t rows[ATTN_MAX_B], lengths[ATTN_MAX_B];
    for (int64_t b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] / KV_BLOCK >= table_lens[b]) return -1;
        const int64_t blk = tables[b][pos[b] / KV_BLOCK];
        if (blk < 0 || blk >= n_blocks) return -1;
        rows[b] = blk * KV_BLOCK + pos[b] % KV_BLOCK;
        lengths[b] = pos[b] + 1;
    }
    for (int64_t b = 0; b < B; b++)                        /* two tokens must not write one cache row */
        for (int64_t c = 0; c < b; c++)
            if (rows[b] == rows[c]) return -1;
    if (pool.n == 0) sl_set_threads(1, -1);
    const size_t es = 2;
    const int64_t nq = nh * d, nk = nkv * d, nqkv = nq + 2 * nk, half = d / 2;
    uint16_t *buf = malloc((size_t)B * (H + nqkv + (nq + nk) * 2 + nq + H) * es);
    if (!buf) return -1;
    uint16_t *h = buf, *qkv = h + B * H, *qkn = qkv + B * nqkv, *rq = qkn + B * (nq + nk),
             *att = rq + B * (nq + nk), *o = att + B * nq;
    const int timing = atomic_load(&phase_timing);
    double t0 = timing ? now_s() : 0;

    sl_rms_norm(dtype, ndtype, x, norm_w, NULL, h, B, H, 0, 0, eps);
    PHASE(attn_phase_s, 0, t0);
    linear_job j1 = {dtype, h, qkv_w, qkv_b, qkv, B, nqkv, H, NULL, cqkv};
    run_jobs(&j1, 1);
    PHASE(attn_phase_s, 1, t0);
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *qk = qkv + b * nqkv;
        if (qn_w) {
            sl_rms_norm(dtype, qndtype, qk, qn_w, kn_w, qkn + b * (nq + nk), nh + nkv, d, nh + nkv, nh, eps);
            qk = qkn + b * (nq + nk);
        }
        const void *cb = (const uint16_t *)cos + b * d, *sb = (const uint16_t *)sin + b * d;
        uint16_t *rb = rq + b * (nq + nk);
        for (int64_t hd = 0; hd < nh + nkv; hd++) {       /* RoPE: x * cos + rotate_half(x) * sin */
            const uint16_t *xr = qk + hd * d;
            for (int64_t i = 0; i < d; i++) {
                float xv = load_elem(dtype, xr, i);
                float r = i < half ? -load_elem(dtype, xr, i + half) : load_elem(dtype, xr, i - half);
                float a = round_to(dtype, xv * load_elem(dtype, cb, i));
                float c = round_to(dtype, r * load_elem(dtype, sb, i));
                store_elem(dtype, rb, hd * d + i, a + c);
            }
        }
        memcpy((uint16_t *)k_pool + rows[b] * nk, rb + nq, nk * es);
        memcpy((uint16_t *)v_pool + rows[b] * nk, qkv + b * nqkv + nq + nk, nk * es);
    }
    PHASE(attn_phase_s, 2, t0);
    const void *qp[ATTN_MAX_B];
    void *op[ATTN_MAX_B];
    for (int64_t b = 0; b < B; b++) {
        qp[b] = rq + b * (nq + nk);
        op[b] = att + b * nq;
    }
    int rc = sl_paged_attention(dtype, (int)B, qp, op, tables, table_lens, lengths, k_pool, v_pool, n_blocks, nh,
                                nkv, d, d, d, scale);
    PHASE(attn_phase_s, 3, t0);
    if (rc == 0) {
        linear_job j2 = {dtype, att, o_w, NULL, o, B, H, nq, NULL, co};
        run_jobs(&j2, 1);
        for (int64_t i = 0; i < B * H; i++)
            store_elem(dtype, out, i, load_elem(dtype, x, i) + load_elem(dtype, o, i));
    }
    PHASE(attn_phase_s, 4, t0);
    if (timing) attn_phase_calls++;
    free(buf);
    return rc;
}

int sl_attn_decode(int dtype, int ndtype, const void *x, int64_t H, const void *norm_w, float eps,
                   const void *qkv_w, const void *qkv_b, int64_t nh, int64_t nkv, int64_t d, int qndtype,
                   const void *qn_w, const void *kn_w, const void *cos, const void *sin, void *k_pool, void *v_pool,
                   int64_t n_blocks, const int64_t *table, int64_t table_len, int64_t pos, float scale,
                   const void *o_w, void *out) {
    return sl_attn_decode_many(dtype, ndtype, x, 1, H, norm_w, eps, qkv_w, qkv_b, nh, nkv, d, qndtype, qn_w, kn_w,
                               cos, sin, k_pool, v_pool, n_blocks, &table, &table_len, &pos, scale, o_w, out);
}

/* ---- a dense SwiGLU FFN sub-layer for a few rows on the CPU in one call ----------------------------
 * out = x + down(silu(gate(h)) * up(h)), h = rms_norm(x) with norm_w, for t rows: gate and up stacked in one
 * [2I, H] matrix (up NULL) or two [I, H] ones. The tensor path's steps and roundings (dense.ffn_block with
 * the library's norm and matmuls, sl_silu_mul, the residual add rounded), in one call instead of four
 * PyTorch ops and three library calls. Returns 0, or -1 for an unsupported dtype. */
static int ffn_layer(int dtype, int ndtype, const void *x, int64_t t, int64_t H, const void *norm_w, float eps,
                     const void *gate, const void *up, const void *down, int64_t I, void *out,
                     const coded_mat *cgu, const coded_mat *cdown);

int sl_ffn_layer(int dtype, int ndtype, const void *x, int64_t t, int64_t H, const void *norm_w, float eps,
                 const void *gate, const void *up, const void *down, int64_t I, void *out) {
    return ffn_layer(dtype, ndtype, x, t, H, norm_w, eps, gate, up, down, I, out, NULL, NULL);
}

/* sl_ffn_layer with gate and up (one [2I, H] matrix) and down read in place from their transfer-coded form
 * (`coded_mat`; bf16 and AVX512-BF16 only): the same bits. */
int sl_ffn_layer_coded(const void *x, int64_t t, int64_t H, int ndtype, const void *norm_w, float eps,
                       const coded_mat *gate_up, const coded_mat *down, int64_t I, void *out) {
#if defined(__AVX512BF16__)
    if (!gate_up || !down || H % 2 || I % 2) return -1;
    return ffn_layer(DT_BF16, ndtype, x, t, H, norm_w, eps, NULL, NULL, NULL, I, out, gate_up, down);
#else
    (void)x; (void)t; (void)H; (void)ndtype; (void)norm_w; (void)eps; (void)gate_up; (void)down; (void)I; (void)out;
    return -1;
#endif
}

static int ffn_layer(int dtype, int ndtype, const void *x, int64_t t, int64_t H, const void *norm_w, float eps,
                     const void *gate, const void *up, const void *down, int64_t I, void *out,
                     const coded_mat *cgu, const coded_mat *cdown) {
    if ((dtype != DT_BF16 && dtype != DT_F16) || (ndtype != dtype && ndtype != DT_F32) || t < 1 || H <= 0 || I <= 0)
        return -1;
    if (pool.n == 0) sl_set_threads(1, -1);
    const size_t es = 2;
    uint16_t *buf = malloc((size_t)t * (H + 2 * I + I + H) * es);
    if (!buf) return -1;
    uint16_t *h = buf, *gu = h + t * H, *act = gu + t * 2 * I, *y = act + t * I;
    const int timing = atomic_load(&phase_timing);
    double t0 = timing ? now_s() : 0;
    sl_rms_norm(dtype, ndtype, x, norm_w, NULL, h, t, H, 0, 0, eps);
    PHASE(ffn_phase_s, 0, t0);
    if (up == NULL) {
        linear_job j = {dtype, h, gate, NULL, gu, t, 2 * I, H, NULL, cgu};
        run_jobs(&j, 1);
        PHASE(ffn_phase_s, 1, t0);
        for (int64_t r = 0; r < t; r++) sl_silu_mul(dtype, gu + r * 2 * I, gu + r * 2 * I + I, act + r * I, I);
    } else {
        linear_job jobs[2] = {{dtype, h, gate, NULL, gu, t, I, H, NULL, NULL}, {dtype, h, up, NULL, gu + t * I, t, I, H, NULL, NULL}};
        run_jobs(jobs, 2);
        PHASE(ffn_phase_s, 1, t0);
        sl_silu_mul(dtype, gu, gu + t * I, act, t * I);
    }
    PHASE(ffn_phase_s, 2, t0);
    linear_job jd = {dtype, act, down, NULL, y, t, H, I, NULL, cdown};
    run_jobs(&jd, 1);
    for (int64_t i = 0; i < t * H; i++) store_elem(dtype, out, i, load_elem(dtype, x, i) + load_elem(dtype, y, i));
    PHASE(ffn_phase_s, 3, t0);
    if (timing) ffn_phase_calls++;
    free(buf);
    return 0;
}

/* What the build can do: 2 = AVX512-BF16 dot products, 1 = AVX-512 widening, 3 = AVX2 and FMA widening,
 * 0 = portable C, whose element-by-element matmuls PyTorch beats (the tiles of many-row bf16 matmuls:
 * sl_amx_ready). */
int sl_isa(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX512F__)
    return 1;
#elif defined(HAVE_DOTS_AVX2)
    return 3;
#else
    return 0;
#endif
}

#ifdef SL_POOL_TEST
typedef struct {
    int64_t chunks;
    atomic_int *hits, *bad;
} pool_test_job;

static void pool_test_chunk(const void *arg, int64_t c) {
    const pool_test_job *t = (const pool_test_job *)arg;
    if (c < 0 || c >= t->chunks) atomic_fetch_add(t->bad, 1);
    else atomic_fetch_add(&t->hits[c], 1);
}

/* `jobs` pool jobs on `threads` threads, alternating one chunk and `big` chunks, with the stalls above; returns
 * how many chunks ran other than exactly once in their own job (twice, never, or past its end). */
int sl_pool_test(int threads, int jobs, int big, int worker_stall_us, int post_stall_us) {
    if (threads < 2 || jobs < 1 || big < 2) return -1;
    sl_set_threads(threads, 2000);
    atomic_store(&test_worker_stall_us, worker_stall_us);
    atomic_store(&test_post_stall_us, post_stall_us);
    static atomic_int bad;
    atomic_store(&bad, 0);
    int errors = 0;
    for (int i = 0; i < jobs; i++) {
        const int64_t n = i % 2 ? big : 1;
        atomic_int *hits = calloc((size_t)big, sizeof(atomic_int));
        if (!hits) return -1;
        pool_test_job t = {n, hits, &bad};
        run_pool(pool_test_chunk, &t, n);
        if (n > 1) usleep((useconds_t)(2 * worker_stall_us + 1000));   /* a chunk run late still finds `hits` */
        for (int64_t k = 0; k < n; k++) errors += atomic_load(&hits[k]) != 1;
        free(hits);
    }
    atomic_store(&test_worker_stall_us, 0);
    atomic_store(&test_post_stall_us, 0);
    return errors + atomic_load(&bad);
}
#endif

/* ---- transfer coding (engine/sharding/transfer_code.py) ----------------------------------------------
 * A chunk of bf16 words -> its low bytes and 4-bit codes (bit 3 the sign, bits 0-2 the offset of the
 * exponent's top seven bits from `base`, 7 an escape), two codes a byte (word 2i low, 2i+1 high). Cut in
 * blocks over the pool; each block counts its escapes (`esc`, one per block). */
#define CODE_BLOCK (1 << 20)          /* words a block: even, so a block's codes fill whole bytes */

typedef struct {
    const uint16_t *w;
    int64_t n;
    int base;
    uint8_t *lo, *nib;
    int64_t *esc;
} code_job;

static inline unsigned code_of(uint16_t w, int base) {
    int d = (int)((w >> 8) & 0x7F) - base;
    unsigned off = (d >= 0 && d <= 6) ? (unsigned)d : 7u;
    return off | ((w >> 12) & 8u);
}

static void code_block(const void *arg, int64_t c) {
    const code_job *j = (const code_job *)arg;
    int64_t a = c * CODE_BLOCK, b = a + CODE_BLOCK < j->n ? a + CODE_BLOCK : j->n, e = 0;
    for (int64_t i = a; i < b; i += 2) {
        uint16_t w0 = j->w[i], w1 = i + 1 < b ? j->w[i + 1] : 0;
        unsigned c0 = code_of(w0, j->base), c1 = i + 1 < b ? code_of(w1, j->base) : 0;
        if (j->lo) {
            j->lo[i] = (uint8_t)w0;
            if (i + 1 < b) j->lo[i + 1] = (uint8_t)w1;
            j->nib[i / 2] = (uint8_t)(c0 | (c1 << 4));
        }
        e += (c0 & 7) == 7;
        e += i + 1 < b && (c1 & 7) == 7;
    }
    j->esc[c] = e;
}

/* Codes n words (lo = NULL: only counts); returns the escapes, or -1. `pooled`: the caller holds the pool. */
int64_t sl_bf16_code(const uint16_t *w, int64_t n, int base, uint8_t *lo, uint8_t *nib, int pooled) {
    if (n < 0 || base < 0 || base > 127) return -1;
    int64_t blocks = (n + CODE_BLOCK - 1) / CODE_BLOCK, total = 0;
    int64_t *esc = (int64_t *)calloc(blocks ? blocks : 1, sizeof(int64_t));
    if (!esc) return -1;
    code_job j = {w, n, base, lo, nib, esc};
    if (pooled && pool.n > 1 && blocks > 1) run_pool(code_block, &j, blocks);
    else for (int64_t c = 0; c < blocks; c++) code_block(&j, c);
    for (int64_t c = 0; c < blocks; c++) total += esc[c];
    free(esc);
    return total;
}

/* The positions (word indices) of a coded chunk's escapes, in order, at most `cap`; returns how many (-1:
 * out of memory). Blocks counted, then written at their offsets, both over the pool with `pooled`. */
typedef struct {
    const uint16_t *w;
    int64_t n;
    int base;
    int32_t *pos;
    int64_t cap, *at;
} esc_job;

static void esc_block(const void *arg, int64_t c) {
    const esc_job *j = (const esc_job *)arg;
    int64_t a = c * CODE_BLOCK, b = a + CODE_BLOCK < j->n ? a + CODE_BLOCK : j->n, k = 0;
    if (!j->pos) {
        for (int64_t i = a; i < b; i++) k += (code_of(j->w[i], j->base) & 7) == 7;
        j->at[c] = k;
        return;
    }
    k = j->at[c];
    for (int64_t i = a; i < b && k < j->cap; i++)
        if ((code_of(j->w[i], j->base) & 7) == 7) j->pos[k++] = (int32_t)i;
}

int64_t sl_bf16_escapes(const uint16_t *w, int64_t n, int base, int32_t *pos, int64_t cap, int pooled) {
    int64_t blocks = (n + CODE_BLOCK - 1) / CODE_BLOCK, total = 0;
    int64_t *at = (int64_t *)calloc(blocks ? blocks : 1, sizeof(int64_t));
    if (!at) return -1;
    esc_job j = {w, n, base, NULL, cap, at};
    int pool_it = pooled && pool.n > 1 && blocks > 1;
    if (pool_it) run_pool(esc_block, &j, blocks);
    else for (int64_t c = 0; c < blocks; c++) esc_block(&j, c);
    for (int64_t c = 0; c < blocks; c++) {      /* counts -> first index of each block */
        int64_t k = at[c];
        at[c] = total;
        total += k;
    }
    j.pos = pos;
    if (pool_it) run_pool(esc_block, &j, blocks);
    else for (int64_t c = 0; c < blocks; c++) esc_block(&j, c);
    free(at);
    return total < cap ? total : cap;
}

/* ---- the tight form of a chunk (engine/sharding/transfer_code.py, SLIPSTREAM_TRANSFER_CODE_TIGHT) -------
 * Per word: its low byte, its sign bit (a plane, 8 a byte) and a 2-bit code, the offset 0-2 of the exponent's
 * top seven bits from `base`, or 3: a 4-bit code in the second stream, the offset 0-14 from `base2` or 15, an
 * escape. Each TIGHT_BLOCK-word block stores where its second-stream codes start (int32). Two passes over the
 * blocks (the pool's, with `pooled`): counts, then the writes; a block's second codes may share a byte with
 * its neighbours', so those are OR-ed in atomically into a stream the caller zeroed. */
#define TIGHT_BLOCK 1024

typedef struct {
    const uint16_t *w;
    int64_t n;
    int base, base2;
    int32_t *starts;            /* [blocks]: second-stream codes before each block (written in pass 2) */
    uint8_t *lo, *sgn, *c2, *nib2;
    int64_t *n2, *esc;          /* [blocks]: pass 1 counts; pass 2 reads them as each block's first index */
    int32_t *pos;               /* escapes' word positions, or NULL */
    int pass;
} tight_job;

static void tight_block(const void *arg, int64_t c) {
    const tight_job *j = (const tight_job *)arg;
    int64_t a = c * TIGHT_BLOCK, b = a + TIGHT_BLOCK < j->n ? a + TIGHT_BLOCK : j->n;
    int64_t k2 = j->pass ? j->n2[c] : 0, ke = j->pass ? j->esc[c] : 0;
    if (j->pass) j->starts[c] = (int32_t)k2;
    for (int64_t i = a; i < b; i++) {
        uint16_t w = j->w[i];
        unsigned top = (w >> 8) & 0x7F, d = (top - (unsigned)j->base) & 0xFF, code = d > 2 ? 3u : d;
        unsigned d2 = (top - (unsigned)j->base2) & 0xFF, v2 = d2 > 14 ? 15u : d2;
        if (j->pass) {
            j->lo[i] = (uint8_t)w;
            if ((i & 7) == 0) j->sgn[i >> 3] = 0;
            if ((i & 3) == 0) j->c2[i >> 2] = 0;
            j->sgn[i >> 3] |= (uint8_t)((w >> 15) << (i & 7));
            j->c2[i >> 2] |= (uint8_t)(code << ((i & 3) * 2));
            if (code == 3) {
                __atomic_fetch_or(&j->nib2[k2 >> 1], (uint8_t)(v2 << ((k2 & 1) * 4)), __ATOMIC_RELAXED);
                if (v2 == 15 && j->pos) j->pos[ke] = (int32_t)i;
            }
        }
        k2 += code == 3;
        ke += code == 3 && v2 == 15;
    }
    if (!j->pass) {
        j->n2[c] = k2;
        j->esc[c] = ke;
    }
}

/* Codes n words in the tight form (lo = NULL: only counts): returns the escapes (their positions into `pos`
 * where given, in order) and the second stream's length in *n2_out, or -1 (out of memory, bad arguments). A
 * block is TIGHT_BLOCK words, a multiple of 8, so a block's sign and code bytes are its own. */
int64_t sl_bf16_tight_code(const uint16_t *w, int64_t n, int base, int base2, int32_t *starts, uint8_t *lo,
                           uint8_t *sgn, uint8_t *c2, uint8_t *nib2, int32_t *pos, int64_t *n2_out, int pooled) {
    if (n < 0 || base < 0 || base > 127 || base2 < 0 || base2 > 127) return -1;
    int64_t blocks = (n + TIGHT_BLOCK - 1) / TIGHT_BLOCK, t2 = 0, te = 0;
    int64_t *cnt = (int64_t *)calloc(2 * (blocks ? blocks : 1), sizeof(int64_t));
    if (!cnt) return -1;
    tight_job j = {w, n, base, base2, starts, lo, sgn, c2, nib2, cnt, cnt + blocks, pos, 0};
    int pool_it = pooled && pool.n > 1 && blocks > 1;
    if (pool_it) run_pool(tight_block, &j, blocks);
    else for (int64_t c = 0; c < blocks; c++) tight_block(&j, c);
    for (int64_t c = 0; c < blocks; c++) {      /* counts -> each block's first index */
        int64_t a2 = cnt[c], ae = cnt[blocks + c];
        cnt[c] = t2;
        cnt[blocks + c] = te;
        t2 += a2;
        te += ae;
    }
    if (lo) {
        j.pass = 1;
        if (pool_it) run_pool(tight_block, &j, blocks);
        else for (int64_t c = 0; c < blocks; c++) tight_block(&j, c);
    }
    free(cnt);
    if (n2_out) *n2_out = t2;
    return te;
}

/* ---- many plain copies over the pool ------------------------------------------------------------------
 * n copies of nbytes[i] bytes from src[i] to dst[i] (host memory, not overlapping), cut into 1 MiB pieces
 * shared by the pool where `pooled` (the caller holds the pool): a KV cache's spill to its host-RAM tier is
 * two copies per layer and run of blocks, some hundreds of MB in front of a prompt's first step, and one
 * thread's memcpy moved it at about 7 GB/s on the H200 host (71 ms of a 313 ms 4096-token step; session 24). */
#define COPY_PIECE ((int64_t)1 << 20)
typedef struct {
    void *const *dst;
    const void *const *src;
    const int64_t *nbytes;
    const int64_t *first;    /* [n + 1]: each copy's first piece */
    int n;
} copy_plan;

static void copy_chunk(const void *arg, int64_t c) {
    const copy_plan *p = (const copy_plan *)arg;
    int lo = 0, hi = p->n - 1;          /* the last copy whose first piece is at or before c */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (p->first[mid] <= c) lo = mid; else hi = mid - 1;
    }
    int64_t off = (c - p->first[lo]) * COPY_PIECE, len = p->nbytes[lo] - off;
    if (len > COPY_PIECE) len = COPY_PIECE;
    memcpy((char *)p->dst[lo] + off, (const char *)p->src[lo] + off, (size_t)len);
}

int sl_copy_many(int n, void *const *dst, const void *const *src, const int64_t *nbytes, int pooled) {
    if (n < 0) return -1;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * ((size_t)n + 1)), total = 0;
    if (!first) return -1;
    for (int i = 0; i < n; i++) {
        if (nbytes[i] < 0) { free(first); return -1; }
        first[i] = total;
        total += (nbytes[i] + COPY_PIECE - 1) / COPY_PIECE;
    }
    first[n] = total;
    copy_plan plan = {dst, src, nbytes, first, n};
    if (pooled && pool.n > 1 && total > 1) {
        run_pool(copy_chunk, &plan, total);
    } else {
        for (int64_t c = 0; c < total; c++) copy_chunk(&plan, c);
    }
    free(first);
    return 0;
}
