/* [Note: thread pool]
 * The parallel kernels (CPU-Adam) split a loop over a tensor across threads with this pool rather
 * than OpenMP. torch ships its own libgomp; linking the system one as well puts two OpenMP
 * runtimes with two sets of spinning threads in one process, and GNU libgomp's pool does not
 * survive fork(), which the multi-rank test harness and DataLoader workers both do.
 *
 * - Workers are started on first use and sleep on a condition variable between loops: nothing
 *   spins, so the pool does not compete with torch's threads when idle.
 * - One loop at a time. cffi releases the GIL around C calls, so two Python threads can call in
 *   concurrently; the second finds the pool busy (trylock) and runs its loop on its own thread.
 * - Chunks are handed out dynamically (an atomic counter), so a thread that the OS deschedules on
 *   a busy machine does not hold up the loop with a fixed share of the work.
 * - fork(): the child inherits the pool's memory but none of its threads. A pthread_atfork child
 *   handler resets the pool to "no workers", and the next loop starts fresh ones.
 */
#include "thread_pool.h"

#include <stddef.h>

#if defined(_WIN32)

void ds_native_parallel_for(int64_t n, int64_t grain, int num_threads, ds_native_range_fn fn,
                            void *ctx)
{
    (void)grain;
    (void)num_threads;
    if (n > 0) {
        fn(ctx, 0, n);
    }
}

#else

#include <pthread.h>
#include <stdatomic.h>

static void run_chunks(int64_t n, int64_t grain, atomic_llong *next, ds_native_range_fn fn,
                       void *ctx)
{
    for (;;) {
        int64_t begin = atomic_fetch_add_explicit(next, grain, memory_order_relaxed);
        if (begin >= n) {
            return;
        }
        fn(ctx, begin, begin + grain < n ? begin + grain : n);
    }
}

#define MAX_WORKERS 255

typedef struct {
    pthread_mutex_t dispatch; /* held by the caller whose loop the workers run */
    pthread_mutex_t mutex;    /* guards everything below */
    pthread_cond_t wake;      /* workers wait here for the next generation */
    pthread_cond_t finished;  /* the caller waits here for `running` to reach 0 */
    int n_workers;            /* workers started, ids 0 .. n_workers - 1 */
    uint64_t generation;      /* bumped once per loop */
    uint64_t spawn_generation; /* generation when the newest workers were started */
    int participants;         /* workers with id < participants take part in this loop */
    int running;              /* participants that have not finished this loop */
    /* The current loop. */
    int64_t n;
    int64_t grain;
    ds_native_range_fn fn;
    void *ctx;
    atomic_llong next;
} pool_t;

static pool_t pool = {
    .dispatch = PTHREAD_MUTEX_INITIALIZER,
    .mutex = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .finished = PTHREAD_COND_INITIALIZER,
};
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void *worker_main(void *arg)
{
    int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.mutex);
    /* Not pool.generation: the loop this worker was started for may have bumped it already. */
    uint64_t seen = pool.spawn_generation;
    for (;;) {
        while (pool.generation == seen) {
            pthread_cond_wait(&pool.wake, &pool.mutex);
        }
        seen = pool.generation;
        if (id >= pool.participants) {
            continue;
        }
        pthread_mutex_unlock(&pool.mutex);
        run_chunks(pool.n, pool.grain, &pool.next, pool.fn, pool.ctx);
        pthread_mutex_lock(&pool.mutex);
        if (--pool.running == 0) {
            pthread_cond_signal(&pool.finished);
        }
    }
    return NULL;
}

/* fork(): hold the locks across it so the child copies a consistent pool. */
static void before_fork(void)
{
    pthread_mutex_lock(&pool.dispatch);
    pthread_mutex_lock(&pool.mutex);
}

static void after_fork_parent(void)
{
    pthread_mutex_unlock(&pool.mutex);
    pthread_mutex_unlock(&pool.dispatch);
}

static void after_fork_child(void)
{
    /* The workers did not come along; the condition variables may still count them as waiters,
     * so they are re-created rather than reused. */
    pthread_mutex_init(&pool.dispatch, NULL);
    pthread_mutex_init(&pool.mutex, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pool.n_workers = 0;
    pool.participants = 0;
    pool.running = 0;
}

static void register_atfork(void)
{
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* Starts workers up to `wanted` (called with pool.mutex held); returns how many exist. */
static int ensure_workers(int wanted)
{
    if (wanted > MAX_WORKERS) {
        wanted = MAX_WORKERS;
    }
    pool.spawn_generation = pool.generation;
    while (pool.n_workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)pool.n_workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            break; /* run with the workers there are */
        }
        ++pool.n_workers;
    }
    return pool.n_workers;
}

void ds_native_parallel_for(int64_t n, int64_t grain, int num_threads, ds_native_range_fn fn,
                            void *ctx)
{
    if (n <= 0) {
        return;
    }
    if (grain < 1) {
        grain = 1;
    }
    int64_t chunks = (n + grain - 1) / grain;
    if (num_threads > chunks) {
        num_threads = (int)chunks;
    }
    pthread_once(&atfork_once, register_atfork);
    if (num_threads <= 1 || pthread_mutex_trylock(&pool.dispatch) != 0) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool.mutex);
    pool.participants = ensure_workers(num_threads - 1);
    pool.running = pool.participants;
    pool.n = n;
    pool.grain = grain;
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    ++pool.generation;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mutex);

    run_chunks(n, grain, &pool.next, fn, ctx);

    pthread_mutex_lock(&pool.mutex);
    while (pool.running > 0) {
        pthread_cond_wait(&pool.finished, &pool.mutex);
    }
    pthread_mutex_unlock(&pool.mutex);
    pthread_mutex_unlock(&pool.dispatch);
}

#endif
