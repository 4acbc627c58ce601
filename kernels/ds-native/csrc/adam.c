/* CPU Adam: one fused pass over param, grad, exp_avg and exp_avg_sq (28 bytes per fp32 parameter,
 * plus 2 with a 16-bit copy-out), memory-bound on any recent CPU.
 *
 * [Note: CPU-Adam code paths]
 * The wheel is built without -march, so the AVX2 and AVX-512 loops are separate functions
 * compiled with __attribute__((target(...))) and chosen at run time from what the CPU reports
 * (ds_native_adam_auto_simd). The portable loop is plain C that the compiler vectorises for the
 * baseline ISA (SSE2 on x86-64, NEON on AArch64) where it can. All three do the same arithmetic in
 * the same order, per element:
 *
 *     g  = grad (+ weight_decay * p in Adam mode, the L2 form)
 *     m  = beta1 * m + (1 - beta1) * g
 *     v  = beta2 * v + (1 - beta2) * g * g
 *     p  = p * (1 - lr * weight_decay)                           (AdamW mode only)
 *     p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 *
 * which is torch.optim.Adam/AdamW's update (and DeepSpeed's CPU Adam's). The kernel multiplies
 * by 1 / sqrt(1 - beta2^t) where torch divides, and the vector paths fuse multiply-adds, so the
 * results differ from torch's and from each other by rounding only. sqrtf vectorises because the
 * build passes -fno-math-errno (with errno semantics GCC keeps a scalar call for negative inputs).
 *
 * Each path is written once as an always-inline body taking the gradient and copy dtypes as
 * arguments; ADAM_SPECIALISE calls it with every combination as constants, so the compiler emits
 * one branch-free loop per combination. The vector paths share the arithmetic (VECTOR_UPDATE)
 * and differ in loads, stores and conversions. Tails: AVX-512 uses masked loads and stores; AVX2
 * runs the same vector body on a zero-padded copy of the last < 8 elements.
 *
 * [Note: no division]
 * One core must do Adam's arithmetic faster than memory feeds it, or a single-threaded step (and
 * one large tensor, which no other work overlaps) is bound by the core instead. The divider is the
 * core's bottleneck: sqrt and div both run on it, and with both, the AVX-512 loop took 0.40
 * ns/param with all four streams in L2 (Sapphire Rapids, 2.6 GHz) against a memory floor of
 * ~0.49 ns/param, so the two barely overlapped. The vector paths therefore compute m / denom as
 * m * (1/denom) with the ISA's reciprocal estimate and one Newton step (rcp14: ~2^-27 relative,
 * rcp: ~2^-22, before rounding; 0.24 ns/param in L2), keeping the exact sqrt. The update
 * lr * m / denom then differs from a division by a few float ulps of itself, far below the
 * rounding of the param it is added to. Where denom is 0 or inf the estimate is exact and kept,
 * so 0/0, x/0 and x/inf give what division gives (NaN, inf, 0).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpuid_cache.h"
#include "ds_native.h"
#include "thread_pool.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define DS_ADAM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define DS_ADAM_X86 0
#endif

/* copy_dtype values besides the 16-bit dtypes: no copy-out; and no Adam either, only its memory
 * traffic (ds_native_stream_adam_traffic: the same loops with x += scalar * g as the update). */
#define NO_COPY (-1)
#define TRAFFIC_ONLY (-2)
#define HAS_COPY(copy_dtype) ((copy_dtype) >= 0)
/* Elements per chunk handed to a thread: ~0.9 MB of traffic, long enough that waking a worker
 * (tens of microseconds) pays off, and a multiple of 64 so chunks start on cache-line boundaries
 * (no two threads write to the same line). */
#define ADAM_GRAIN 32768
/* Copies at least this long are written with non-temporal stores where the CPU path has them:
 * the copy is written once and read later by someone else (a host-to-device transfer), so
 * streaming it out saves reading each line in before overwriting it. */
