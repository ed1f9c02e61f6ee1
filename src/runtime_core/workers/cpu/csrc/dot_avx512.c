/* dot_avx512.c: the AVX-512 set (x86-64 hosts with AVX-512 F, BW, VL and VNNI; the
 * module offers it where the processor reports them): AVX2's products (dot_avx2.c),
 * with the x8 groups' (repack.h: the products decode and prefill spend their time in)
 * computed by vpdpbusd, 4 byte products added into an int32 in one instruction: two
 * consecutive groups at once on 512-bit vectors (lanes 0-7 the first group's rows,
 * 8-15 the second's: half the instructions per row of 256-bit ones), a last lone group
 * on 256-bit vectors. The same bits as every other set (dot.h): the integer sums are
 * exact, the float terms dot.h's in its order. */
#include "dot.h"

#ifdef GPP_HAVE_AVX512

#define X8_TARGET "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#define X8_VNNI 1
#define X8_WIDTH 256
#include "x8_kernels.h"
#define X8_WIDTH 512
#include "x8_kernels.h"

static Isa avx512;

const Isa *isa_avx512(void) {
    if (!avx512.name) { /* once, at import (under the GIL) */
        avx512 = ISA_AVX2;
        avx512.name = "avx512";
        avx512.q8_x8[T_Q8_0] = x8_q8_0;
        avx512.q8_x8[T_Q4_0] = x8_q4_0;
        avx512.q8_x8[T_Q4_1] = x8_q4_1;
        /* A decode step's products, one group per pass on 256-bit vectors where that
         * measured faster than two groups per 512-bit vector (from memory, 14336 x 4096,
         * one thread, `benchmarks/cpu_repack.py --rows R`, best of 9, the sets side by
         * side; ms, this set's two-group kernel -> the one taken):
         * Q6_K, rows 1-4: 11-13 % faster (under load, the two builds in turn);
         * Q4_0, 1 row 1.111 -> 0.947, 2 rows 1.365 -> 1.183 (3 rows 1.572 against 1.632:
         * left); Q4_1, 1 row 1.222 -> 1.031;
         * Q4_K, 1 row 1.204 -> 1.055 with AVX2's kernel (16-bit sums, vpmaddwd by the
         * scales; VNNI's one group 1.186), 2 rows 1.398 -> 1.260 with VNNI's one group
         * (AVX2's 1.577; 3 rows 1.595 against 1.626: left). Q8_0: all within 4 %. */
        for (int r = 0; r < X8_XT; ++r) avx512.q8_x8_rows[T_Q6_K][r] = x8_q6_k;
        avx512.q8_x8_rows[T_Q4_0][0] = avx512.q8_x8_rows[T_Q4_0][1] = x8_q4_0;
        avx512.q8_x8_rows[T_Q4_1][0] = x8_q4_1;
        avx512.q8_x8_rows[T_Q4_K][0] = ISA_AVX2.q8_x8[T_Q4_K];
        avx512.q8_x8_rows[T_Q4_K][1] = x8_q4_k;
        avx512.q8_x8[T_Q4_K] = x8_q4_k;
        avx512.q8_x8[T_Q5_K] = x8_q5_k;
        avx512.q8_x8[T_Q6_K] = x8_q6_k;
        avx512.q8_x16[T_Q8_0] = x16_q8_0;
        avx512.q8_x16[T_Q4_0] = x16_q4_0;
        avx512.q8_x16[T_Q4_1] = x16_q4_1;
        avx512.q8_x16[T_Q4_K] = x16_q4_k;
        avx512.q8_x16[T_Q5_K] = x16_q5_k;
        avx512.q8_x16[T_Q6_K] = x16_q6_k;
    }
    return &avx512;
}

#endif
