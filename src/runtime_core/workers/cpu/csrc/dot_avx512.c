/* dot_avx512.c: the AVX-512 set (x86-64 hosts with AVX-512 F, BW, VL and VNNI; the
 * module offers it where the processor reports them): AVX2's products (dot_avx2.c),
 * with the x8 groups' (repack.h: the products decode and prefill spend their time in)
 * computed by vpdpbusd, 4 byte products added into an int32 in one instruction: two
 * consecutive groups at once on 512-bit vectors (lanes 0-7 the first group's rows,
 * 8-15 the second's: half the instructions per row of 256-bit ones), a last lone group
 * on 256-bit vectors; a decode step's few rows mostly by x8_pair_kernels.h (one group,
 * two of its words per 512-bit vector). The same bits as every other set (dot.h): the
 * integer sums are exact, the float terms dot.h's in its order. */
#include "dot.h"
#include "ieee32.h"

#include <string.h>

#ifdef GPP_HAVE_AVX512

#define X8_TARGET "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#define X8_VNNI 1
#define X8_TILED /* x8_fill_tiled and x16_fill_tiled: avx512-intel's */
#define X8_WIDTH 256
#include "x8_kernels.h"
#define X8_WIDTH 512
#include "x8_kernels.h"
#include "x8_pair_kernels.h"

static Isa avx512;

