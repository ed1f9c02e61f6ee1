/* pool.h: the threads of a stage's kernels.
 *
 * pool_run(threads, n, fn, ctx) runs fn(ctx, i) for every i < n on up to `threads`
 * threads (the caller's and threads - 1 workers) and returns when all are done. Items
 * are claimed one at a time, so a thread that is not running (the host busy with other
 * processes) takes none and nobody waits for it: only items already claimed are waited
 * for. Which thread runs an item never changes what the item computes. Workers spin a
 * short while after an item (the next operation of a step follows within
 * microseconds), then sleep.
 */
#ifndef GPP_POOL_H
#define GPP_POOL_H

#include <stdint.h>

typedef void (*pool_fn)(void *ctx, int64_t item);

void pool_run(int threads, int64_t n, pool_fn fn, void *ctx);

#endif
