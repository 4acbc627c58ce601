/* Internal to the C sources (not part of cffi's cdef): a small persistent pthread pool that runs
 * one parallel loop at a time. See [Note: thread pool] in thread_pool.c.
 */
#ifndef DS_NATIVE_THREAD_POOL_H
#define DS_NATIVE_THREAD_POOL_H

#include <stdint.h>

/* Processes elements [begin, end) of a parallel loop; ctx is the caller's argument. */
typedef void (*ds_native_range_fn)(void *ctx, int64_t begin, int64_t end);

/* Calls fn(ctx, begin, end) over consecutive chunks of `grain` elements covering [0, n), on up to
 * num_threads threads (the caller is one of them), and returns when all chunks are done. Runs on
 * the calling thread alone when num_threads <= 1, when n fits in one chunk, or when another
 * thread is using the pool at the same time.
 */
void ds_native_parallel_for(int64_t n, int64_t grain, int num_threads, ds_native_range_fn fn,
                            void *ctx);

#endif /* DS_NATIVE_THREAD_POOL_H */
