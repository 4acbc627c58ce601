/* C API of ds_native, and the single source of truth for cffi's cdef: build_ffi.py feeds this file
 * to cffi with the preprocessor lines removed (cffi's parser accepts declarations only). Keep it to
 * plain declarations; one section per C source file.
 */
#ifndef DS_NATIVE_H
#define DS_NATIVE_H

#include <stdint.h>

/* cpu_features.c: what the compiler targeted and what the running CPU supports. */
const char *ds_native_simd_level(void);
const char *ds_native_compiled_simd(void);
const char *ds_native_compiler(void);

/* Defined in the cffi preamble (build_ffi.py), where the compile arguments are known. */
const char *ds_native_compile_args(void);

/* axpy.c: y[i] += alpha * x[i] for i in [0, n). x and y may be the same buffer. */
void ds_native_axpy_f32(int64_t n, float alpha, const float *x, float *y);

#endif /* DS_NATIVE_H */
