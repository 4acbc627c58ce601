/* C API of ds_native, and the single source of truth for cffi's cdef: build_ffi.py feeds this file
 * to cffi with the preprocessor lines removed (cffi's parser accepts declarations only). Keep it to
 * plain declarations; one section per C source file.
 */
#ifndef DS_NATIVE_H
#define DS_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* cpu_features.c: what the compiler targeted and what the running CPU supports. */
const char *ds_native_simd_level(void);
const char *ds_native_compiled_simd(void);
const char *ds_native_compiler(void);

/* Defined in the cffi preamble (build_ffi.py), where the compile arguments are known. */
const char *ds_native_compile_args(void);

/* axpy.c: y[i] += alpha * x[i] for i in [0, n). x and y may be the same buffer. */
void ds_native_axpy_f32(int64_t n, float alpha, const float *x, float *y);

/* adam.c: one Adam / AdamW step, in place and in one pass, over n float32 master parameters and
 * their float32 exp_avg and exp_avg_sq. grad is float32, float16 or bfloat16 (grad_dtype). When
 * param_copy is not NULL the updated parameters are also written there as copy_dtype (float16 or
 * bfloat16, rounded to nearest even). No two buffers may overlap. Runs on up to num_threads
 * threads. simd picks the code path (DS_NATIVE_ADAM_AUTO: the widest this CPU runs). Returns the
 * path that ran, -1 when this CPU or build cannot run the requested path, -2 for a bad dtype.
 */
enum ds_native_dtype { DS_NATIVE_FLOAT32 = 0, DS_NATIVE_FLOAT16 = 1, DS_NATIVE_BFLOAT16 = 2 };
enum ds_native_adam_simd {
    DS_NATIVE_ADAM_AUTO = 0,
    DS_NATIVE_ADAM_SCALAR = 1,
    DS_NATIVE_ADAM_AVX2 = 2,
    DS_NATIVE_ADAM_AVX512 = 3
};
typedef struct {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    int64_t step;        /* 1 on the first step */
    int bias_correction; /* nonzero: divide the moments by 1 - beta^step */
    int adamw_mode;      /* nonzero: decoupled weight decay (AdamW); zero: L2 added to the grad */
} ds_native_adam_hparams;
int ds_native_adam_step(int64_t n, float *param, const void *grad, int grad_dtype, float *exp_avg,
                        float *exp_avg_sq, void *param_copy, int copy_dtype,
                        const ds_native_adam_hparams *hparams, int simd, int num_threads);
/* The path DS_NATIVE_ADAM_AUTO runs on this CPU, and whether a given path can run here. */
int ds_native_adam_auto_simd(void);
int ds_native_adam_simd_supported(int simd);
/* An Adam step's memory traffic without its arithmetic, through the same loops (widest path):
 * x[i] += scalar * g[i] for x in p, m, v. A bandwidth yardstick; no two buffers may overlap. */
void ds_native_stream_adam_traffic(int64_t n, float *p, const float *g, float *m, float *v,
                                   float scalar, int num_threads);

/* stream.c: STREAM's triad a[i] = b[i] + scalar * c[i] for i in [0, n), on up to num_threads
 * threads, a memory-bandwidth yardstick; nontemporal nonzero writes `a` with streaming stores
 * where the CPU has them. a must not partially overlap b or c.
 */
void ds_native_stream_triad(int64_t n, float *a, const float *b, const float *c, float scalar,
                            int nontemporal, int num_threads);

/* crc32.c: zlib's crc32(value, data, n): CRC-32 (polynomial 0x04C11DB7, reflected) of n bytes
 * continuing from the CRC `value` (0 to start). simd picks the code path (AUTO: the widest this CPU
 * runs, vpclmul only from 4 KiB; a path the CPU cannot run also falls back to AUTO). See
 * [Note: CRC-32 folding] there.
 */
enum ds_native_crc32_simd {
    DS_NATIVE_CRC32_AUTO = 0,
    DS_NATIVE_CRC32_SCALAR = 1,
    DS_NATIVE_CRC32_PCLMUL = 2,
    DS_NATIVE_CRC32_VPCLMUL = 3
};
uint32_t ds_native_crc32(uint32_t value, const void *data, size_t n, int simd);
int ds_native_crc32_auto_simd(void);
int ds_native_crc32_simd_supported(int simd);
/* The CRC-32 of each of `count` spans [starts[i], starts[i] + lengths[i]) of the `size` bytes at
 * `data` into out[i], in one call (the GIL released once, however many spans); chained: each span
 * continues from the previous one's CRC, so out[count - 1] is the CRC of the spans one after
 * another. Returns -1 (out untouched) when a span leaves the buffer, else 0.
 */
int ds_native_crc32_spans(const void *data, size_t size, const uint64_t *starts,
                          const uint64_t *lengths, size_t count, int chained, int simd,
                          uint32_t *out);

/* crc32.c: copies each of `count` spans [starts[i], starts[i] + lengths[i]) of the `size` bytes at
 * `src` to dsts[i] and puts the CRC-32 of what was copied into out[i]: one pass over the source,
 * each block hashed while the cache still holds it (see [Note: copying while hashing]). Each
 * dsts[i] holds at least lengths[i] bytes and overlaps no span. Returns -1 (nothing copied, out
 * untouched) when a span leaves `src`, else 0.
 */
int ds_native_crc32_copy_spans(const void *src, size_t size, const uint64_t *starts,
                               const uint64_t *lengths, size_t count, void *const *dsts, int simd,
                               uint32_t *out);

/* crc32.c: ds_native_crc32_copy_spans shared among the threads that call it with the same
 * arguments and cursor (*next, 0 to start): each caller copies and hashes the next span not yet
 * taken until none is left (see [Note: spans shared among threads]). Returns -1 (nothing copied)
 * when a span leaves `src`, else 0; out[i] is final once every caller has returned.
 * ds_native_crc32_copy_stop(next, count) leaves the spans not yet taken uncopied.
 */
int ds_native_crc32_copy_spans_shared(const void *src, size_t size, const uint64_t *starts,
                                      const uint64_t *lengths, size_t count, void *const *dsts,
                                      int simd, uint32_t *out, uint64_t *next);
void ds_native_crc32_copy_stop(uint64_t *next, size_t count);

#endif /* DS_NATIVE_H */
