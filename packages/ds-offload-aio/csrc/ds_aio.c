/* libaio engine: one contiguous transfer between memory and a file, queue_depth requests deep.
 *
 * Python splits an op into per-thread slices (intra_op_parallelism) and calls ds_aio_transfer
 * from each worker thread with that thread's own context; cffi releases the GIL around the call.
 * Errors never stop the drain: after the first failure nothing new is submitted, every request
 * in flight is reaped (the kernel may still be writing into the buffer), and the first failure
 * is reported with its file offset.
 */
#define _GNU_SOURCE
#include "ds_aio.h"

#include <errno.h>
#include <libaio.h>
#include <stdlib.h>
#include <string.h>

struct ds_aio_ctx {
    io_context_t io;
    int depth;
    struct iocb *blocks;    /* depth control blocks */
    struct iocb **idle;     /* stack of control blocks not in use */
    int n_idle;
    struct iocb **prepared; /* prepared, not yet accepted by io_submit */
    int n_prepared;
    struct io_event *events;
};

void ds_aio_ctx_free(ds_aio_ctx *ctx)
{
    if (ctx == NULL) return;
    if (ctx->io) io_destroy(ctx->io);
    free(ctx->blocks);
    free(ctx->idle);
    free(ctx->prepared);
    free(ctx->events);
    free(ctx);
}

ds_aio_ctx *ds_aio_ctx_new(int queue_depth, int *error)
{
    ds_aio_ctx *ctx = calloc(1, sizeof *ctx);
    if (queue_depth < 1) {
        *error = EINVAL;
        free(ctx);
        return NULL;
    }
    if (ctx != NULL) {
        ctx->depth = queue_depth;
        ctx->blocks = calloc(queue_depth, sizeof *ctx->blocks);
        ctx->idle = calloc(queue_depth, sizeof *ctx->idle);
        ctx->prepared = calloc(queue_depth, sizeof *ctx->prepared);
        ctx->events = calloc(queue_depth, sizeof *ctx->events);
    }
    if (ctx == NULL || !ctx->blocks || !ctx->idle || !ctx->prepared || !ctx->events) {
        *error = ENOMEM;
        ds_aio_ctx_free(ctx);
        return NULL;
    }
    int rc = io_setup(queue_depth, &ctx->io); /* libaio returns -errno */
    if (rc < 0) {
        ctx->io = 0;
        *error = -rc;
        ds_aio_ctx_free(ctx);
        return NULL;
    }
    for (int i = 0; i < queue_depth; i++) ctx->idle[i] = &ctx->blocks[i];
    ctx->n_idle = queue_depth;
    *error = 0;
    return ctx;
}

typedef struct {
    ds_aio_ctx *ctx;
    int fd, is_read, single_submit;
    char *buf;
    int64_t nbytes, offset, block_size;
    int64_t prepared_bytes; /* bytes handed to control blocks so far */
    int in_flight;
    ds_aio_status *status;
} transfer_t;

static void fail(transfer_t *t, int error, int64_t offset)
{
    if (t->status->error == 0) {
        t->status->error = error;
        t->status->error_offset = offset;
    }
}

static void prepare(transfer_t *t)
{
    ds_aio_ctx *ctx = t->ctx;
    while (t->status->error == 0 && t->prepared_bytes < t->nbytes && ctx->n_idle > 0) {
        struct iocb *cb = ctx->idle[--ctx->n_idle];
        int64_t left = t->nbytes - t->prepared_bytes;
        size_t len = (size_t)(left < t->block_size ? left : t->block_size);
        char *at = t->buf + t->prepared_bytes;
        long long pos = t->offset + t->prepared_bytes;
        if (t->is_read)
            io_prep_pread(cb, t->fd, at, len, pos);
        else
            io_prep_pwrite(cb, t->fd, at, len, pos);
        ctx->prepared[ctx->n_prepared++] = cb;
        t->prepared_bytes += (int64_t)len;
    }
}

static void release_prepared(ds_aio_ctx *ctx, int from)
{
    for (int i = from; i < ctx->n_prepared; i++) ctx->idle[ctx->n_idle++] = ctx->prepared[i];
    ctx->n_prepared = from;
}

/* Hands prepared blocks to the kernel; on EAGAIN with requests in flight, keeps the rest for
 * after the next reap. */
static void submit(transfer_t *t)
{
    ds_aio_ctx *ctx = t->ctx;
    int accepted = 0;
    while (accepted < ctx->n_prepared) {
        if (t->status->error != 0) break;
        int batch = t->single_submit ? 1 : ctx->n_prepared - accepted;
        int rc = io_submit(ctx->io, batch, ctx->prepared + accepted);
        if (rc > 0) {
            accepted += rc;
            t->in_flight += rc;
        } else if (rc == -EINTR) {
            continue;
        } else if ((rc == 0 || rc == -EAGAIN) && t->in_flight > 0) {
            break;
        } else {
            fail(t, rc < 0 ? -rc : EAGAIN, (int64_t)ctx->prepared[accepted]->u.c.offset);
        }
    }
    if (t->status->error != 0) release_prepared(ctx, accepted);
    memmove(ctx->prepared, ctx->prepared + accepted,
            (size_t)(ctx->n_prepared - accepted) * sizeof *ctx->prepared);
    ctx->n_prepared -= accepted;
}

static void reap(transfer_t *t, int min_events)
{
    ds_aio_ctx *ctx = t->ctx;
    int n;
    do {
        n = io_getevents(ctx->io, min_events, ctx->depth, ctx->events, NULL);
    } while (n == -EINTR);
    if (n < 0) {
        /* Only a corrupted context gets here; nothing more can be learned about the requests. */
        fail(t, -n, t->offset + t->status->bytes);
        t->in_flight = 0;
        return;
    }
    for (int i = 0; i < n; i++) {
        struct iocb *cb = ctx->events[i].obj;
        long res = (long)ctx->events[i].res;
        int64_t at = (int64_t)cb->u.c.offset;
        if (res < 0)
            fail(t, (int)-res, at);
        else if ((uint64_t)res < cb->u.c.nbytes)
            fail(t, DS_AIO_SHORT, at + res);
        else
            t->status->bytes += res;
        ctx->idle[ctx->n_idle++] = cb;
        t->in_flight--;
    }
}

int ds_aio_transfer(ds_aio_ctx *ctx, int fd, int is_read, char *buf, int64_t nbytes,
                    int64_t offset, int64_t block_size, int single_submit, int overlap_events,
                    ds_aio_status *status)
{
    transfer_t t = {ctx, fd, is_read, single_submit, buf, nbytes, offset, block_size, 0, 0,
                    status};
    status->bytes = 0;
    status->error = 0;
    status->error_offset = -1;
    if (block_size <= 0 || nbytes < 0 || offset < 0) {
        fail(&t, EINVAL, offset);
        return status->error;
    }
    for (;;) {
        prepare(&t);
        submit(&t);
        if (t.in_flight == 0) break; /* done, or failed with nothing left to drain */
        /* Sequential mode waits for the whole batch before preparing the next one. */
        reap(&t, overlap_events ? 1 : t.in_flight);
    }
    release_prepared(ctx, 0);
    return status->error;
}
