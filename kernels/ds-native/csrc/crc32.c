/* CRC-32 with zlib's polynomial and conventions (reflected, start and end inverted), the checksum
 * of ds_zero's checkpoint manifests, at memory speed.
 *
 * [Note: CRC-32 folding]
 * A table-driven CRC (zlib 1.2.13: one table lookup per byte, ~1.5-2 GB/s) costs a checkpoint load
 * a third of its time. Carry-less multiplication (PCLMULQDQ) computes CRCs in bulk: a 16-byte lane X
 * at some offset contributes X * x^(8D) (mod P) to the CRC of the message that continues D bytes
 * past it, and that product, split into the lane's two 64-bit halves, is two carry-less multiplies
 * by constants k = x^e mod P; XORed into the lane D bytes on it leaves a lane congruent to all the
 * data so far. The loops keep 4 lanes (64 bytes, pclmul path) or 4 x 4 lanes in ZMM registers
 * (256 bytes, vpclmul path) in flight, fold them down to one lane, fold in the remaining whole
 * lanes, and reduce the last lane with the table (16 bytes of slice-by-8: two steps), then the tail.
 * The constants come from tools/crc32_constants.py, which derives them from the polynomial,
 * models this scheme in Python against zlib, and which tests/test_crc32.py checks this file
 * against. The register is XORed into the first 4 bytes, which is what a CRC's start value is.
 *
 * Code paths, chosen at run time from cpuid: scalar (slice-by-8, any CPU), pclmul (PCLMULQDQ +
 * SSE4.1), vpclmul (AVX-512F + VPCLMULQDQ). The SIMD functions carry target attributes; nothing is
 * assumed of the build machine's CPU.
 */
#include <pthread.h>
#include <string.h>

#include "cpuid_cache.h"
#include "ds_native.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define DS_CRC_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#define CRC32_REFLECTED_POLY 0xEDB88320u
/* AUTO takes the 512-bit path from this length on. From 4 KiB it ran 1.5 times as fast as the
 * 128-bit one on the 2-core development VM (a Sapphire Rapids Xeon; 7.5 against 5.1 GB/s hashing
 * 4 KiB calls from cache, 43 against 15 GB/s at 256 KiB). This was 4 MiB, from a measurement in
 * which every call that named the 512-bit path also ran cpuid (see [Note: cpuid asked once] in
 * cpu_features.c). */
#define CRC_VPCLMUL_MIN_BYTES ((size_t)4 << 10)

static uint32_t crc_table[8][256];
static pthread_once_t crc_table_once = PTHREAD_ONCE_INIT;

static void crc_table_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? (c >> 1) ^ CRC32_REFLECTED_POLY : c >> 1;
        }
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xFF] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
}

/* Runs the CRC register (no inversions) over n bytes, slice-by-8 on little-endian machines. */
static uint32_t crc_scalar(uint32_t reg, const unsigned char *p, size_t n)
{
    while (n > 0 && ((uintptr_t)p & 7) != 0) {
        reg = crc_table[0][(reg ^ *p++) & 0xFF] ^ (reg >> 8);
        n--;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= reg;
        reg = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF]
              ^ crc_table[5][(w >> 16) & 0xFF] ^ crc_table[4][(w >> 24) & 0xFF]
              ^ crc_table[3][(w >> 32) & 0xFF] ^ crc_table[2][(w >> 40) & 0xFF]
              ^ crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
#endif
    while (n-- > 0) {
        reg = crc_table[0][(reg ^ *p++) & 0xFF] ^ (reg >> 8);
    }
    return reg;
}

#ifdef DS_CRC_X86
/* Fold constants (k_low, k_high) by distance in bytes; see tools/crc32_constants.py. */
#define CRC_K16_LOW 0x65673b4600000000ULL
#define CRC_K16_HIGH 0x9ba54c6f00000000ULL
#define CRC_K64_LOW 0x653d982200000000ULL
#define CRC_K64_HIGH 0xcad38e8f00000000ULL
#define CRC_K256_LOW 0x7cc8e1e700000000ULL
#define CRC_K256_HIGH 0x03f9f86300000000ULL