const Isa *isa_avx512(void) {
    if (!avx512.name) { /* once, at import (under the GIL) */
        avx512 = ISA_AVX2;
        avx512.name = "avx512";
        avx512.exp32 = exp32_avx512;
        avx512.tanh32 = tanh32_avx512;
        x8_fill(avx512.q8_x8);
        x16_fill(avx512.q8_x16);
        /* A decode step's products of one group on 512-bit vectors holding two of its
         * words (x8_pair_kernels.h: one stream of memory, one vpermd per activation
         * vector), where that measured faster than two groups per 512-bit vector and
         * than one group per 256-bit vector (from memory, 14336 x 4096, one thread,
         * `benchmarks/cpu_repack.py --rows R --isas avx2,avxvnni,avx512 --repeat 15`,
         * the sets side by side; ms, avx2 / avxvnni's 256-bit group / this pair kernel):
         * 1 row Q4_0 1.303 / 1.024 / 0.904, Q4_1 1.400 / 1.146 / 1.079, Q4_K 1.060 /
         * 1.062 / 0.933, Q6_K 1.816 / 1.812 / 1.420; 2 rows Q4_0 1.425 / 1.270 / 1.132,
         * Q4_K 1.635 / 1.283 / 1.019, Q6_K 2.491 / 2.457 / 1.788. In cache (1024 x
         * 4096, 1 row, a script not kept, best of 120-180 calls) Q6_K 0.125 -> 0.065
         * ms, Q4_K 0.074 -> 0.042, Q4_0 0.062 -> 0.052. Left to the two-group kernel
         * (measured as fast or faster, the builds in turn): Q4_0 from 3 rows, Q4_1 from
         * 3 (2 rows on Zen 4: 14336 x 4096 from memory 1.89-2.13 -> 1.49-1.55 ms with
         * the pair kernel, in cache 0.103-0.114 against 0.108; the Zen 5 sessions gave
         * 2 rows to the two-group kernel), Q4_K from 3, Q6_K from 3 (the Zen 5 sessions
         * gave Q6_K the pair kernel up to 4 rows; on Zen 4, over a decode step's
         * distinct Q6_K matrices, the 8B shape's 4 blocks, 1 thread, the builds in turn:
         * 3 rows 57.4-58.2 -> 40.8-41.9 ms, 4 rows 61.1-61.6 -> 47.8-47.9, where 2 rows
         * stay with the pair kernel: 40.1-40.8 against 42.7-43.7). Q8_0, 1 row: one group per 256-bit vector, 10 %
         * faster for short rows (SmolLM2's head, 49152 x 576: 0.736 against 0.831 ms;
         * 14336 x 4096 within 2 %); from 2 rows within 4 %. Q4_K, 1 row: AVX2's kernel
         * (vpmaddubsw, as AVX-VNNI's set takes it): over a decode step's distinct
         * matrices (the 8B shape's Q4_K_S, 4 blocks, 1 thread, three interleaved
         * rounds and more) on AMD Zen 4 it read 27.5-30.5 GB/s where the pair kernel
         * read 22.4-23.9 (2 rows: 20.9-22.2 against the pair kernel's 24.7-25.2); on Zen
         * 5 the AVX2 set's whole Q4_K_S step was 2-4 % slower than this set's (16.4-16.7
         * against 16.0-16.4 ms, the pair kernel then). Q5_K, 1 row: one group
         * per 256-bit vector (one stream of memory, not two): on Zen 4, the same way,
         * 26.0-29.7 GB/s against 20.4-21.7 (a Q5_K_S model; 2 rows: no clear
         * difference, left to the two-group kernel); not measured on Zen 5. IQ4_NL, 1
         * and 2 rows: the pair kernel (Q4_0's with a vpshufb of its nibbles): on Zen 4,
         * 14336 x 4096 from memory 1.60 -> 1.09 ms (1 row), 1.83 -> 1.61 (2 rows; in
         * cache 0.096 -> 0.117), a step of the 8B shape's IQ4_NL products 30.8 -> 20.5
         * ms (17 -> 29-30 GB/s); not measured on Zen 5. */
        avx512.q8_x8_rows[T_Q6_K][0] = avx512.q8_x8_rows[T_Q6_K][1] = xp_q6_k;
        avx512.q8_x8_rows[T_Q4_0][0] = avx512.q8_x8_rows[T_Q4_0][1] = xp_q4_0;
        avx512.q8_x8_rows[T_Q4_1][0] = avx512.q8_x8_rows[T_Q4_1][1] = xp_q4_1;
        avx512.q8_x8_rows[T_Q4_K][0] = ISA_AVX2.q8_x8[T_Q4_K];
        avx512.q8_x8_rows[T_Q4_K][1] = xp_q4_k;
        avx512.q8_x8_rows[T_Q8_0][0] = x8_q8_0;
        avx512.q8_x8_rows[T_Q5_K][0] = x8_q5_k;
        /* Q3_K, 1 and 2 rows: one group per 256-bit vector. Over a decode step's distinct
         * Q3_K matrices (the 8B shape's Q3_K_S, 4 blocks, 1 thread, AMD Zen 4,
         * `benchmarks/cpu_step_products.py --rows R`, the builds in turn), ms: 1 row 45.2
         * (the two-group kernel) -> 28.7 (34.6 with AVX2's); 2 rows, since its words'
         * shifts are immediates and its blocks prefetched into the second level (repack.h),
         * 45.3-45.8 with AVX2's kernel or 46.6-49.8 with the two-group one -> 30.9-31.1
         * (before: 51.6 two-group, 44.8 AVX2's, 46.7 this one); 3 and 4 rows left to the
         * two-group kernel (34.7-34.9 and 40.0-48.3 against this one's 44.1-44.4 and
         * 51.7-52.6). Not measured on Zen 5. */
        avx512.q8_x8_rows[T_Q3_K][0] = avx512.q8_x8_rows[T_Q3_K][1] = x8_q3_k;
        /* Q2_K, 1 and 2 rows: one group per 256-bit vector (the 8B shape's Q2_K mix, a
         * step's products, the same way, 1 row: a 14336 x 4096 Q2_K matrix 7.4-7.8 -> 4.6
         * ms, the step's best pass 31.0-32.0 -> 23.3-23.5 ms; 2 rows, as Q3_K's since
         * their changes, 31.3-32.1 with the two-group kernel -> 29.9-30.2); 3 and 4 rows
         * left to the two-group kernel (31.9-32.0 and 37.3-40.3 ms against 43.3-44.5 and
         * 48.9-52.3). Not measured on Zen 5. */
        avx512.q8_x8_rows[T_Q2_K][0] = avx512.q8_x8_rows[T_Q2_K][1] = x8_q2_k;
        /* Q5_0, Q5_1, 1 row: one group per 256-bit vector (a decode step's products, the
         * same way, ms: Q5_0 44.8/33.8 with the two-group kernel -> 35.7/30.0, Q5_1
         * 45.1/43.2 -> 42.9/30.9, the host's phases; AVX2's kernel 36.0/29.9 and
         * 40.2/31.3); 2 rows left to the two-group kernel (within the noise). */
        avx512.q8_x8_rows[T_Q5_0][0] = x8_q5_0;
        avx512.q8_x8_rows[T_Q5_1][0] = x8_q5_1;
        avx512.q8_x8_rows[T_IQ4_NL][0] = avx512.q8_x8_rows[T_IQ4_NL][1] = xp_iq4_nl;
    }
    return &avx512;
}

static Isa avx512_zen4;

