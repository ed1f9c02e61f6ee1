/* pool.c: pool_run (pool.h) on POSIX threads; one pool per process, its workers made
 * on first use. Without POSIX threads every item runs on the caller's thread.
 *
 * A job is published by writing its function, context, item count and the ranges'
 * words, then incrementing the generation `gen`. Every range word (its ticket) holds
 * the generation in its high 32 bits and the range's next item in its low 32: a claim
 * is a compare-and-swap that succeeds only for the job it was read for, so a worker
 * that wakes late (its job finished, another published) claims nothing of the wrong
 * job. A range's ticket moves to a new job before the range's end is written (see
 * pool_run), so no claim pairs a job's ticket with another job's end.
 * `done` counts finished items; each participant adds its count once per range (not
 * once per item), and whoever completes the job wakes the caller if it sleeps. */
#include "pool.h"
#include "fp_env.h"

#if defined(_WIN32)

void pool_run(int threads, int64_t n, pool_fn fn, void *ctx) {
    (void)threads;
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
}

#else

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define LINE 64

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

/* ---- blocking on a word: a futex on Linux, a condition variable elsewhere ---------------- */

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* sleep while *word == value (returns at once when it differs; may return spuriously) */
static void wait_word(_Atomic uint32_t *word, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void wake_word(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
#else
static pthread_mutex_t word_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t word_cv = PTHREAD_COND_INITIALIZER;

static void wait_word(_Atomic uint32_t *word, uint32_t value) {
    pthread_mutex_lock(&word_mu);
    if (atomic_load(word) == value) pthread_cond_wait(&word_cv, &word_mu);
    pthread_mutex_unlock(&word_mu);
}

static void wake_word(_Atomic uint32_t *word) {
    (void)word;
    pthread_mutex_lock(&word_mu);
    pthread_cond_broadcast(&word_cv);
    pthread_mutex_unlock(&word_mu);
}
#endif

/* ---- the pool ------------------------------------------------------------------------------- */

typedef struct {
    _Alignas(LINE) _Atomic uint64_t next; /* gen << 32 | the range's next item */
    _Atomic int64_t end;                  /* one past its last item */
} Range;

static struct {
    pthread_mutex_t job_lock; /* one job at a time; another caller runs its own inline */
    int n_workers;
    _Alignas(LINE) _Atomic uint32_t gen; /* the job's number: idle workers block on it */
    _Atomic int sleepers;                /* workers blocked on gen */
    _Alignas(LINE) _Atomic int64_t done; /* items finished of the current job */
    _Atomic uint32_t caller_waits;       /* 1 while the caller blocks on it */
    _Alignas(LINE) _Atomic(pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic int parts; /* participants 0 (the caller) .. parts - 1 */
    Range range[POOL_MAX_THREADS];
} P = {.job_lock = PTHREAD_MUTEX_INITIALIZER};

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* claim the next item of range r for job g; 0 when it has none left (or g is over) */
static int claim(Range *r, uint32_t g, int64_t *item) {
    uint64_t t = atomic_load_explicit(&r->next, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(t >> 32) != g) return 0;
        int64_t i = (int64_t)(t & 0xffffffffu);
        if (i >= atomic_load_explicit(&r->end, memory_order_acquire)) return 0;
        if (atomic_compare_exchange_weak_explicit(&r->next, &t, t + 1, memory_order_acquire,
                                                  memory_order_acquire)) {
            *item = i;
            return 1;
        }
    }
}

/* `count` more items of a job of n finished; the one completing it wakes the caller */
static void finished(int64_t count, int64_t n) {
    if (atomic_fetch_add(&P.done, count) + count == n && atomic_load(&P.caller_waits)) {
        atomic_store(&P.caller_waits, 0);
        wake_word(&P.caller_waits);
    }
}

/* participant p of job g: its own range in order, then the others' leftovers */
static void participate(uint32_t g, int p, pool_fn fn, void *ctx, int64_t n, int parts) {
    int64_t item, count = 0;
    while (claim(&P.range[p], g, &item)) {
        fn(ctx, item);
        ++count;
    }
    if (count) finished(count, n);
    for (int k = 1; k < parts; ++k) {
        Range *r = &P.range[(p + k) % parts];
        while (claim(r, g, &item)) {
            fn(ctx, item);
            finished(1, n);
        }
    }
}

/* the next job after `seen`: spin POOL_SPIN_NS, then block */
static uint32_t next_job(uint32_t seen) {
    long since = now_ns();
    for (int spins = 1;; ++spins) {
        uint32_t g = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (g != seen) return g;
        RELAX();
        if (spins % 64 == 0 && now_ns() - since > POOL_SPIN_NS) break;
    }
    atomic_fetch_add(&P.sleepers, 1);
    while (atomic_load(&P.gen) == seen) wait_word(&P.gen, seen);
    atomic_fetch_sub(&P.sleepers, 1);
    return atomic_load_explicit(&P.gen, memory_order_acquire);
}

static void *worker(void *arg) {
    int p = (int)(intptr_t)arg; /* its participant index, 1 .. */
    (void)fp_env_enter(); /* IEEE's defaults, whatever the thread that made it had */
    uint32_t g = atomic_load(&P.gen);
    for (;;) {
        g = next_job(g);
        pool_fn fn = atomic_load_explicit(&P.fn, memory_order_acquire);
        void *ctx = atomic_load_explicit(&P.ctx, memory_order_acquire);
        int64_t n = atomic_load_explicit(&P.n, memory_order_acquire);
        int parts = atomic_load_explicit(&P.parts, memory_order_acquire);
        /* fields of a later job than g (read while it was published) claim nothing:
         * job g's items are all claimed before another job is written */
        if (p < parts) participate(g, p, fn, ctx, n, parts);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* the child has none of the parent's workers; its jobs run on its own thread until
     * it makes new ones */
    pthread_mutex_init(&P.job_lock, NULL);
    atomic_store(&P.sleepers, 0);
    P.n_workers = 0;
}

static void grow(int want) {
    static int hooked = 0;
    if (!hooked) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        hooked = 1;
    }
    while (P.n_workers < want && P.n_workers < POOL_MAX_THREADS - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)(P.n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer threads: still correct */
        P.n_workers++;
    }
}

void pool_run(int threads, int64_t n, pool_fn fn, void *ctx) {
    if (threads > n) threads = (int)n;
    if (threads <= 1 || n >= INT32_MAX || pthread_mutex_trylock(&P.job_lock) != 0) {
        for (int64_t i = 0; i < n; ++i) fn(ctx, i);
        return;
    }
    grow(threads - 1);
    int parts = threads < P.n_workers + 1 ? threads : P.n_workers + 1;
    uint32_t g = atomic_load(&P.gen) + 1;
    atomic_store_explicit(&P.fn, fn, memory_order_release);
    atomic_store_explicit(&P.ctx, ctx, memory_order_release);
    atomic_store_explicit(&P.n, n, memory_order_release);
    atomic_store_explicit(&P.parts, parts, memory_order_release);
    atomic_store(&P.done, 0);
    atomic_store(&P.caller_waits, 0);
    /* Each range's ticket moves to this job before its end is written. A worker may
     * still be in a claim of the last job (it read the range's ticket of that job, then
     * was not running while the job ended): had it read this job's end with its old
     * ticket, it could take an item past the last job's end, run the last job's
     * function on it with that job's (gone) context, and count it in this job's
     * `done`, which lets this job return while an item of it is unfinished. The end is
     * stored with release and claim reads it with acquire: a claim that sees this
     * job's end sees the ticket moved too, and its compare-and-swap of the old one
     * fails. */
    for (int p = 0; p < parts; ++p) {
        atomic_store_explicit(&P.range[p].next, (uint64_t)g << 32 | (uint64_t)(p * n / parts),
                              memory_order_release);
        atomic_store_explicit(&P.range[p].end, (p + 1) * n / parts, memory_order_release);
    }
    atomic_store(&P.gen, g); /* publishes the job */
    if (atomic_load(&P.sleepers) > 0) wake_word(&P.gen);
    participate(g, 0, fn, ctx, n, parts);
    /* the items the others hold: spin a while, then block until the last one ends */
    long since = now_ns();
    for (int spins = 1; atomic_load(&P.done) < n; ++spins) {
        RELAX();
        if (spins % 64 == 0 && now_ns() - since > POOL_SPIN_NS) {
            atomic_store(&P.caller_waits, 1);
            if (atomic_load(&P.done) < n) wait_word(&P.caller_waits, 1);
        }
    }
    pthread_mutex_unlock(&P.job_lock);
}

#endif
