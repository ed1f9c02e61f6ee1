/* pool_order.c: a white-box check of csrc/pool.c (included whole), which
 * tests/runtime_cupy/cpu/test_cpu_pool.py compiles and runs.
 *
 * The caller runs one job after another on 2 threads (itself and one worker), jobs of
 * 3 and of 64 items in turn, each item adding 1 to its own cell. A watcher thread
 * reads the published job's context (acquire) and then the ticket, over and over.
 * Asserted:
 *   - a job's context is never seen before the ticket has moved to that job (else a
 *     worker left in the last job could claim an item with this job's fields: the
 *     item runs twice, and a stray count in `done` lets the job return early);
 *   - after each job every one of its cells is exactly 1.
 * Runs for SECONDS, or until the first context seen early. Prints the counts; exits 1
 * when either assertion failed.
 *
 *   cc -O2 -pthread -I src/runtime_cupy/cpu/csrc tests/support/pool_order.c -o pool_order
 *   ./pool_order SECONDS
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pool.c"

/* A job's context is its number, as pool_run will give it (never dereferenced). */
static int cells[64];

static void add_one(void *ctx, int64_t i) {
    (void)ctx;
    cells[i] += 1;
}

static _Atomic int stop;
static _Atomic long early_fields, looks;

static void *watch(void *arg) {
    (void)arg;
    long n = 0, early = 0;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        uint32_t gen = (uint32_t)(uintptr_t)atomic_load_explicit(&P.ctx, memory_order_acquire);
        uint64_t ticket = atomic_load_explicit(&P.ticket, memory_order_relaxed);
        early += (uint32_t)(ticket >> 32) < gen;
        ++n;
        if (early) atomic_store(&stop, 1); /* seen: no need to go on */
    }
    atomic_store(&looks, n);
    atomic_store(&early_fields, early);
    return NULL;
}

static double seconds_since(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + 1e-9 * (double)(t.tv_nsec - t0->tv_nsec);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    long n_jobs = 0, wrong_cells = 0;
    pthread_t watcher;
    if (pthread_create(&watcher, NULL, watch, NULL) != 0) return 2;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (; !atomic_load(&stop) && seconds_since(&t0) < seconds; ++n_jobs) {
        int64_t n = n_jobs % 2 ? 3 : 64;
        void *job = (void *)(uintptr_t)(atomic_load(&P.gen) + 1);
        memset(cells, 0, sizeof cells);
        pool_run(2, n, add_one, job);
        for (int64_t i = 0; i < n; ++i) wrong_cells += cells[i] != 1;
    }
    atomic_store(&stop, 1);
    pthread_join(watcher, NULL);
    printf("jobs %ld looks %ld early_fields %ld wrong_cells %ld\n", n_jobs, atomic_load(&looks),
           atomic_load(&early_fields), wrong_cells);
    return atomic_load(&early_fields) || wrong_cells ? 1 : 0;
}
