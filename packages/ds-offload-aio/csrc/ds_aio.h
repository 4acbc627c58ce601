/* C API of ds_offload_aio's libaio engine, and cffi's cdef source: build_ffi.py feeds this file to
 * cffi with the preprocessor lines removed, so keep it to plain declarations.
 */
#ifndef DS_AIO_H
#define DS_AIO_H

#include <stdint.h>

/* One io context (io_setup) with its control blocks; used by one thread at a time. */
typedef struct ds_aio_ctx ds_aio_ctx;

/* The outcome of ds_aio_transfer. */
typedef struct {
    int64_t bytes;        /* bytes completed */
    int64_t error_offset; /* file offset of the first failure, -1 when none */
    int error;            /* 0, an errno value, or DS_AIO_SHORT */
} ds_aio_status;

enum ds_aio_codes {
    DS_AIO_SHORT = -1 /* a request completed with fewer bytes than asked (end of file, full disk) */
};

/* Returns NULL and sets *error (an errno value) when io_setup or an allocation fails. */
ds_aio_ctx *ds_aio_ctx_new(int queue_depth, int *error);
void ds_aio_ctx_free(ds_aio_ctx *ctx);

/* Reads (is_read != 0) or writes nbytes between buf and the file at offset, in block_size
 * requests with up to queue_depth in flight. For an O_DIRECT fd, buf, nbytes and offset must be
 * aligned to the device's logical block size. single_submit: one io_submit call per request.
 * overlap_events: refill the queue as each request completes instead of batch by batch.
 * Returns status->error; every submitted request has completed when it returns.
 */
int ds_aio_transfer(ds_aio_ctx *ctx, int fd, int is_read, char *buf, int64_t nbytes,
                    int64_t offset, int64_t block_size, int single_submit, int overlap_events,
                    ds_aio_status *status);

#endif /* DS_AIO_H */
