/* STREAM's triad, a[i] = b[i] + scalar * c[i]: a memory-bandwidth yardstick that the optimizer
 * benchmark (tools/bench/optim.py) holds CPU-Adam against, run on the same thread pool. (The
 * other, an Adam step's own traffic, is in adam.c: it runs CPU-Adam's loops.)
 *
 * STREAM counts 24 bytes per element. With ordinary stores the CPU first reads each line of `a`
 * it is about to overwrite, so 32 bytes move; with non-temporal stores (x86, `nontemporal`
 * nonzero) the 24 counted are the 24 moved, which measures the raw read+write bandwidth.
 */
#include <stdint.h>

#include "ds_native.h"
#include "thread_pool.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define DS_STREAM_X86 1
#include <immintrin.h>
#else
#define DS_STREAM_X86 0
#endif

typedef struct {
    float *a;
    const float *b;
    const float *c;
    float scalar;
    int nontemporal;
} triad_job;

static void triad_plain(const triad_job *job, int64_t begin, int64_t end)
{
    float *a = job->a;
    const float *b = job->b, *c = job->c;
    const float s = job->scalar;
    for (int64_t i = begin; i < end; ++i) {
        a[i] = b[i] + s * c[i];
    }
}

static void triad_range_plain(void *ctx, int64_t begin, int64_t end)
{
    triad_plain((const triad_job *)ctx, begin, end);
}

/* Ordinary and streaming stores of the same vector loop, for one ISA. */
#define TRIAD_LOOP(job, begin, end, width, align, set1, fmadd, loadu, storeu, stream)             \
    do {                                                                                          \
        float *a_ = (job)->a;                                                                     \
        const float *b_ = (job)->b, *c_ = (job)->c;                                               \
        int64_t i_ = (job)->nontemporal ? aligned_from(a_, begin, end, align) : (begin);          \
        triad_plain(job, begin, i_);                                                              \
        const int64_t last_ = (end) - (width);                                                    \
        if ((job)->nontemporal) {                                                                 \
            for (; i_ <= last_; i_ += (width)) {                                                  \
                stream(a_ + i_, fmadd(set1((job)->scalar), loadu(c_ + i_), loadu(b_ + i_)));      \
            }                                                                                     \
            _mm_sfence();                                                                         \
        } else {                                                                                  \
            for (; i_ <= last_; i_ += (width)) {                                                  \
                storeu(a_ + i_, fmadd(set1((job)->scalar), loadu(c_ + i_), loadu(b_ + i_)));      \
            }                                                                                     \
        }                                                                                         \
        triad_plain(job, i_, end);                                                                \
    } while (0)

#if DS_STREAM_X86

/* Until a + i is `align` bytes aligned (or end): the part that streaming stores cannot write. */
static int64_t aligned_from(const float *a, int64_t i, int64_t end, uintptr_t align)
{
    while (i < end && ((uintptr_t)(a + i) % align) != 0) {
        ++i;
    }
    return i;
}

__attribute__((target("avx512f"))) static void triad_range_avx512(void *ctx, int64_t begin,
                                                                  int64_t end)
{
    const triad_job *job = (const triad_job *)ctx;
    TRIAD_LOOP(job, begin, end, 16, 64, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
               _mm512_storeu_ps, _mm512_stream_ps);
}

__attribute__((target("avx2,fma"))) static void triad_range_avx2(void *ctx, int64_t begin,
                                                                 int64_t end)
{
    const triad_job *job = (const triad_job *)ctx;
    TRIAD_LOOP(job, begin, end, 8, 32, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_loadu_ps,
               _mm256_storeu_ps, _mm256_stream_ps);
}

#endif /* DS_STREAM_X86 */

void ds_native_stream_triad(int64_t n, float *a, const float *b, const float *c, float scalar,
                            int nontemporal, int num_threads)
{
    triad_job job = {a, b, c, scalar, nontemporal};
    ds_native_range_fn range = triad_range_plain;
#if DS_STREAM_X86
    /* The checks of CPU-Adam's paths (whose F16C requirement is harmless here). */
    if (ds_native_adam_simd_supported(DS_NATIVE_ADAM_AVX512)) {
        range = triad_range_avx512;
    } else if (ds_native_adam_simd_supported(DS_NATIVE_ADAM_AVX2)) {
        range = triad_range_avx2;
    }
#endif
    /* 64 Ki elements per chunk (768 KiB moved), a multiple of 16 so chunks stay aligned. */
    ds_native_parallel_for(n, 65536, num_threads, range, &job);
}
