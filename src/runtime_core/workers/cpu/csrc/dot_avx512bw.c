/* dot_avx512bw.c: the AVX-512 BW set (x86-64 hosts with AVX-512 F, BW and VL but not
 * VNNI, such as Skylake-SP and Skylake-X: the module offers it where
 * the processor reports them): AVX2's products (dot_avx2.c), with the products of two
 * x8 groups at once (repack.h: prefill's and batches' time) on 512-bit vectors, lanes
 * 0-7 the first group's rows and 8-15 the next's, by AVX2's vpmaddubsw and vpmaddwd on
 * twice the lanes: Q4_0, Q4_1, Q4_K, Q5_K and Q6_K's tiles sum several words' pairs in
 * 16 bits before one vpmaddwd, as AVX2's set does (x8_kernels.h: q4_isum, k_isum,
 * k6_isum); Q8_0 and Q6_K's 1-4 rows take its VNNI paths with vpmaddubsw, vpmaddwd and
 * an addition in place of vpdpbusd; more than 4 rows of Q8_0, Q4_0 and Q4_1 as one tile
 * (b32_tile). The same bits as every other set (dot.h): the integer sums are exact, the
 * float terms dot.h's in its order. */
#include "dot.h"
#include "ieee32.h"

#ifdef GPP_HAVE_AVX512

#define X8_TARGET "avx2,f16c,avx512f,avx512bw,avx512vl"
#define X8_VNNI 0
/* tiles: 8 and 32 rows from memory Q8_0 x1.29-1.34, Q4_0 x1.08-1.37, Q4_1 x1.00-1.17 */
#define X8_B32_TILE 1
#define X8_WIDTH 512
#include "x8_kernels.h"

static Isa avx512bw;

const Isa *isa_avx512bw(void) {
    if (!avx512bw.name) { /* once, at import (under the GIL) */
        avx512bw = ISA_AVX2;
        avx512bw.name = "avx512bw";
        avx512bw.exp32 = exp32_avx512;
        avx512bw.tanh32 = tanh32_avx512;
        x16_fill(avx512bw.q8_x16);
        /* Q3_K's 1 and 2 rows: AVX2's one group per 256-bit vector (a decode step's Q3_K
         * products, as dot_avx512.c measures them: 1 row 47.2 -> 34.9 ms, 2 rows 51.3 ->
         * 47.3 against the two-group kernel) */
        avx512bw.q8_x8_rows[T_Q3_K][0] = avx512bw.q8_x8_rows[T_Q3_K][1] = ISA_AVX2.q8_x8[T_Q3_K];
        avx512bw.q8_x8_rows[T_Q2_K][0] = ISA_AVX2.q8_x8[T_Q2_K]; /* as AVX-512's 1 row */
        /* Q5_0's and Q5_1's 1 row: AVX2's (ms: Q5_0 37.2/35.2 -> 30.7/30.4, Q5_1 38.1/39.1
         * -> 31.8/31.8) */
        avx512bw.q8_x8_rows[T_Q5_0][0] = ISA_AVX2.q8_x8[T_Q5_0];
        avx512bw.q8_x8_rows[T_Q5_1][0] = ISA_AVX2.q8_x8[T_Q5_1];
    }
    return &avx512bw;
}

#endif