#define STREAM_COPY_MIN 262144
/* The vector loops prefetch their inputs this many elements ahead (2 KiB of each fp32 stream).
 * The divider (sqrt, div) keeps a core busy long enough per element that its out-of-order window
 * fills with waiting arithmetic and issues the next loads late; with the hardware prefetchers
 * alone, a single-threaded loop left about a tenth of the bandwidth that a loop with Adam's loads
 * and stores but no arithmetic reaches (Sapphire Rapids). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 512
#endif

typedef struct {
    float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
    float neg_step_size;    /* -lr / (1 - beta1^t) */
    float inv_sqrt_bc2;     /* 1 / sqrt(1 - beta2^t) */
    float l2;               /* weight_decay in Adam mode, else 0 */
    float decay;            /* 1 - lr * weight_decay in AdamW mode, else 1 */
    int has_l2, has_decay;
} adam_consts;

typedef struct {
    float *param;
    const void *grad;
    float *exp_avg;
    float *exp_avg_sq;
    void *copy;
} adam_buffers;

/* One call's work, shared by the threads. The loops copy what they use into locals first: the
 * compiler cannot tell that storing through a float pointer leaves this struct unchanged, and
 * would otherwise reload every field on every iteration. */
typedef struct {
    adam_consts c;
    adam_buffers buf;
    int grad_dtype;
    int copy_dtype; /* a 16-bit dtype, NO_COPY or TRAFFIC_ONLY */
    int stream_copy;
} adam_job;

static adam_consts make_consts(const ds_native_adam_hparams *hp)
{
    double bc1 = 1.0, bc2 = 1.0;
    if (hp->bias_correction) {
        bc1 = 1.0 - pow(hp->beta1, (double)hp->step);
        bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
    }
    adam_consts c;
    c.beta1 = (float)hp->beta1;
    c.beta2 = (float)hp->beta2;
    c.one_minus_beta1 = (float)(1.0 - hp->beta1);
    c.one_minus_beta2 = (float)(1.0 - hp->beta2);
    c.eps = (float)hp->eps;
    c.neg_step_size = (float)(-hp->lr / bc1);
    c.inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    c.has_l2 = !hp->adamw_mode && hp->weight_decay != 0.0;
    c.has_decay = hp->adamw_mode && hp->weight_decay != 0.0;
    c.l2 = c.has_l2 ? (float)hp->weight_decay : 0.0f;
    c.decay = c.has_decay ? (float)(1.0 - hp->lr * hp->weight_decay) : 1.0f;
    return c;
}

/* Calls body(job, begin, end, grad_dtype, copy_dtype) with both dtypes as constants. */
#define ADAM_SPECIALISE(body, job, begin, end)                                                    \
    do {                                                                                          \
        if ((job)->copy_dtype == TRAFFIC_ONLY) {                                                  \
            body(job, begin, end, DS_NATIVE_FLOAT32, TRAFFIC_ONLY);                               \
            break;                                                                                \
        }                                                                                         \
        switch ((job)->grad_dtype) {                                                              \
        case DS_NATIVE_FLOAT16: ADAM_COPY_CASES(body, job, begin, end, DS_NATIVE_FLOAT16); break; \
        case DS_NATIVE_BFLOAT16:                                                                  \
            ADAM_COPY_CASES(body, job, begin, end, DS_NATIVE_BFLOAT16);                           \
            break;                                                                                \
        default: ADAM_COPY_CASES(body, job, begin, end, DS_NATIVE_FLOAT32); break;                \
        }                                                                                         \
    } while (0)
#define ADAM_COPY_CASES(body, job, begin, end, grad_dtype)                                        \
    switch ((job)->copy_dtype) {                                                                  \
    case DS_NATIVE_FLOAT16: body(job, begin, end, grad_dtype, DS_NATIVE_FLOAT16); break;          \
    case DS_NATIVE_BFLOAT16: body(job, begin, end, grad_dtype, DS_NATIVE_BFLOAT16); break;        \
    default: body(job, begin, end, grad_dtype, NO_COPY); break;                                   \
    }

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if DS_ADAM_X86
/* Prefetches the lines that element i + PREFETCH_AHEAD of each input sits on. The addresses may
 * lie past the end of a buffer: prefetches never fault (integer arithmetic, so no C pointer
 * arithmetic goes out of bounds either). */