#define TARGET_PCLMUL __attribute__((target("pclmul,sse4.1")))
#define TARGET_VPCLMUL __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1,avx")))

TARGET_PCLMUL static inline __m128i crc_fold(__m128i x, __m128i k)
{
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

TARGET_PCLMUL static inline __m128i crc_k(unsigned long long low, unsigned long long high)
{
    return _mm_set_epi64x((long long)high, (long long)low);
}

/* Folds four consecutive lanes into one, then the whole lanes of p, then reduces with the table.
 * Always inlined, so that inside crc_vpclmul it is VEX-encoded (no SSE/AVX transitions). */
TARGET_PCLMUL static inline __attribute__((always_inline)) uint32_t crc_finish(__m128i x0, __m128i x1, __m128i x2, __m128i x3,
                                         const unsigned char *p, size_t n)
{
    const __m128i k16 = crc_k(CRC_K16_LOW, CRC_K16_HIGH);
    x1 = _mm_xor_si128(x1, crc_fold(x0, k16));
    x2 = _mm_xor_si128(x2, crc_fold(x1, k16));
    x3 = _mm_xor_si128(x3, crc_fold(x2, k16));
    for (; n >= 16; p += 16, n -= 16) {
        x3 = _mm_xor_si128(crc_fold(x3, k16), _mm_loadu_si128((const __m128i *)p));
    }
    unsigned char lane[16];
    _mm_storeu_si128((__m128i *)lane, x3);
    return crc_scalar(crc_scalar(0, lane, 16), p, n);
}

TARGET_PCLMUL static uint32_t crc_pclmul(uint32_t reg, const unsigned char *p, size_t n)
{
    if (n < 64) {
        return crc_scalar(reg, p, n);
    }
    const __m128i k64 = crc_k(CRC_K64_LOW, CRC_K64_HIGH);
    __m128i x0 = _mm_loadu_si128((const __m128i *)p);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)reg));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        x0 = _mm_xor_si128(crc_fold(x0, k64), _mm_loadu_si128((const __m128i *)p));
        x1 = _mm_xor_si128(crc_fold(x1, k64), _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = _mm_xor_si128(crc_fold(x2, k64), _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = _mm_xor_si128(crc_fold(x3, k64), _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    return crc_finish(x0, x1, x2, x3, p, n);
}

TARGET_VPCLMUL static inline __m512i crc_fold512(__m512i x, __m512i k)
{
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                            _mm512_clmulepi64_epi128(x, k, 0x11));
}

TARGET_VPCLMUL static uint32_t crc_vpclmul(uint32_t reg, const unsigned char *p, size_t n)
{
    if (n < 256) {
        return crc_pclmul(reg, p, n);
    }
    const __m512i k256 = _mm512_broadcast_i32x4(crc_k(CRC_K256_LOW, CRC_K256_HIGH));
    const __m512i k64 = _mm512_broadcast_i32x4(crc_k(CRC_K64_LOW, CRC_K64_HIGH));
    __m512i z0 = _mm512_loadu_si512((const void *)p);
    __m512i z1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i z2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i z3 = _mm512_loadu_si512((const void *)(p + 192));
    z0 = _mm512_xor_si512(
        z0, _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)reg), 0));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        z0 = _mm512_xor_si512(crc_fold512(z0, k256), _mm512_loadu_si512((const void *)p));
        z1 = _mm512_xor_si512(crc_fold512(z1, k256), _mm512_loadu_si512((const void *)(p + 64)));
        z2 = _mm512_xor_si512(crc_fold512(z2, k256), _mm512_loadu_si512((const void *)(p + 128)));
        z3 = _mm512_xor_si512(crc_fold512(z3, k256), _mm512_loadu_si512((const void *)(p + 192)));
    }
    z1 = _mm512_xor_si512(z1, crc_fold512(z0, k64));
    z2 = _mm512_xor_si512(z2, crc_fold512(z1, k64));
    z3 = _mm512_xor_si512(z3, crc_fold512(z2, k64));
    for (; n >= 64; p += 64, n -= 64) {
        z3 = _mm512_xor_si512(crc_fold512(z3, k64), _mm512_loadu_si512((const void *)p));
    }
    const __m128i x0 = _mm512_extracti32x4_epi32(z3, 0), x1 = _mm512_extracti32x4_epi32(z3, 1);
    const __m128i x2 = _mm512_extracti32x4_epi32(z3, 2), x3 = _mm512_extracti32x4_epi32(z3, 3);
    /* Clean ZMM upper halves: legacy-SSE code run after dirty ones (the caller's, the Python
     * interpreter's) stalls on Intel cores, and GCC emits no VZEROUPPER here by itself. */
    _mm256_zeroupper();
    return crc_finish(x0, x1, x2, x3, p, n);
}
#endif /* DS_CRC_X86 */

