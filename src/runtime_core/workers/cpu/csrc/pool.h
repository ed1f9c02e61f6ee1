/* pool.h: the threads of a stage's kernels.
 *
 * pool_run(threads, n, fn, ctx) runs fn(ctx, i) for every i < n on up to `threads`
 * threads (the caller's and threads - 1 workers) and returns when all are done: one
 * synchronization per call (the job published, the caller woken once at its end).
 *
 * Each of the T = min(threads, n) participants owns a contiguous range of the items
 * (participant p: items p n / T .. (p + 1) n / T - 1, the caller p = 0) and runs it in
 * order, so every thread streams its own rows of a matrix and no two threads write
 * the same cache lines but at a range's edge. A participant that has finished its
 * range takes the next items of the others' (from their fronts): a thread that is not
 * running (the host busy with other processes) is not waited for, only items already
 * claimed are. Which thread runs an item never changes what the item computes.
 *
 * Waiting never holds a core for long: a worker spins POOL_SPIN_NS after its last job
 * (the next operation of a step follows within microseconds), then blocks (a futex on
 * Linux, a condition variable elsewhere) until the next job; the caller spins as long
 * at most for the items others hold, then blocks until the last of them wakes it.
 *
 * pool_threads(threads, work) is the threads worth waking for `work` units (bytes or
 * multiply-adds) of an operation: 1 below POOL_MIN_WORK, so that small operations run
 * on the caller's thread without a synchronization.
 */
#ifndef GPP_POOL_H
#define GPP_POOL_H

#include <stdint.h>

#ifndef POOL_SPIN_NS
#define POOL_SPIN_NS 100000L /* 100 us */
#endif
#define POOL_MIN_WORK 65536   /* below this, one thread */
#define POOL_MAX_THREADS 1024 /* participants of a job at most (calls.c refuses more) */

typedef void (*pool_fn)(void *ctx, int64_t item);

void pool_run(int threads, int64_t n, pool_fn fn, void *ctx);

static inline int pool_threads(int threads, int64_t work) {
    return work < POOL_MIN_WORK ? 1 : threads;
}

#endif