ALWAYS_INLINE void prefetch_inputs(const adam_buffers *b, int64_t i, size_t grad_size)
{
    const uintptr_t ahead = (uintptr_t)(i + PREFETCH_AHEAD);
    _mm_prefetch((const char *)((uintptr_t)b->param + ahead * 4), _MM_HINT_T0);
    _mm_prefetch((const char *)((uintptr_t)b->grad + ahead * grad_size), _MM_HINT_T0);
    _mm_prefetch((const char *)((uintptr_t)b->exp_avg + ahead * 4), _MM_HINT_T0);
    _mm_prefetch((const char *)((uintptr_t)b->exp_avg_sq + ahead * 4), _MM_HINT_T0);
}
#endif

/* ---- portable path ---------------------------------------------------------------------- */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* Round to nearest even, NaN to the canonical quiet NaN: what torch's float -> bfloat16 does. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if (f != f) {
        return 0x7FC0;
    }
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0x1F) { /* inf or NaN */
        return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));
    }
    if (exponent != 0) { /* normal: rebias 15 -> 127 */
        return f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    }
    float magnitude = (float)mantissa * 0x1p-24f; /* zero or subnormal, exact in float32 */
    return sign ? -magnitude : magnitude;
}

/* IEEE binary16, round to nearest even (overflow to inf, NaN to the canonical quiet NaN). */
static inline uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t mag = u & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) {
        return sign | 0x7E00u;
    }
    if (mag >= 0x477FF000u) { /* >= 65520 rounds past the largest half, 65504 */
        return sign | 0x7C00u;
    }
    if (mag >= 0x38800000u) { /* >= 2^-14: normal; drop 13 mantissa bits, rebias 127 -> 15 */
        uint32_t rounded = mag + 0xFFFu + ((mag >> 13) & 1u);
        return sign | (uint16_t)((rounded - 0x38000000u) >> 13);
    }
    if (mag <= 0x33000000u) { /* <= 2^-25 (a tie at 2^-25 goes to the even 0) */
        return sign;
    }
    /* Subnormal half: count units of 2^-24. The float's significand m (implicit bit set) is worth
     * m * 2^(e - 150), i.e. m >> (126 - e) units, with shift in [14, 24] here. */
    uint32_t e = mag >> 23;
    uint32_t m = (mag & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - e;
    uint32_t half_unit = 1u << (shift - 1);
    uint32_t units = (m + half_unit - 1u + ((m >> shift) & 1u)) >> shift;
    return sign | (uint16_t)units; /* 0x400 (the smallest normal) when it rounds up into it */
}

ALWAYS_INLINE float load_grad_scalar(const void *grad, int64_t i, int dtype)
{
    if (dtype == DS_NATIVE_FLOAT32) {
        return ((const float *)grad)[i];
    }
    uint16_t h = ((const uint16_t *)grad)[i];
    return dtype == DS_NATIVE_FLOAT16 ? f16_to_f32(h) : bf16_to_f32(h);
}

ALWAYS_INLINE void adam_body_scalar(const adam_job *job, int64_t begin, int64_t end,
                                    int grad_dtype, int copy_dtype)
{
    const adam_consts c = job->c;
    float *restrict param = job->buf.param;
    const void *grad = job->buf.grad;
    float *restrict exp_avg = job->buf.exp_avg;
    float *restrict exp_avg_sq = job->buf.exp_avg_sq;
    uint16_t *restrict copy = (uint16_t *)job->buf.copy;
    for (int64_t i = begin; i < end; ++i) {
        float p = param[i];
        float g = load_grad_scalar(grad, i, grad_dtype);
        if (copy_dtype == TRAFFIC_ONLY) {
            param[i] = p + c.neg_step_size * g;
            exp_avg[i] += c.neg_step_size * g;
            exp_avg_sq[i] += c.neg_step_size * g;
            continue;
        }
        if (c.has_l2) {
            g = g + c.l2 * p;
        }
        float m = c.beta1 * exp_avg[i] + c.one_minus_beta1 * g;
        float v = c.beta2 * exp_avg_sq[i] + c.one_minus_beta2 * g * g;
        float denom = sqrtf(v) * c.inv_sqrt_bc2 + c.eps;
        if (c.has_decay) {
            p = p * c.decay;
        }
        p = p + c.neg_step_size * (m / denom);
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (copy_dtype == DS_NATIVE_FLOAT16) {
            copy[i] = f32_to_f16(p);
        } else if (copy_dtype == DS_NATIVE_BFLOAT16) {
            copy[i] = f32_to_bf16(p);
        }
    }
}

