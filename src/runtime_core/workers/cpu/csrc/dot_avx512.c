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
        /* Q6_K's decode one group per pass: measured 11-13 % faster than two per 512-bit
         * vector (from memory, one row, 14336 x 4096, under load, the two builds in turn
         * in fresh processes; the other types' two-group decode as fast or faster) */
        avx512.q8_x8_few[T_Q6_K] = x8_q6_k;
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
