/* x8_loop.c: one x8 kernel of x8_kernels.h (an entry the CPU worker's module calls, as
 * its dot_*.c includes it), timed alone over a matrix: no Python, no thread pool, no
 * quantization of the activations. Built and run by benchmarks/cpu_x8_loop.py, which
 * defines X8_TARGET, X8_VNNI, X8_DOT256 (AVX-VNNI) as the instruction set's file does,
 * and
 *   LOOP_FN     the entry (x8_q4_0, x8_q4_1, x8_q8_0, x8_q4_k, x8_q5_k, x8_q6_k)
 *   LOOP_BYTES  its group block's bytes (repack.h), LOOP_CHUNKS the 32-element chunks
 *               a block holds (1, or 8 for the K-quants)
 *
 * argv: the matrix's rows and columns, activation rows (1 .. X8_TILE), timed passes.
 * Prints the best pass's milliseconds. Weights and activations are random bytes: no
 * branch of a kernel looks at a value, so the work is that of any matrix. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "dot.h"

#define X8_WIDTH 256
#include "x8_kernels.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *filled(size_t bytes) {
    uint8_t *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) exit(2);
    for (size_t i = 0; i < bytes; ++i) p[i] = (uint8_t)(rand() >> 7);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s ROWS COLUMNS ACTIVATION_ROWS PASSES\n", argv[0]);
        return 2;
    }
    const int64_t n_out = atoll(argv[1]), n_in = atoll(argv[2]);
    const int nj = atoi(argv[3]), passes = atoi(argv[4]);
    if (n_out % 8 || n_in % (32 * LOOP_CHUNKS) || nj < 1 || nj > X8_TILE || passes < 1) {
        fprintf(stderr, "rows a multiple of 8, columns of %d, 1 .. %d activation rows\n",
                32 * LOOP_CHUNKS, X8_TILE);
        return 2;
    }
    const int64_t nc = n_in / 32, gs = nc / LOOP_CHUNKS * LOOP_BYTES, groups = n_out / 8;
    const uint8_t *w = filled((size_t)(groups * gs));
    float *d = filled(sizeof(float) * (size_t)(nj * nc)), *s = filled(sizeof(float) * (size_t)(nj * nc));
    for (int64_t i = 0; i < nj * nc; ++i) d[i] = s[i] = 0.01f; /* finite factors */
    int32_t *g = filled(sizeof(int32_t) * (size_t)(nj * 2 * nc));
    for (int64_t i = 0; i < nj * 2 * nc; ++i) g[i] = g[i] % 2048; /* |sum of 16 int8| */
    XRows x = {filled((size_t)(nj * n_in)), d, s, g, NULL, n_in};
    static float out[X8_TILE][8];
    double best = 1e30;
    volatile float sink = 0;
    for (int r = 0; r < passes; ++r) {
        const double t0 = now_s();
        for (int64_t g = 0; g < groups; ++g) LOOP_FN(w + g * gs, gs, nc, &x, 0, nj, out);
        const double t = now_s() - t0;
        sink += out[0][0];
        if (t < best) best = t;
    }
    printf("%.6f\n", best * 1e3);
    return 0;
}