static void adam_range_scalar(void *ctx, int64_t begin, int64_t end)
{
    const adam_job *job = (const adam_job *)ctx;
    ADAM_SPECIALISE(adam_body_scalar, job, begin, end);
}

/* ---- vector paths: the math shared by every ISA -------------------------------------------- */

/* An ISA's broadcast constants: the adam_consts fields as vectors of type `vec`. */
#define VECTOR_CONSTS(vec)                                                                        \
    struct {                                                                                      \
        vec beta1, beta2, one_minus_beta1, one_minus_beta2, eps, neg_step_size, inv_sqrt_bc2, l2, \
            decay;                                                                                \
        int has_l2, has_decay;                                                                    \
    }

/* Initialiser of a VECTOR_CONSTS from adam_consts *c, broadcast by the ISA's `set1`. */
#define BROADCAST_CONSTS(set1, c)                                                                 \
    {                                                                                             \
        set1((c)->beta1), set1((c)->beta2), set1((c)->one_minus_beta1),                           \
            set1((c)->one_minus_beta2), set1((c)->eps), set1((c)->neg_step_size),                 \
            set1((c)->inv_sqrt_bc2), set1((c)->l2), set1((c)->decay), (c)->has_l2,                \
            (c)->has_decay                                                                        \
    }

/* The update of [Note: CPU-Adam code paths] on vectors p, g, m, v (updated in place), written
 * once for all ISAs with that ISA's fmadd/mul/sqrt/recip and constants k. `recip` is 1/x by the
 * ISA's reciprocal estimate and one Newton step, not a division: see [Note: no division]. */
#define VECTOR_UPDATE(fmadd, mul, sqrt, recip, k, p, g, m, v)                                     \
    do {                                                                                          \
        if ((k)->has_l2) {                                                                        \
            (g) = fmadd((k)->l2, (p), (g));                                                       \
        }                                                                                         \
        (m) = fmadd((k)->beta1, (m), mul((k)->one_minus_beta1, (g)));                             \
        (v) = fmadd((k)->beta2, (v), mul(mul((k)->one_minus_beta2, (g)), (g)));                   \
        if ((k)->has_decay) {                                                                     \
            (p) = mul((p), (k)->decay);                                                           \
        }                                                                                         \
        (p) = fmadd((k)->neg_step_size,                                                           \
                    mul((m), recip(fmadd(sqrt(v), (k)->inv_sqrt_bc2, (k)->eps))), (p));           \
    } while (0)

/* TRAFFIC_ONLY's update: x += scalar * g for x in p, m, v (the scalar in k->neg_step_size). */
#define VECTOR_TRAFFIC(fmadd, k, p, g, m, v)                                                      \
    do {                                                                                          \
        (p) = fmadd((k)->neg_step_size, (g), (p));                                                \
        (m) = fmadd((k)->neg_step_size, (g), (m));                                                \
        (v) = fmadd((k)->neg_step_size, (g), (v));                                                \
    } while (0)

#if DS_ADAM_X86

/* ---- AVX2 + FMA + F16C path ---------------------------------------------------------------- */

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

typedef VECTOR_CONSTS(__m256) consts_avx2;

TARGET_AVX2 ALWAYS_INLINE consts_avx2 broadcast_avx2(const adam_consts *c)
{
    consts_avx2 k = BROADCAST_CONSTS(_mm256_set1_ps, c);
    return k;
}

