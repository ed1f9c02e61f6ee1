/* pool_order.c: a white-box check of csrc/pool.c (included whole), which
 * tests/runtime_core/workers/cpu/test_cpu_pool.py compiles and runs.
 *
 * The caller runs one job after another on 2 threads (itself and one worker), each
 * job with its own item count (3, 64 and 17 in turn, by the job's number) and its own
 * cells (its context: one of three arrays, in turn), each item adding 1 to its cell.
 * A watcher thread reads range 1's ticket word, its end and its ticket word again
 * (each acquire), over and over. Asserted:
 *   - a range's end is never seen before its ticket has moved to the job that end
 *     belongs to (else a worker left in the last job, with that job's ticket, could
 *     claim an item up to the new end: it runs the last job's function on an item past
 *     that job's end, with that job's context, and counts it in the new job's `done`,
 *     which lets the new job return while an item of it is unfinished);
 *   - every item of every job ran exactly once, and nothing ran past a job's end: after
 *     each job its cells and the last job's are 1 below its item count and 0 above,
 *     and the items run in all equal the items of all jobs.
 * Runs for SECONDS, or until the first end seen early. Prints the counts; exits 1 when
 * an assertion failed.
 *
 *   cc -O2 -pthread -I src/runtime_core/workers/cpu/csrc tests/support/pool_order.c -o pool_order
 *   ./pool_order SECONDS
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <pthread.h>
#include <stdatomic.h>

#define CELLS 64
#define CELLS_MAX 64
static const int64_t COUNTS[3] = {3, CELLS, 17}; /* job g has COUNTS[g % 3] items */
static int cells[3][CELLS];
static _Atomic long items_run;

static void add_one(void *ctx, int64_t i) {
    ((int *)ctx)[i] += 1; /* an item past its job's end lands in a cell checked as 0 */
    atomic_fetch_add_explicit(&items_run, 1, memory_order_relaxed);
}

/* The order in which pool_run stores a job's words: every atomic store of the thread
 * that records (the caller), by address, while `recording`. */
static pthread_t recorder;
static int recording;
static const void *stored[256];
static int n_stored;

static void note_store(const void *obj) {
    if (recording && pthread_equal(pthread_self(), recorder) && n_stored < 256)
        stored[n_stored++] = obj;
}

#undef atomic_store_explicit
#undef atomic_store
#define atomic_store_explicit(obj, val, order) \
    (note_store((const void *)(obj)), __atomic_store_n((obj), (val), (order)))
#define atomic_store(obj, val) atomic_store_explicit((obj), (val), __ATOMIC_SEQ_CST)

#include "pool.c"

static int stored_at(const void *obj) {
    for (int i = 0; i < n_stored; ++i)
        if (stored[i] == obj) return i;
    return -1;
}

/* Publish one job of `parts` ranges while recording; the ranges whose end pool_run
 * stored before their ticket (or not at all before the job was published). */
static long ends_before_tickets(int parts) {
    static int sink[CELLS_MAX];
    recorder = pthread_self();
    n_stored = 0;
    recording = 1;
    pool_run(parts, CELLS_MAX, add_one, sink);
    recording = 0;
    long bad = 0;
    int gen = stored_at(&P.gen);
    for (int p = 0; p < parts; ++p) {
        int ticket = stored_at(&P.range[p].next), end = stored_at(&P.range[p].end);
        bad += ticket < 0 || end < 0 || end < ticket || gen < end;
    }
    return bad;
}


static _Atomic int stop;
static _Atomic long early_ends, looks;

static void *watch(void *arg) {
    (void)arg;
    long n = 0, early = 0;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        uint64_t before = atomic_load_explicit(&P.range[1].next, memory_order_acquire);
        int64_t end = atomic_load_explicit(&P.range[1].end, memory_order_acquire);
        uint64_t after = atomic_load_explicit(&P.range[1].next, memory_order_acquire);
        uint32_t g = (uint32_t)(after >> 32);
        /* With 2 parts, range 1 of job g ends at COUNTS[g % 3]. While the ticket stays
         * at job g, the end is g's or (before g's is written) the last job's; the next
         * job's end then is an end written before its ticket moved. */
        early += g > 0 && (uint32_t)(before >> 32) == g && end == COUNTS[(g + 1) % 3];
        ++n;
        if (early) atomic_store(&stop, 1); /* seen: no need to go on */
    }
    atomic_store(&looks, n);
    atomic_store(&early_ends, early);
    return NULL;
}

static long wrong(int g) {
    long bad = 0;
    for (int64_t i = 0; i < CELLS; ++i) bad += cells[g % 3][i] != (i < COUNTS[g % 3]);
    return bad;
}

static double seconds_since(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + 1e-9 * (double)(t.tv_nsec - t0->tv_nsec);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    long n_jobs = 0, wrong_cells = 0, items = 0, ends_early = 0;
    for (int parts = 2; parts <= 4; ++parts) ends_early += ends_before_tickets(parts);
    items = atomic_load(&items_run);
    int first = (int)(atomic_load(&P.gen) + 1);
    pthread_t watcher;
    if (pthread_create(&watcher, NULL, watch, NULL) != 0) return 2;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (; !atomic_load(&stop) && seconds_since(&t0) < seconds; ++n_jobs) {
        int g = (int)(atomic_load(&P.gen) + 1); /* the number pool_run gives this job */
        memset(cells[g % 3], 0, sizeof cells[g % 3]);
        pool_run(2, COUNTS[g % 3], add_one, cells[g % 3]);
        items += COUNTS[g % 3];
        wrong_cells += wrong(g);
        if (g > first) wrong_cells += wrong(g - 1); /* a late item of the last job */
    }
    atomic_store(&stop, 1);
    pthread_join(watcher, NULL);
    long stray = atomic_load(&items_run) - items;
    printf("ends_before_tickets %ld jobs %ld looks %ld early_ends %ld wrong_cells %ld "
           "stray_items %ld\n",
           ends_early, n_jobs, atomic_load(&looks), atomic_load(&early_ends), wrong_cells, stray);
    return ends_early || atomic_load(&early_ends) || wrong_cells || stray ? 1 : 0;
}
