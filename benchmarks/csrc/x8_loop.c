/* x8_loop.c: the CPU worker's product of repacked groups (csrc/repack.h) for one
 * instruction set, type and activation row count, timed alone over a matrix: the kernel
 * ops.c's linear_x8 picks (q8_x8_rows for a decode step's few rows where the set has
 * one, else q8_x16 over two groups at once, else q8_x8), on one thread, with no Python,
 * thread pool or quantization of the activations around it. Built with the kernels'
 * files and run by benchmarks/cpu_x8_loop.py.
 *
 * argv: set (avx2, avxvnni, avx512bw, avx512, avx512-zen4, avx512-intel), type (Q4_0, Q4_K, ...), the
 * matrix's rows and columns, activation rows, timed passes. Prints the best pass's milliseconds, the
 * repacked bytes a pass reads and the kernel's kind. Weights and activations are random bytes (finite factors): no branch
 * of a kernel looks at a value, so the work is that of any matrix. The caller checks
 * that the processor runs the set. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "dot.h"
#include "repack.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* bytes of random values; from 2 MiB on, in 2 MiB pages where the kernel gives them, as
 * the module's repacked weights are (module.c: alloc_groups) */
static void *filled(size_t bytes) {
    const size_t huge = (size_t)2 << 20;
    void *p = NULL;
    if (posix_memalign(&p, bytes >= huge ? huge : 64, (bytes + 63) / 64 * 64) != 0) exit(2);
#ifdef MADV_HUGEPAGE
    if (bytes >= huge) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    uint8_t *b = p;
    for (size_t i = 0; i < bytes; ++i) b[i] = (uint8_t)(rand() >> 7);
    return p;
}

/* weak: a baseline checkout (cpu_x8_loop.py --baseline) from before these sets lacks them */
__attribute__((weak)) const Isa *isa_avx512_zen4(void);
__attribute__((weak)) const Isa *isa_avx512_intel(void);

static const Isa *isa_of(const char *name) {
    if (strcmp(name, "avx2") == 0) return &ISA_AVX2;
#ifdef GPP_HAVE_AVXVNNI
    if (strcmp(name, "avxvnni") == 0) return isa_avxvnni();
#endif
    if (strcmp(name, "avx512bw") == 0) return isa_avx512bw();
    if (strcmp(name, "avx512") == 0) return isa_avx512();
    if (strcmp(name, "avx512-zen4") == 0 && isa_avx512_zen4) return isa_avx512_zen4();
    if (strcmp(name, "avx512-intel") == 0 && isa_avx512_intel) return isa_avx512_intel();
    return NULL;
}

static float out8[X8_TILE][8], out16[X8_TILE][16];

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s SET TYPE ROWS COLUMNS ACTIVATION_ROWS PASSES\n", argv[0]);
        return 2;
    }
    const Isa *isa = isa_of(argv[1]);
    int t = 0;
    while (t < T_COUNT && strcmp(argv[2], QTYPE_NAMES[t]) != 0) ++t;
    const int64_t n_out = atoll(argv[3]), n_in = atoll(argv[4]);
    const int rows = atoi(argv[5]), passes = atoi(argv[6]);
    if (!isa || t == T_COUNT || x8_block_bytes(t) == 0) {
        fprintf(stderr, "no x8 product of set %s, type %s here\n", argv[1], argv[2]);
        return 2;
    }
    const int chunks = QTYPE_BLOCK_ELEMS[t] / 32;
    if (n_out % 16 || n_in % (32 * chunks) || rows < 1 || passes < 1) {
        fprintf(stderr, "rows a multiple of 16, columns of %d, positive counts\n", 32 * chunks);
        return 2;
    }
    const x8_fn few = rows <= X8_XT ? isa->q8_x8_rows[t][rows - 1] : NULL;
    const x8_fn fast = few ? few : isa->q8_x8[t];
    const x16_fn fast16 = few ? NULL : isa->q8_x16[t];
    if (!fast) {
        fprintf(stderr, "set %s has no x8 product of %s\n", argv[1], argv[2]);
        return 3;
    }
    const int64_t nc = n_in / 32, gs = x8_group_bytes(t, n_in), groups = n_out / 8;
    const uint8_t *w = filled((size_t)(groups * gs));
    float *d = filled(sizeof(float) * (size_t)(rows * nc)), *s = filled(sizeof(float) * (size_t)(rows * nc));
    for (int64_t i = 0; i < rows * nc; ++i) d[i] = s[i] = 0.01f;
    int32_t *g = filled(sizeof(int32_t) * (size_t)(rows * 2 * nc));
    for (int64_t i = 0; i < rows * 2 * nc; ++i) g[i] = g[i] % 2048; /* as a sum of 16 int8 */
    XRows x = {filled((size_t)(rows * n_in)), d, s, g, NULL, n_in};
    double best = 1e30;
    volatile float sink = 0;
    for (int r = 0; r < passes; ++r) {
        const double t0 = now_s();
        for (int64_t gi = 0; gi < groups; gi += fast16 ? 2 : 1)
            for (int j0 = 0; j0 < rows; j0 += X8_TILE) {
                const int nj = rows - j0 < X8_TILE ? rows - j0 : X8_TILE;
                if (fast16) fast16(w + gi * gs, gs, nc, &x, j0, nj, out16);
                else fast(w + gi * gs, gs, nc, &x, j0, nj, out8);
            }
        const double dt = now_s() - t0;
        sink += out8[0][0] + out16[0][0];
        if (dt < best) best = dt;
    }
    printf("%.6f %lld %s\n", best * 1e3, (long long)(groups * gs), few ? "rows" : fast16 ? "x16" : "x8");
    return 0;
}