TARGET_AVX2 ALWAYS_INLINE __m256 load_grad_avx2(const void *grad, int64_t i, int dtype)
{
    if (dtype == DS_NATIVE_FLOAT32) {
        return _mm256_loadu_ps((const float *)grad + i);
    }
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i));
    if (dtype == DS_NATIVE_FLOAT16) {
        return _mm256_cvtph_ps(h);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TARGET_AVX2 ALWAYS_INLINE __m128i to_half_avx2(__m256 p, int dtype)
{
    if (dtype == DS_NATIVE_FLOAT16) {
        return _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m256i u = _mm256_castps_si256(p);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    /* r holds 16-bit values in 32-bit lanes; packus narrows within 128-bit halves. */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* 1/d: the 12-bit estimate refined by one Newton step, r + r(1 - dr) (~2^-22 relative). Where d is
 * 0 or +-inf the estimate is exact (inf, 0) and the step would give 0 * inf = NaN: keep it there. */
TARGET_AVX2 ALWAYS_INLINE __m256 recip_avx2(__m256 d)
{
    __m256 r = _mm256_rcp_ps(d);
    __m256 e = _mm256_fnmadd_ps(d, r, _mm256_set1_ps(1.0f));
    return _mm256_blendv_ps(r, _mm256_fmadd_ps(e, r, r), _mm256_cmp_ps(e, e, _CMP_ORD_Q));
}

/* Eight elements at offset i of b. */
TARGET_AVX2 ALWAYS_INLINE void adam8_avx2(const consts_avx2 *k, const adam_buffers *b, int64_t i,
                                          int grad_dtype, int copy_dtype, int stream)
{
    __m256 p = _mm256_loadu_ps(b->param + i);
    __m256 g = load_grad_avx2(b->grad, i, grad_dtype);
    __m256 m = _mm256_loadu_ps(b->exp_avg + i);
    __m256 v = _mm256_loadu_ps(b->exp_avg_sq + i);
    if (copy_dtype == TRAFFIC_ONLY) {
        VECTOR_TRAFFIC(_mm256_fmadd_ps, k, p, g, m, v);
    } else {
        VECTOR_UPDATE(_mm256_fmadd_ps, _mm256_mul_ps, _mm256_sqrt_ps, recip_avx2, k, p, g, m, v);
    }
    _mm256_storeu_ps(b->param + i, p);
    _mm256_storeu_ps(b->exp_avg + i, m);
    _mm256_storeu_ps(b->exp_avg_sq + i, v);
    if (HAS_COPY(copy_dtype)) {
        __m128i h = to_half_avx2(p, copy_dtype);
        __m128i *dst = (__m128i *)((uint16_t *)b->copy + i);
        if (stream) {
            _mm_stream_si128(dst, h);
        } else {
            _mm_storeu_si128(dst, h);
        }
    }
}

TARGET_AVX2 ALWAYS_INLINE void adam_body_avx2(const adam_job *job, int64_t begin, int64_t end,
                                              int grad_dtype, int copy_dtype)
{
    const consts_avx2 k = broadcast_avx2(&job->c);
    const adam_buffers b = job->buf;
    /* Streaming stores need aligned destinations; chunks start at multiples of 64 elements, so
     * the base address decides for the whole chunk. */
    const int stream = HAS_COPY(copy_dtype) && job->stream_copy
                       && ((uintptr_t)((uint16_t *)b.copy + begin) % 16) == 0;
    const size_t grad_size = grad_dtype == DS_NATIVE_FLOAT32 ? 4 : 2;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) { /* one cache line of each fp32 stream per iteration */
        prefetch_inputs(&b, i, grad_size);
        adam8_avx2(&k, &b, i, grad_dtype, copy_dtype, stream);
        adam8_avx2(&k, &b, i + 8, grad_dtype, copy_dtype, stream);
    }
    for (; i + 8 <= end; i += 8) {
        adam8_avx2(&k, &b, i, grad_dtype, copy_dtype, stream);
    }
    if (stream) {
        _mm_sfence();
    }
    const int64_t rest = end - i;
    if (rest == 0) {
        return;
    }
    /* Tail: the same body on zero-padded copies, so its rounding matches the vector loop. */
    float p[8] = {0}, m[8] = {0}, v[8] = {0}, g[8] = {0};
    uint16_t copy[8];
    memcpy(p, b.param + i, (size_t)rest * 4);
    memcpy(m, b.exp_avg + i, (size_t)rest * 4);
    memcpy(v, b.exp_avg_sq + i, (size_t)rest * 4);
    memcpy(g, (const char *)b.grad + (size_t)i * grad_size, (size_t)rest * grad_size);
    const adam_buffers padded = {p, g, m, v, copy};
    adam8_avx2(&k, &padded, 0, grad_dtype, copy_dtype, 0);
    memcpy(b.param + i, p, (size_t)rest * 4);
    memcpy(b.exp_avg + i, m, (size_t)rest * 4);
    memcpy(b.exp_avg_sq + i, v, (size_t)rest * 4);
    if (HAS_COPY(copy_dtype)) {
        memcpy((uint16_t *)b.copy + i, copy, (size_t)rest * 2);
    }
}

TARGET_AVX2 static void adam_range_avx2(void *ctx, int64_t begin, int64_t end)
{
    const adam_job *job = (const adam_job *)ctx;
    ADAM_SPECIALISE(adam_body_avx2, job, begin, end);
}

/* ---- AVX-512 (F, BW, VL) path ------------------------------------------------------------- */

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

typedef VECTOR_CONSTS(__m512) consts_avx512;

TARGET_AVX512 ALWAYS_INLINE consts_avx512 broadcast_avx512(const adam_consts *c)
{
    consts_avx512 k = BROADCAST_CONSTS(_mm512_set1_ps, c);
    return k;
}

TARGET_AVX512 ALWAYS_INLINE __m512 load_grad_avx512(const void *grad, int64_t i, __mmask16 mask,
                                                    int dtype)
{
    if (dtype == DS_NATIVE_FLOAT32) {
        return _mm512_maskz_loadu_ps(mask, (const float *)grad + i);
    }
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)grad + i);
    if (dtype == DS_NATIVE_FLOAT16) {
        return _mm512_cvtph_ps(h);
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET_AVX512 ALWAYS_INLINE __m256i to_half_avx512(__m512 p, int dtype)
{
    if (dtype == DS_NATIVE_FLOAT16) {
        return _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m512i u = _mm512_castps_si512(p);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* 1/d as recip_avx2, from the 14-bit estimate (~2^-27 relative before rounding). */
TARGET_AVX512 ALWAYS_INLINE __m512 recip_avx512(__m512 d)
{
    __m512 r = _mm512_rcp14_ps(d);
    __m512 e = _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(e, e, _CMP_ORD_Q), r, _mm512_fmadd_ps(e, r, r));
}

/* Sixteen elements at offset i of b (those under mask, for the tail). */
TARGET_AVX512 ALWAYS_INLINE void adam16_avx512(const consts_avx512 *k, const adam_buffers *b,
                                               int64_t i, __mmask16 mask, int grad_dtype,
                                               int copy_dtype, int stream)
{
    __m512 p = _mm512_maskz_loadu_ps(mask, b->param + i);
    __m512 g = load_grad_avx512(b->grad, i, mask, grad_dtype);
    __m512 m = _mm512_maskz_loadu_ps(mask, b->exp_avg + i);
    __m512 v = _mm512_maskz_loadu_ps(mask, b->exp_avg_sq + i);
    if (copy_dtype == TRAFFIC_ONLY) {
        VECTOR_TRAFFIC(_mm512_fmadd_ps, k, p, g, m, v);
    } else {
        VECTOR_UPDATE(_mm512_fmadd_ps, _mm512_mul_ps, _mm512_sqrt_ps, recip_avx512, k, p, g, m, v);
    }
    _mm512_mask_storeu_ps(b->param + i, mask, p);
    _mm512_mask_storeu_ps(b->exp_avg + i, mask, m);
    _mm512_mask_storeu_ps(b->exp_avg_sq + i, mask, v);
    if (HAS_COPY(copy_dtype)) {
        __m256i h = to_half_avx512(p, copy_dtype);
        uint16_t *dst = (uint16_t *)b->copy + i;
        if (stream) {
            _mm256_stream_si256((__m256i *)dst, h);
        } else {
            _mm256_mask_storeu_epi16(dst, mask, h);
        }
    }
}

TARGET_AVX512 ALWAYS_INLINE void adam_body_avx512(const adam_job *job, int64_t begin, int64_t end,
                                                  int grad_dtype, int copy_dtype)
{
    const consts_avx512 k = broadcast_avx512(&job->c);
    const adam_buffers b = job->buf;
    const int stream = HAS_COPY(copy_dtype) && job->stream_copy
                       && ((uintptr_t)((uint16_t *)b.copy + begin) % 32) == 0;
    const size_t grad_size = grad_dtype == DS_NATIVE_FLOAT32 ? 4 : 2;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        prefetch_inputs(&b, i, grad_size);
        adam16_avx512(&k, &b, i, (__mmask16)0xFFFF, grad_dtype, copy_dtype, stream);
    }
    if (stream) {
        _mm_sfence();
    }
    if (i < end) {
        const __mmask16 tail = (__mmask16)((1u << (end - i)) - 1u);
        adam16_avx512(&k, &b, i, tail, grad_dtype, copy_dtype, 0);
    }
}

TARGET_AVX512 static void adam_range_avx512(void *ctx, int64_t begin, int64_t end)
{
    const adam_job *job = (const adam_job *)ctx;
    ADAM_SPECIALISE(adam_body_avx512, job, begin, end);
}

static int cpu_has_f16c(void)
{
    return (ds_native_cpuid_ecx(1) & bit_F16C) != 0;
}

#endif /* DS_ADAM_X86 */

int ds_native_adam_simd_supported(int simd)
{
    switch (simd) {
    case DS_NATIVE_ADAM_AUTO:
    case DS_NATIVE_ADAM_SCALAR: return 1;
#if DS_ADAM_X86
    case DS_NATIVE_ADAM_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case DS_NATIVE_ADAM_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512vl") && cpu_has_f16c();
#endif
    default: return 0;
    }
}

int ds_native_adam_auto_simd(void)
{
    static int best = 0; /* races on first use are benign: every thread computes the same */
    if (best == 0) {
        best = ds_native_adam_simd_supported(DS_NATIVE_ADAM_AVX512) ? DS_NATIVE_ADAM_AVX512
               : ds_native_adam_simd_supported(DS_NATIVE_ADAM_AVX2) ? DS_NATIVE_ADAM_AVX2
                                                                    : DS_NATIVE_ADAM_SCALAR;
    }
    return best;
}

static void run_job(adam_job *job, int64_t n, int simd, int num_threads)
{
    ds_native_range_fn range = adam_range_scalar;
    (void)simd; /* only x86 has other paths */
#if DS_ADAM_X86
    if (simd == DS_NATIVE_ADAM_AVX512) {
        range = adam_range_avx512;
    } else if (simd == DS_NATIVE_ADAM_AVX2) {
        range = adam_range_avx2;
    }
#endif
    ds_native_parallel_for(n, ADAM_GRAIN, num_threads, range, job);
}

int ds_native_adam_step(int64_t n, float *param, const void *grad, int grad_dtype, float *exp_avg,
                        float *exp_avg_sq, void *param_copy, int copy_dtype,
                        const ds_native_adam_hparams *hparams, int simd, int num_threads)
{
    if (grad_dtype < DS_NATIVE_FLOAT32 || grad_dtype > DS_NATIVE_BFLOAT16
        || (param_copy != NULL && copy_dtype != DS_NATIVE_FLOAT16
            && copy_dtype != DS_NATIVE_BFLOAT16)) {
        return -2;
    }
    if (simd == DS_NATIVE_ADAM_AUTO) {
        simd = ds_native_adam_auto_simd();
    } else if (!ds_native_adam_simd_supported(simd)) {
        return -1;
    }
    adam_job job = {
        .c = make_consts(hparams),
        .buf = {param, grad, exp_avg, exp_avg_sq, param_copy},
        .grad_dtype = grad_dtype,
        .copy_dtype = param_copy != NULL ? copy_dtype : NO_COPY,
        .stream_copy = n >= STREAM_COPY_MIN,
    };
    run_job(&job, n, simd, num_threads);
    return simd;
}

void ds_native_stream_adam_traffic(int64_t n, float *p, const float *g, float *m, float *v,
                                   float scalar, int num_threads)
{
    adam_job job = {
        .buf = {p, g, m, v, NULL},
        .grad_dtype = DS_NATIVE_FLOAT32,
        .copy_dtype = TRAFFIC_ONLY,
    };
    job.c.neg_step_size = scalar;
    run_job(&job, n, ds_native_adam_auto_simd(), num_threads);
}