int ds_native_crc32_simd_supported(int simd)
{
    switch (simd) {
    case DS_NATIVE_CRC32_SCALAR:
        return 1;
#ifdef DS_CRC_X86
    case DS_NATIVE_CRC32_PCLMUL:
        __builtin_cpu_init();
        return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    case DS_NATIVE_CRC32_VPCLMUL:
        if (!ds_native_crc32_simd_supported(DS_NATIVE_CRC32_PCLMUL)
            || !__builtin_cpu_supports("avx512f")) { /* libgcc also checks the OS saves ZMM */
            return 0;
        }
        return (ds_native_cpuid_ecx(7) >> 10) & 1; /* CPUID.(EAX=7,ECX=0):ECX[10] = VPCLMULQDQ */
#endif
    default:
        return 0;
    }
}

int ds_native_crc32_auto_simd(void)
{
    static int cached = 0; /* benign race: every thread computes the same value */
    int simd = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (simd == 0) {
        simd = ds_native_crc32_simd_supported(DS_NATIVE_CRC32_VPCLMUL)  ? DS_NATIVE_CRC32_VPCLMUL
               : ds_native_crc32_simd_supported(DS_NATIVE_CRC32_PCLMUL) ? DS_NATIVE_CRC32_PCLMUL
                                                                        : DS_NATIVE_CRC32_SCALAR;
        __atomic_store_n(&cached, simd, __ATOMIC_RELAXED);
    }
    return simd;
}

/* The path that runs for `simd` over n bytes: AUTO (or a path this CPU cannot run) becomes the
 * widest the CPU runs, vpclmul only from CRC_VPCLMUL_MIN_BYTES. */
static int crc_path(int simd, size_t n)
{
    if (simd == DS_NATIVE_CRC32_AUTO || !ds_native_crc32_simd_supported(simd)) {
        simd = ds_native_crc32_auto_simd();
        if (simd == DS_NATIVE_CRC32_VPCLMUL && n < CRC_VPCLMUL_MIN_BYTES) {
            simd = DS_NATIVE_CRC32_PCLMUL;
        }
    }
    return simd;
}

/* Whether every span [starts[i], starts[i] + lengths[i]) lies within `size` bytes. */
static int spans_inside(size_t size, const uint64_t *starts, const uint64_t *lengths, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        if (starts[i] > size || lengths[i] > size - starts[i]) {
            return 0;
        }
    }
    return 1;
}

uint32_t ds_native_crc32(uint32_t value, const void *data, size_t n, int simd)
{
    pthread_once(&crc_table_once, crc_table_init);
    simd = crc_path(simd, n);
    const unsigned char *p = (const unsigned char *)data;
    uint32_t reg = ~value;
    switch (simd) {
#ifdef DS_CRC_X86
    case DS_NATIVE_CRC32_VPCLMUL:
        reg = crc_vpclmul(reg, p, n);
        break;
    case DS_NATIVE_CRC32_PCLMUL:
        reg = crc_pclmul(reg, p, n);
        break;
#endif
    default:
        reg = crc_scalar(reg, p, n);
        break;
    }
    return ~reg;
}

