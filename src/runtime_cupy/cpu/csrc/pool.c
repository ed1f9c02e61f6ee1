/* pool.c: pool_run (pool.h) on POSIX threads; one pool per process, its workers made
 * on first use. Without POSIX threads every item runs on the caller's thread. */
#include "pool.h"

#if defined(_WIN32)

void pool_run(int threads, int64_t n, pool_fn fn, void *ctx) {
    (void)threads;
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
}

#else

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_WORKERS 255
#define SPIN_NS 200000L /* a worker spins this long after its last item, then sleeps */

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

static struct {
    pthread_mutex_t job_lock; /* one job at a time; another caller runs its own inline */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    _Atomic uint32_t gen;     /* the job's number; workers wait for it to change */
    _Atomic uint64_t ticket;  /* gen << 32 | the next item */
    _Atomic int64_t done;     /* items finished of the current job */
    _Atomic int sleepers;
    _Atomic(pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic int active; /* workers 0 .. active - 1 take part */
    int n_workers;
} P = {.job_lock = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
       .wake = PTHREAD_COND_INITIALIZER};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* claim the next item of job g; 0 when the job has none left (or is over) */
static int claim(uint32_t g, int64_t n, int64_t *item) {
    uint64_t t = atomic_load_explicit(&P.ticket, memory_order_relaxed);
    for (;;) {
        if ((uint32_t)(t >> 32) != g || (int64_t)(t & 0xffffffffu) >= n) return 0;
        if (atomic_compare_exchange_weak_explicit(&P.ticket, &t, t + 1, memory_order_acquire,
                                                  memory_order_relaxed)) {
            *item = (int64_t)(t & 0xffffffffu);
            return 1;
        }
    }
}

static void work(uint32_t g) {
    /* Job g's fields, unless a later job's are in place already: then that job's
     * pool_run moved the ticket on before it wrote any of them (and a field read here
     * acquires that write), so no claim of g succeeds below. */
    pool_fn fn = atomic_load_explicit(&P.fn, memory_order_acquire);
    void *ctx = atomic_load_explicit(&P.ctx, memory_order_acquire);
    int64_t n = atomic_load_explicit(&P.n, memory_order_acquire), item;
    while (claim(g, n, &item)) { /* a claim succeeds only while job g runs: fn is g's */
        fn(ctx, item);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&P.gen);
    for (;;) {
        uint32_t g;
        long since = now_ns();
        int spins = 0;
        while ((g = atomic_load(&P.gen)) == seen) {
            RELAX();
            if (++spins % 64 == 0 && now_ns() - since > SPIN_NS) {
                pthread_mutex_lock(&P.mu);
                atomic_fetch_add(&P.sleepers, 1);
                while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.wake, &P.mu);
                atomic_fetch_sub(&P.sleepers, 1);
                pthread_mutex_unlock(&P.mu);
            }
        }
        seen = g;
        if (id < atomic_load(&P.active)) work(g);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* the child has none of the parent's workers; its jobs run on its own thread until
     * it makes new ones */
    pthread_mutex_init(&P.job_lock, NULL);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.wake, NULL);
    atomic_store(&P.sleepers, 0);
    P.n_workers = 0;
}

static void grow(int want) {
    static int hooked = 0;
    if (!hooked) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        hooked = 1;
    }
    while (P.n_workers < want && P.n_workers < MAX_WORKERS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)P.n_workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer threads: still correct */
        P.n_workers++;
    }
}

void pool_run(int threads, int64_t n, pool_fn fn, void *ctx) {
    if (threads <= 1 || n <= 1 || pthread_mutex_trylock(&P.job_lock) != 0) {
        for (int64_t i = 0; i < n; ++i) fn(ctx, i);
        return;
    }
    grow(threads - 1);
    /* First the ticket moves to this job, which ends every claim of the last one: a
     * worker may still be in it (it saw its number, then was not running while the job
     * ended). Only then this job's fields, each stored with release: a worker that
     * reads one of them sees the ticket moved on, and cannot take an item of the last
     * job with this job's n (nor run this job's function on an item twice, nor count a
     * stray item in `done`, which let a job return before an item was finished). */
    uint32_t g = atomic_load(&P.gen) + 1;
    atomic_store(&P.ticket, (uint64_t)g << 32);
    atomic_store_explicit(&P.fn, fn, memory_order_release);
    atomic_store_explicit(&P.ctx, ctx, memory_order_release);
    atomic_store_explicit(&P.n, n, memory_order_release);
    atomic_store_explicit(&P.active, threads - 1, memory_order_release);
    atomic_store_explicit(&P.done, 0, memory_order_release);
    atomic_store(&P.gen, g); /* publishes the job (sequentially consistent) */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.wake);
        pthread_mutex_unlock(&P.mu);
    }
    work(g);
    /* wait for the items other threads claimed */
    long since = 0;
    int spins = 0;
    while (atomic_load_explicit(&P.done, memory_order_acquire) < n) {
        RELAX();
        if (++spins % 64 == 0) {
            if (!since) since = now_ns();
            else if (now_ns() - since > 20000L) sched_yield(); /* let a preempted one run */
        }
    }
    pthread_mutex_unlock(&P.job_lock);
}

#endif