/* AVX-512's set with a decode step's kernels chosen on AMD Zen 4, which runs a 512-bit
 * instruction as two 256-bit halves: one group per 256-bit vector (x8_kernels.h, its
 * activations broadcast from memory) for 2 rows of Q4_0 (1 row: AVX2's kernel, below),
 * 1 and 2 rows of Q4_1, IQ4_NL and Q6_K
 * (AVX-512's pair kernel: a vpermd per activation vector and a fold of two halves),
 * 2 rows of Q4_K (the pair kernel), 1 row of IQ4_XS, 2 of Q5_K and 2 and 3 of Q8_0 (the
 * two-group kernel). Since every
 * x8 block is prefetched into the second-level cache (repack.h), on Zen 4 (EPYC family
 * 25, model 17, 1 thread): whole decode steps of the 8B shape's 4 blocks with both
 * sets in one process, in turn (`benchmarks/cpu_isa_steps.py MODEL --isas
 * avx512,avx512-zen4 --batch R`: the median round's time over AVX-512's), 1 row Q4_0
 * 0.95, Q6_K 0.98, IQ4_NL 1.03 and 0.99, IQ4_XS 0.88 and 0.93, SmolLM2's Q4_1 0.87 and
 * 0.89; 2 rows Q4_0 0.95, Q6_K 0.84, IQ4_NL 0.97, Q5_K 0.87 (both rounds), Q8_0 0.96
 * and 0.98; 3 rows Q8_0 0.83 (both rounds); the same kernels in both sets measured 0.99-1.05 (the noise). A
 * step's products alone (`cpu_step_products.py --rows R`, the builds in turn, median
 * pass, ms): 1 row Q4_0 ffn_gate 4.32-4.62 against 4.73-5.06, IQ4_NL 4.40-4.65 against
 * 4.77-5.10; 2 rows the Q6_K head 4.25-4.46 against 5.16-5.61; a 57344 x 4096 Q4_1
 * matrix 1 row 3.90-4.10 against 4.21-4.35 ms, 2 rows 5.43-5.60 against 5.78-6.10.
 * Q4_K's 2 rows since the vpdpbusd take their broadcasts from memory (x8_vectors.h:
 * dot4_at): the 8B shape's Q4_K_S, `cpu_isa_steps.py` as above, 0.92 in two runs where
 * the set without it read 0.95 in two. Left as AVX-512's: IQ4_XS's 2 rows (1.03-1.06),
 * Q5_0's 2 rows (1.06), Q4_K's 1 row (AVX2's kernel: one group per 256-bit vector
 * 1.09-1.10 there, though 12 % faster in cache), every type's 4 rows and all but Q8_0's 3 (one
 * group per 256-bit vector 20-50 % slower from memory). The Zen 5 sessions measured the
 * pair kernel faster on Zen 5 (above), so the module offers this set on AMD's family 19h
 * only, as its best. */
/* the row counts (from, to) of a type that take one group per 256-bit vector there */
static const struct {
    int type, from, to;
} ZEN4_ROWS[] = {
    {T_Q4_0, 2, 2}, {T_Q4_1, 1, 2}, {T_IQ4_NL, 1, 2}, {T_Q6_K, 1, 2}, /* the pair kernel's */
    {T_Q4_K, 2, 2},                                                   /* the pair kernel's */
    {T_IQ4_XS, 1, 1}, {T_Q5_K, 2, 2}, {T_Q8_0, 2, 3},                 /* the two-group one's */
};

const Isa *isa_avx512_zen4(void) {
    if (!avx512_zen4.name) { /* once, at import (under the GIL) */
        avx512_zen4 = *isa_avx512();
        avx512_zen4.name = "avx512-zen4";
        for (int i = 0; i < (int)(sizeof ZEN4_ROWS / sizeof ZEN4_ROWS[0]); ++i) {
            const int t = ZEN4_ROWS[i].type;
            for (int n = ZEN4_ROWS[i].from; n <= ZEN4_ROWS[i].to; ++n)
                avx512_zen4.q8_x8_rows[t][n - 1] = avx512_zen4.q8_x8[t];
        }
        /* Q4_0, 1 row: AVX2's kernel (vpmaddubsw, the 8 words' pairs summed in 16 bits
         * before one vpmaddwd), as Q4_K's 1 row above. Over a decode step's distinct
         * matrices (the 8B shape's Q4_0, 4 blocks, both builds in one process, their
         * passes in turn: `benchmarks/cpu_builds_ab.py OLD NEW --model MODEL --rows 1
         * --rounds 21`), the products' median pass over the one group per 256-bit
         * vector kernel's: 1 thread 0.929-0.972 (nine runs), 2 threads 0.957, 0.995,
         * 1.006 (the same bits). Left as they were: Q4_1 (SmolLM2's step 1.026, 0.981),
         * Q5_0 (its 8B shape's step 1.118 with AVX2's kernel), Q5_1 (0.970, one round),
         * Q8_0 (1.030). */
        avx512_zen4.q8_x8_rows[T_Q4_0][0] = ISA_AVX2.q8_x8[T_Q4_0];
    }
    return &avx512_zen4;
}

static Isa avx512_intel;

