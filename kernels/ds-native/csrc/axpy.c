/* The template for a ds_native kernel: a plain loop over contiguous memory that the compiler
 * vectorises at -O3 for the baseline ISA. Kernels that need wider ISAs (CPU-Adam) add
 * __attribute__((target("avx2,fma"))) variants and pick one from ds_native_simd_level().
 */
#include "ds_native.h"

void ds_native_axpy_f32(int64_t n, float alpha, const float *x, float *y)
{
    /* No `restrict`: x == y is a legal call, and GCC versions the loop on a runtime alias check. */
    for (int64_t i = 0; i < n; ++i) {
        y[i] += alpha * x[i];
    }
}
