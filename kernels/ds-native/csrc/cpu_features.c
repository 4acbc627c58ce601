/* Build and CPU introspection. ds_native_simd_level() asks the running CPU (and, through libgcc,
 * the OS) what it supports; the kernels' runtime dispatch will key off the same answer.
 */
#include "cpuid_cache.h"
#include "ds_native.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <cpuid.h>

/* [Note: cpuid asked once]
 * The kernels ask whether the CPU runs a code path on every call that names one, and the copying
 * CRC kernel once per 64 KiB block. libgcc's __builtin_cpu_supports reads answers it keeps; the
 * bits the kernels read themselves (VPCLMULQDQ, F16C) came from the cpuid instruction, which a
 * virtual machine traps to its hypervisor: about 3 us a call on the 2-core development VM,
 * against 0.5 us to hash 4 KiB. Copying and hashing a 40 MB file (640 blocks) took 6.9 ms there,
 * against 6.1 ms for a copy alone (tools/bench/crc32.py, one torch thread); it now takes 5.5 ms.
 * So each leaf's ECX is kept once asked; a race on first use is benign, as every thread finds the
 * same value.
 */
#define CPUID_LEAVES 8

unsigned int ds_native_cpuid_ecx(unsigned int leaf)
{
    static unsigned int known[CPUID_LEAVES];
    static int asked[CPUID_LEAVES];
    if (leaf >= CPUID_LEAVES) {
        return 0;
    }
    if (!__atomic_load_n(&asked[leaf], __ATOMIC_ACQUIRE)) {
        unsigned int eax, ebx, ecx = 0, edx;
        if (!__get_cpuid_count(leaf, 0, &eax, &ebx, &ecx, &edx)) {
            ecx = 0;
        }
        __atomic_store_n(&known[leaf], ecx, __ATOMIC_RELAXED);
        __atomic_store_n(&asked[leaf], 1, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&known[leaf], __ATOMIC_RELAXED);
}
#endif

const char *ds_native_simd_level(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    /* The AVX-512 kernels will use F + BW + VL (masked loads/stores on 16-bit types). */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl")) {
        return "avx512";
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return "avx2";
    }
    return "scalar";
#elif defined(__aarch64__) || defined(__ARM_NEON)
    return "neon"; /* Advanced SIMD is mandatory on AArch64. */
#else
    return "scalar";
#endif
}

const char *ds_native_compiled_simd(void)
{
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#elif defined(__ARM_NEON)
    return "neon";
#elif defined(__SSE2__) || defined(_M_X64)
    return "sse2";
#else
    return "scalar";
#endif
}

const char *ds_native_compiler(void)
{
#if defined(__clang__)
    return "clang " __clang_version__;
#elif defined(__GNUC__)
    return "gcc " __VERSION__;
#elif defined(_MSC_VER)
    return "msvc";
#else
    return "unknown";
#endif
}