/* AVX-512's set with every product on AVX-512's own kernels (x8_kernels.h's two groups
 * per 512-bit vector, the last lone group on a 256-bit one): none of AVX-512's decode-row
 * choices above (the pair kernel, one group per 256-bit vector, AVX2's), which were
 * measured on AMD's Zen 4 and Zen 5. On an Intel Xeon (family 6, model 207: Emerald
 * Rapids, 2 cores of a virtual machine, 1 thread)
 * the two-group kernel was as fast or faster for every type and row count that AVX-512's
 * set gives another: 14336 x 4096 (33-48 MB, called over and over: within this host's
 * 260 MiB last-level cache, not from memory), both builds in one process in turn
 * (`benchmarks/cpu_builds_ab.py OLD NEW --types T --rows 1,2 --n-out 14336 --rounds 41`,
 * two runs), the time over AVX-512's choice, 1 row / 2 rows: Q4_0 0.97, 0.98 / 0.84,
 * 0.89; Q4_1 0.88, 0.92 / 0.85, 0.86; Q4_K 0.89, 0.96 / 0.93, 0.93; Q6_K 1.04, 0.95 /
 * 0.87, 0.86; Q8_0 0.89, 0.85 / 1.00, 0.96; Q5_K 1.00, 0.98 / 0.97, 1.02; Q3_K 0.90,
 * 0.87 / 0.77, 0.81; Q2_K 0.77, 0.84 / 0.68, 0.68; Q5_0 0.88, 1.00; Q5_1 0.94, 0.87;
 * IQ4_NL 0.92, 0.93 / 0.79, 0.77 (the same kernel in both builds: 0.94-1.06, the
 * noise). Over a decode step's products (`--model MODEL --rows R --rounds 15`), 1 thread:
 * the 8B shape's 4 blocks Q4_0 0.93 / 0.93, Q4_K_S 0.91 / 0.96, Q6_K 0.95 / 0.91,
 * Q8_0 0.91 / 0.98, SmolLM2's Q4_1 0.93 / 0.90; 2 threads, 1 row: Q4_0 1.04, 0.94,
 * 0.92, Q4_K_S 0.89, Q6_K 0.95, 0.98. Whole decode steps (`benchmarks/cpu_isa_steps.py
 * MODEL --isas avx512,avx512-intel`, the sets in turn), 1 thread, 1 row: Q4_0 1.02, 1.01,
 * Q4_K_S 0.95, Q6_K 1.01, 1.00, Q8_0 0.96 (SmolLM2's 1.12, 0.77, 0.84: its step is short
 * and the host's noise larger); 2 rows Q4_0 0.96, 0.97, Q4_K_S 0.95, 0.99, Q6_K 0.98,
 * 0.99, Q8_0 0.98, 0.98 (SmolLM2 0.87, 1.01); 2 threads,
 * Q4_K_S 0.91 (1 row), 0.93 (2). The module offers it on Intel's processors only, as
 * their best: no other Intel processor has been measured. */
const Isa *isa_avx512_intel(void) {
    if (!avx512_intel.name) { /* once, at import (under the GIL) */
        avx512_intel = *isa_avx512();
        avx512_intel.name = "avx512-intel";
        memset(avx512_intel.q8_x8_rows, 0, sizeof avx512_intel.q8_x8_rows);
        /* Every product of 5 rows and more (batched decode steps, prefill) as one tile,
         * each block decoded once for all its rows (x8_kernels.h: X8_TILED), where
         * AVX-512's set takes Q8_0's, IQ4_NL's, Q4_0's, Q4_1's, Q5_0's and Q5_1's (and
         * Q4_K's up to 16 rows) 4 rows at a time, as AMD's Zen 4 measured no slower. On
         * that Xeon, a decode step's products (`cpu_builds_ab.py --model MODEL --rows R`,
         * as above, 1 thread), 5 / 8 / 16 / 32 rows: Q4_0 0.90 / 0.85 / 0.77 / 0.80 of the
         * time; Q8_0 0.97 / 0.92 / 0.68 / 0.63; IQ4_NL 0.89 / 0.76 / 0.72 / 0.74; Q5_0 0.75
         * / 0.78 / 0.70 / 0.70; SmolLM2's Q4_1 0.91 / 0.90 / 0.76 / 0.79; Q4_K_S (its
         * tile from 5 rows rather than 17) 0.95, 0.99 / 0.91, 0.95 / 0.87, 0.84 (12 rows
         * 0.84; 2 threads 0.94 / 0.90 / 0.87 at 5 / 8 / 16). Q6_K's 5 to 8 rows as a tile
         * (X8_Q6_K_CHUNKED 4): 1.03 / 0.99 / 0.95 (5 / 6 / 8 rows), left. */
        x8_fill_tiled(avx512_intel.q8_x8);
        x16_fill_tiled(avx512_intel.q8_x16);
    }
    return &avx512_intel;
}

#endif