int ds_native_crc32_spans(const void *data, size_t size, const uint64_t *starts,
                          const uint64_t *lengths, size_t count, int chained, int simd,
                          uint32_t *out)
{
    const unsigned char *base = (const unsigned char *)data;
    uint32_t value = 0;
    if (!spans_inside(size, starts, lengths, count)) { /* all checked first: nothing half-done */
        return -1;
    }
    for (size_t i = 0; i < count; i++) {
        value = ds_native_crc32(chained ? value : 0, base + starts[i], lengths[i], simd);
        out[i] = value;
    }
    return 0;
}

/* [Note: copying while hashing]
 * A loader that hashes a file's tensors and then copies them out of the page cache reads every
 * byte from memory twice; on a machine whose memory bandwidth the loader's other work shares,
 * the second pass is what verification costs. Copying a block and hashing it from the copy while
 * the cache holds it (64 KiB: well inside any L2) reads the source once, and the CRC then covers
 * exactly the bytes the caller will use, not a page that may change between the two reads. The
 * code path is chosen once per span, by the span's length, as one call over it would be.
 */
#define CRC_COPY_BLOCK ((size_t)64 << 10)

/* Copies span [from, from + n) to `to` and gives its CRC-32, block by block, on path `path`. */
static uint32_t copy_span(const unsigned char *from, size_t n, unsigned char *to, int path)
{
    uint32_t value = 0;
    for (size_t done = 0; done < n;) {
        size_t block = n - done < CRC_COPY_BLOCK ? n - done : CRC_COPY_BLOCK;
        memcpy(to, from + done, block);
        value = ds_native_crc32(value, to, block, path);
        to += block;
        done += block;
    }
    return value;
}

/* [Note: spans shared among threads]
 * A loader hands a file's copying to a checksum thread while it reads, and at the verdict, with
 * nothing left to read, copies too. Split into jobs of a few spans each, the thread took the GIL
 * back at the end of every job, from a loader that was still unpickling: on the 2-core VM the
 * first 8 MB job of a 40 MB model file ran 1.2 ms of copying in 3-4 ms, waiting for the GIL the
 * rest of the time, and the Python between two jobs (a few hundred microseconds of it) waited
 * again. Here every caller takes the next span not yet taken, through the shared cursor *next,
 * until none is left: a thread copies the whole file in one call, taking the GIL back once, and
 * a loader that calls in at the verdict shares what is left span by span. A span is copied
 * whole by the caller that took it, so its CRC-32 needs no combining; out[i] is final once
 * every caller has returned. Storing count into *next (ds_native_crc32_copy_stop) leaves the
 * spans not yet taken uncopied. */
int ds_native_crc32_copy_spans_shared(const void *src, size_t size, const uint64_t *starts,
                                      const uint64_t *lengths, size_t count, void *const *dsts,
                                      int simd, uint32_t *out, uint64_t *next)
{
    const unsigned char *base = (const unsigned char *)src;
    if (!spans_inside(size, starts, lengths, count)) { /* all checked first: nothing half-copied */
        return -1;
    }
    for (;;) {
        uint64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= count) {
            return 0;
        }
        int path = crc_path(simd, lengths[i]); /* the path one call over the span would take */
        out[i] = copy_span(base + starts[i], lengths[i], (unsigned char *)dsts[i], path);
    }
}

void ds_native_crc32_copy_stop(uint64_t *next, size_t count)
{
    __atomic_store_n(next, (uint64_t)count, __ATOMIC_RELAXED);
}

int ds_native_crc32_copy_spans(const void *src, size_t size, const uint64_t *starts,
                               const uint64_t *lengths, size_t count, void *const *dsts, int simd,
                               uint32_t *out)
{
    uint64_t next = 0;
    return ds_native_crc32_copy_spans_shared(src, size, starts, lengths, count, dsts, simd, out,
                                             &next);
}
