/* dot_avxvnni.c: the AVX-VNNI set (x86-64 hosts with AVX2, F16C and AVX-VNNI, the VEX
 * encoding of vpdpbusd on 256-bit vectors, without AVX-512: the module offers it where
 * the processor reports AVX-VNNI, between AVX2 and AVX-512): AVX2's products
 * (dot_avx2.c), with the x8 groups' (repack.h: the products decode and prefill spend
 * their time in) computed by vpdpbusd, 4 byte products added into an int32 in one
 * instruction where AVX2 takes vpmaddubsw, vpmaddwd and an addition. One group of 8 rows
 * per pass (256-bit vectors: 16 registers). The same bits as every other set (dot.h):
 * the integer sums are exact, the float terms dot.h's in its order. */
#include "dot.h"

#ifdef GPP_HAVE_AVXVNNI

#ifdef GPP_AVXVNNI_AS_EVEX
/* A build for the tests only (`make avxvnni-as-evex`): this set's code with AVX-512 VL's
 * EVEX vpdpbusd in place of AVX-VNNI's VEX one (the same operation: 4 unsigned-by-signed
 * byte products added into each int32 lane, without saturation), offered on a host with
 * AVX-512 VNNI (module.c), so that a machine without AVX-VNNI runs every line of it but
 * the instruction's encoding. */
#define X8_TARGET "avx2,f16c,avx512vl,avx512vnni"
#define X8_DOT256 _mm256_dpbusd_epi32
#else
#define X8_TARGET "avx2,f16c,avxvnni"
#define X8_DOT256 _mm256_dpbusd_avx_epi32
#endif
#define X8_VNNI 1
/* Every product of 5 rows and more (batched decode steps, prefill) as one tile, each
 * block decoded once for all its rows, where AVX-512's set takes Q8_0's, IQ4_NL's,
 * Q4_0's, Q4_1's, Q5_0's and Q5_1's (and Q4_K's up to 16 rows) 4 rows at a time, as
 * AMD's Zen 4 measured no slower (x8_kernels.h). On an Intel Xeon's cores (below),
 * forcing this set, a decode step's products (`benchmarks/cpu_builds_ab.py OLD@avxvnni
 * NEW@avxvnni --model MODEL --rows R`), 1 thread, 5 / 8 / 16 / 32 rows: Q4_0 0.97 /
 * 0.91 / 0.99 / 0.88 of the time; Q8_0 0.87 / 0.88 / 0.76 / 0.86; Q5_1 0.77 / 0.77 /
 * 0.74 / 0.77; SmolLM2's Q4_1 0.91 / 0.90 / 0.81 / 0.95; Q4_K_S (its tile from 5 rows
 * rather than 17; 5 / 8 / 16 rows) 0.94, 0.95 / 0.96, 0.95 / 0.99, 0.96 (12 rows 0.89). */
#define X8_B32_TILE 1
#define X8_Q4_K_CHUNKED 0
#define X8_WIDTH 256
#include "x8_kernels.h"

static Isa avxvnni;

const Isa *isa_avxvnni(void) {
    if (!avxvnni.name) { /* once, at import (under the GIL) */
        avxvnni = ISA_AVX2;
        avxvnni.name = "avxvnni";
        avxvnni.q8_x8[T_Q8_0] = x8_q8_0;
        avxvnni.q8_x8[T_IQ4_NL] = x8_iq4_nl;
        avxvnni.q8_x8[T_IQ4_XS] = x8_iq4_xs;
        avxvnni.q8_x8[T_Q4_0] = x8_q4_0;
        avxvnni.q8_x8[T_Q4_1] = x8_q4_1;
        avxvnni.q8_x8[T_Q5_0] = x8_q5_0;
        avxvnni.q8_x8[T_Q5_1] = x8_q5_1;
        avxvnni.q8_x8[T_Q4_K] = x8_q4_k;
        avxvnni.q8_x8[T_Q5_K] = x8_q5_k;
        /* Q4_K's products of one row: AVX2's (16-bit sums, vpmaddwd by the scales),
         * measured 1.055 ms against 1.186 (dot_avx512.c says how); on an Intel Xeon
         * (below) 1.03 and 1.05 of the time with this set's kernel, a decode step's
         * products of the 8B shape's Q4_K_S. */
        avxvnni.q8_x8_rows[T_Q4_K][0] = ISA_AVX2.q8_x8[T_Q4_K];
        /* Q6_K, Q3_K and Q2_K: a decode step's 1 to 4 rows on this set's vpdpbusd, their
         * tiles (5 rows and more) AVX2's 16-bit ones (k6_isum). This set is the best only
         * where a processor has AVX-VNNI without AVX-512: Intel's (Alder Lake and later
         * client processors, Sierra Forest), none measured; measured on an Intel Xeon
         * (family 6, model 207, Emerald Rapids: the cores of Raptor Lake's performance
         * cores, AVX-VNNI beside its AVX-512), a decode step's products over the 8B
         * shape's 4 blocks, 1 thread, both builds in one process in turn
         * (`benchmarks/cpu_builds_ab.py OLD@avxvnni NEW@avxvnni --model MODEL --rows R`),
         * the time over AVX2's kernels', rows 1 / 2 / 3 / 4: Q6_K 0.97 / 0.91, 0.92 / 0.87
         * / 0.90 (2 threads: 1.01 / 0.93 / 0.86 / 0.89); Q3_K_S 0.93 / 0.75 / 0.87 / 0.84;
         * the Q2_K mix 0.91 / 0.88 / 0.97 / 0.85. This set's tiles: 5 rows Q6_K 1.21, Q3_K_S
         * 1.09, Q2_K 1.05; 8 rows 1.29, 1.04, 1.16; 32 rows 1.09, 1.13, 1.11. */
        for (int n = 0; n < X8_XT; ++n) {
            avxvnni.q8_x8_rows[T_Q6_K][n] = x8_q6_k;
            avxvnni.q8_x8_rows[T_Q3_K][n] = x8_q3_k;
            avxvnni.q8_x8_rows[T_Q2_K][n] = x8_q2_k;
        }
    }
    return &avxvnni;
}

#endif
