/* Build and CPU introspection. ds_native_simd_level() asks the running CPU (and, through libgcc,
 * the OS) what it supports; the kernels' runtime dispatch will key off the same answer.
 */
#include "ds_native.h"

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
