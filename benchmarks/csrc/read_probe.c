/* read_probe.c: this machine's read bandwidth, for benchmarks/cpu_decode.py (compiled
 * there with the host's C compiler, like x8_loop.c).
 *
 *   read_probe THREADS MIB REPEAT  ->  prints the best bytes per second, one line
 *
 * THREADS threads each read their own contiguous part of a MIB MiB buffer (each part
 * written first by its own thread, so that its pages lie on that thread's memory node),
 * 256 bytes a turn in vector loads (AVX2's 32 bytes where the compiler targets it,
 * SSE2's 16 otherwise: cpu_decode.py compiles with -march=native) ORed in pairs into 4
 * independent running XORs, so that the loads, not the arithmetic, set the rate; the
 * time of the slowest thread, best of REPEAT passes. A decode step streams its weights
 * the same way (each thread its own rows), so this is the rate a decode could reach.
 * Measured on a 2-core AMD EPYC (Zen 5) VM, 1 thread: 38-39 GB/s, where NumPy's
 * maximum over the buffer (the probe before) read 33-37, plain C with 8 scalar XORs
 * 31.5, and software prefetching 1-8 KiB ahead added nothing. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef __AVX2__
#include <immintrin.h>
typedef __m256i Vec;
#define V_OR _mm256_or_si256
#define V_XOR _mm256_xor_si256
#define V_ZERO _mm256_setzero_si256
#else
#include <emmintrin.h>
typedef __m128i Vec;
#define V_OR _mm_or_si128
#define V_XOR _mm_xor_si128
#define V_ZERO _mm_setzero_si128
#endif
#define PER_TURN 256 /* bytes */

typedef struct {
    unsigned char *p;
    size_t n; /* bytes, a multiple of PER_TURN */
    pthread_barrier_t *go;
    int repeat;
    double *seconds; /* per pass, this thread's */
    uint64_t sink;
} Part;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *reader(void *arg) {
    Part *part = arg;
    memset(part->p, 1, part->n);
    Vec a0 = V_ZERO(), a1 = V_ZERO(), a2 = V_ZERO(), a3 = V_ZERO();
    const int w = PER_TURN / (8 * (int)sizeof(Vec)); /* 8 loads a k */
    for (int r = 0; r < part->repeat; ++r) {
        pthread_barrier_wait(part->go);
        double t0 = now();
        for (size_t i = 0; i < part->n; i += PER_TURN) {
            const Vec *v = (const Vec *)(part->p + i);
            for (int k = 0; k < w; ++k) {
                a0 = V_XOR(a0, V_OR(v[8 * k], v[8 * k + 1]));
                a1 = V_XOR(a1, V_OR(v[8 * k + 2], v[8 * k + 3]));
                a2 = V_XOR(a2, V_OR(v[8 * k + 4], v[8 * k + 5]));
                a3 = V_XOR(a3, V_OR(v[8 * k + 6], v[8 * k + 7]));
            }
        }
        part->seconds[r] = now() - t0;
    }
    Vec all = V_XOR(V_XOR(a0, a1), V_XOR(a2, a3));
    uint64_t lanes[sizeof(Vec) / 8];
    memcpy(lanes, &all, sizeof lanes);
    part->sink = lanes[0];
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: read_probe THREADS MIB REPEAT\n");
        return 2;
    }
    int threads = atoi(argv[1]), repeat = atoi(argv[3]);
    long mib = atol(argv[2]);
    if (threads < 1 || threads > 1024 || mib < 1 || repeat < 1 || repeat > 1000) {
        fprintf(stderr, "read_probe: bad THREADS %s, MIB %s or REPEAT %s\n", argv[1], argv[2], argv[3]);
        return 2;
    }
    size_t bytes = (size_t)mib << 20, per = bytes / (size_t)threads / PER_TURN * PER_TURN;
    unsigned char *buf = aligned_alloc(64, bytes);
    Part *parts = calloc((size_t)threads, sizeof(Part));
    double *seconds = calloc((size_t)threads * (size_t)repeat, sizeof(double));
    pthread_t *ids = calloc((size_t)threads, sizeof(pthread_t));
    pthread_barrier_t go;
    if (!buf || !parts || !seconds || !ids || pthread_barrier_init(&go, NULL, (unsigned)threads)) {
        fprintf(stderr, "read_probe: out of memory for %ld MiB\n", mib);
        return 1;
    }
    for (int t = 0; t < threads; ++t) {
        parts[t] = (Part){buf + per * (size_t)t, per, &go, repeat, seconds + (size_t)t * repeat, 0};
        if (pthread_create(&ids[t], NULL, reader, &parts[t])) {
            fprintf(stderr, "read_probe: no thread %d\n", t);
            return 1;
        }
    }
    uint64_t sink = 0;
    for (int t = 0; t < threads; ++t) {
        pthread_join(ids[t], NULL);
        sink ^= parts[t].sink;
    }
    double best = 0.0;
    for (int r = 0; r < repeat; ++r) {
        double slowest = 0.0;
        for (int t = 0; t < threads; ++t)
            if (seconds[(size_t)t * repeat + r] > slowest) slowest = seconds[(size_t)t * repeat + r];
        double rate = (double)(per * (size_t)threads) / slowest;
        if (rate > best) best = rate;
    }
    printf("%.0f %llu\n", best, (unsigned long long)(sink & 1));
    return 0;
}
