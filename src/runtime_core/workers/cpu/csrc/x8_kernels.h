/* x8_kernels.h: the products of x8 groups (repack.h) with 8-bit activations, for one
 * x86 instruction set and vector width: included by its file (dot_avx2.c, dot_avxvnni.c,
 * dot_avx512.c), once per width, after it defines
 *
 *   X8_TARGET   the target attribute's string ("avx2,f16c", ...)
 *   X8_VNNI     1 where vpdpbusd (4 unsigned-by-signed byte products added to an int32)
 *               exists, 0 for AVX2's vpmaddubsw + vpmaddwd
 *   X8_DOT256   (optional) the 256-bit vpdpbusd's intrinsic: AVX-VNNI's VEX
 *               _mm256_dpbusd_avx_epi32 (default: AVX-512 VL's _mm256_dpbusd_epi32)
 *   X8_B32_TILE (optional, 0 by default) 1: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL take more
 *               than X8_XT rows as a tile, each block decoded once (b32_tile: the sets
 *               without VNNI, and AVX-VNNI's)
 *   X8_Q4_K_CHUNKED, X8_Q6_K_CHUNKED (optional) up to how many rows Q4_K, Q6_K (with
 *               VNNI) take X8_XT rows at a time rather than as a tile (below)
 *   X8_TILED    (optional) also define x8_fill_tiled / x16_fill_tiled: entries that take
 *               every product of more than X8_XT rows as a tile (AVX-512's Intel set)
 *   X8_WIDTH    256: one group, lane i its row i (defines x8_q8_0 .. x8_iq4_xs, and x8_fill
 *               to put them in a table of x8_fn);
 *               512: two consecutive groups, lanes 0-7 the first's rows, 8-15 the
 *               next's (defines x16_q8_0 .. x16_q6_k, x16_fill; needs AVX-512 BW, and with
 *               X8_VNNI 0 takes AVX2's 16-bit sums for Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
 *               Q5_K and the tiles of Q2_K, Q3_K and Q6_K, and elsewhere the VNNI paths
 *               with AVX2's three instructions in place of vpdpbusd: dot_avx512bw.c)
 *
 * A word (32 bytes: 4 quants of every row of a group) is multiplied by 4 activation
 * bytes broadcast to every lane, the 4 products added exactly into each row's int32
 * (the unsigned weights times the signed activations: Q4_0's nibbles, Q5_0's 5 bits,
 * Q2_K's 2 bits, Q3_K's q + 4, Q6_K's q + 32 and Q8_0's q + 128 (its sign flipped), with
 * the offset's product taken back from the activations' sums g; AVX2's pairs stay
 * within 16 bits: 2 * 63 * 127 for Q6_K, and Q8_0 takes |q| times the activations given
 * q's sign; without VNNI, Q4_0, Q4_1, Q5_0, Q5_1 (their halves apart), Q4_K, Q5_K and
 * (in a tile) Q2_K, Q3_K and Q6_K add several words' pairs in 16 bits before one
 * vpmaddwd: q4_isum, k_isum, k6_isum).
 * Every integer sum is exact, so its order is free; the float terms and their 8 running
 * sums per row (block c into sum c mod 8) are dot.h's, in its order, so every row's bits
 * are the stored row's on every instruction set and width.
 *
 * IQ4_NL's and IQ4_XS's nibbles index IQ4_VALUES by a byte shuffle; their signed values
 * are multiplied as Q8_0's are (|q| times the activations given q's sign; with VNNI
 * q + 128 and the activations' sums), IQ4_XS's sub-blocks' sums times their scales by
 * vpmulld (|sum| <= 32 * 127 * 127, |scale| <= 32: within 31 bits); without VNNI each
 * word's pair sums times the scale by vpmaddwd (iq4xs_sub).
 *
 * The activation rows j0 .. j0 + nj - 1 (nj <= X8_TILE) share the blocks read from
 * memory: X8_XT rows at a time share one decoding of each block while it is in cache;
 * the K-quants' tiles (k_tile: Q6_K's and Q5_K's high bits cost more to decode than the
 * products of X8_XT rows) decode each super-block once into cache for all nj rows, but
 * for a few rows more than X8_XT (X8_K_CHUNKED: Q4_K up to 16, Q6_K with VNNI up to 8),
 * which take them X8_XT at a time, each decoding its words again in registers.
 *
 * The kernels are in its parts, included below for this width: x8_vectors.h (the
 * width's vector operations and helpers), x8_b32_kernels.h (Q8_0, IQ4_NL, Q4_0, Q4_1,
 * Q5_0, Q5_1),
 * x8_iq4xs_kernels.h and x8_k_kernels.h (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); the entries, one per type,
 * and the table that holds them are here.
 */
#ifndef X8_TARGET
#error "define X8_TARGET, X8_VNNI and X8_WIDTH before including x8_kernels.h"
#endif

#include <immintrin.h>

#include "repack.h"

#define X8_FN __attribute__((target(X8_TARGET)))
#define X8_INL static inline __attribute__((always_inline, target(X8_TARGET)))

/* the parts, each for this width */
#include "x8_vectors.h"
#include "x8_b32_kernels.h"
#include "x8_iq4xs_kernels.h"
#include "x8_k_kernels.h"

/* ---- the entries: one body per row count, so that its loops unroll -------------------------- */

/* nj <= X8_TILE rows: more than X8_XT as a tile (b32_tile) where TILE, else at once */
#define X8_ENTRY_T(NAME, CALL, KIND, TILE)                                                     \
    X8_FN __attribute__((unused)) static void XN(NAME)(const uint8_t *grp, int64_t gs, int64_t nc, \
                                                       const XRows *x, int64_t j0, int nj,      \
                                                       float (*out)[XL]) {                      \
        if ((TILE) && nj > X8_XT) {                                                             \
            XN(b32_tile)(grp, gs, nc, x, j0, nj, out, KIND);                                    \
            return;                                                                             \
        }                                                                                       \
        for (int k = 0; k < nj; k += X8_XT) {                                                   \
            const int64_t jk = j0 + k;                                                          \
            float(*ok)[XL] = out + k;                                                           \
            switch (nj - k) {                                                                   \
            case 1: CALL(1); break;                                                             \
            case 2: CALL(2); break;                                                             \
            case 3: CALL(3); break;                                                             \
            default: CALL(4); break;                                                            \
            }                                                                                   \
        }                                                                                       \
    }
#define X8_ENTRY(NAME, CALL, KIND) X8_ENTRY_T(NAME, CALL, KIND, X8_B32_TILE)
#ifndef X8_Q4_K_CHUNKED
#define X8_Q4_K_CHUNKED 16
#endif
#ifndef X8_Q6_K_CHUNKED
#define X8_Q6_K_CHUNKED 8
#endif
/* Up to how many rows a K-quant's product takes them X8_XT at a time through k_body (the
 * group read again for each X8_XT rows, from cache) rather than as a tile, whose words
 * decoded into memory cost more to store and load again than Q4_K's to decode (on AMD
 * Zen 4, 14336 x 4096, 1 thread, `benchmarks/cpu_repack.py --rows R`, ms, the builds
 * in turn: Q4_K 5 rows AVX-512 2.81-2.85 -> 2.39-2.40, AVX-512 BW 3.08-3.10 ->
 * 2.81-2.86, AVX2 3.65-3.67 -> 3.23-3.26; 8 rows 3.69-3.72 -> 3.27, 4.22 -> 3.92-3.97,
 * 5.05-5.08 -> 4.62-4.72; 16 rows AVX-512 6.75 -> 6.36, AVX2 9.82 -> 9.25; 24 and 32
 * rows within 2 %; Q6_K with VNNI 5 rows 4.48-4.57 -> 4.01-4.15, 6 rows 4.99-5.02 ->
 * 4.21-4.39, 8 rows 5.63 -> 5.34-5.44, 16 rows 2 % slower, 32 rows 17 % slower;
 * without VNNI Q6_K's 16-bit tile (k6_isum) was faster from 5 rows, Q5_K's and the
 * small blocks' tiles too) */
#define X8_K_CHUNKED(kind) ((kind) == X8_Q4_K ? X8_Q4_K_CHUNKED : (kind) == X8_Q6_K && X8_VNNI ? X8_Q6_K_CHUNKED : 0)

/* the K-quants: more than X8_XT rows (and CHUNKED: X8_K_CHUNKED) as a tile (k_tile) */
#define X8_K_ENTRY_CH(NAME, KIND, CHUNKED)                                               \
    X8_FN __attribute__((unused)) static void XN(NAME)(const uint8_t *grp, int64_t gs, int64_t nc, \
                                                       const XRows *x, int64_t j0, int nj,      \
                                                       float (*out)[XL]) {                      \
        if (nj > X8_XT && nj > (CHUNKED)) {                                                     \
            X8_K_TILE(KIND);                                                                    \
            return;                                                                             \
        }                                                                                       \
        for (int k = 0; k < nj; k += X8_XT) {                                                   \
            const int64_t jk = j0 + k;                                                          \
            float(*ok)[XL] = out + k;                                                           \
            switch (nj - k) {                                                                   \
            case 1:                                                                             \
                if (X8_Q4_K_ROW && (KIND) == X8_Q4_K) X8_Q4_K_ROW_CALL;                          \
                else if (X8_Q4_K_ROW && (KIND) == X8_Q6_K) X8_Q6_K_ROW_CALL;                     \
                else XN(k_body)(grp, gs, nc, x, jk, ok, 1, KIND);                                \
                break;                                                                          \
            case 2: XN(k_body)(grp, gs, nc, x, jk, ok, 2, KIND); break;                         \
            case 3: XN(k_body)(grp, gs, nc, x, jk, ok, 3, KIND); break;                         \
            default: XN(k_body)(grp, gs, nc, x, jk, ok, 4, KIND); break;                        \
            }                                                                                   \
        }                                                                                       \
    }

#if X8_AVX2 /* Q4_K's one row: its own loop (x8_k_kernels.h) */
#define X8_Q4_K_ROW_CALL XN(q4_k_row)(grp, nc, x, jk, ok)
#define X8_Q6_K_ROW_CALL XN(q6_k_row)(grp, nc, x, jk, ok)
#else
#define X8_Q4_K_ROW_CALL ((void)0)
#define X8_Q6_K_ROW_CALL ((void)0)
#endif
#define X8_CALL_Q8_0(N) XN(q8_0_body)(grp, gs, nc, x, jk, ok, N, 0)
#define X8_CALL_IQ4_NL(N) XN(q8_0_body)(grp, gs, nc, x, jk, ok, N, 1)
#if X8_AVX2 /* one row: its own loop (x8_b32_kernels.h) */
#define X8_CALL_Q4_0(N) ((N) == 1 ? XN(q4_0_row)(grp, nc, x, jk, ok) : XN(q4_body)(grp, gs, nc, x, jk, ok, N, 0))
#else
#define X8_CALL_Q4_0(N) XN(q4_body)(grp, gs, nc, x, jk, ok, N, 0)
#endif
#define X8_CALL_Q4_1(N) XN(q4_body)(grp, gs, nc, x, jk, ok, N, 1)
#define X8_CALL_Q5_0(N) XN(q4_body)(grp, gs, nc, x, jk, ok, N, 4)
#define X8_CALL_Q5_1(N) XN(q4_body)(grp, gs, nc, x, jk, ok, N, 5)

#ifndef X8_B32_TILE /* AVX-512's sets with VNNI: on AMD's Zen 4 measured no faster with
                      * it (on Intel's processors faster: X8_TILED, dot_avx512.c) */
#define X8_B32_TILE 0
#endif
X8_ENTRY(q8_0, X8_CALL_Q8_0, 2)
X8_ENTRY(iq4_nl, X8_CALL_IQ4_NL, 3)
X8_ENTRY(q4_0, X8_CALL_Q4_0, 0)
X8_ENTRY(q4_1, X8_CALL_Q4_1, 1)
X8_ENTRY(q5_0, X8_CALL_Q5_0, 4)
X8_ENTRY(q5_1, X8_CALL_Q5_1, 5)
#define X8_K_ENTRY(NAME, KIND) X8_K_ENTRY_CH(NAME, KIND, X8_K_CHUNKED(KIND))
X8_K_ENTRY(q2_k, X8_Q2_K)
X8_K_ENTRY(q3_k, X8_Q3_K)
X8_K_ENTRY(q4_k, X8_Q4_K)
X8_K_ENTRY(q5_k, X8_Q5_K)
X8_K_ENTRY(q6_k, X8_Q6_K)

/* this width's entries into an Isa's table of them (q8_x8 or q8_x16), every repacked type */
__attribute__((unused)) static void XN(fill)(XN(fn) * table) {
    table[T_Q8_0] = XN(q8_0);
    table[T_IQ4_NL] = XN(iq4_nl);
    table[T_IQ4_XS] = XN(iq4_xs);
    table[T_Q4_0] = XN(q4_0);
    table[T_Q4_1] = XN(q4_1);
    table[T_Q5_0] = XN(q5_0);
    table[T_Q5_1] = XN(q5_1);
    table[T_Q2_K] = XN(q2_k);
    table[T_Q3_K] = XN(q3_k);
    table[T_Q4_K] = XN(q4_k);
    table[T_Q5_K] = XN(q5_k);
    table[T_Q6_K] = XN(q6_k);
}

#ifdef X8_TILED
/* The entries that take every product of more than X8_XT rows as one tile, each block
 * decoded once for all its rows, where X8_B32_TILE and X8_Q4_K_CHUNKED take some 4 rows
 * at a time (X8_TILED: a set whose processor measured the tiles faster, dot_avx512.c's
 * avx512-intel): Q8_0, IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1 and Q4_K (the other K-quants'
 * and IQ4_XS's as XN(fill)'s), into a table that XN(fill) filled */
X8_ENTRY_T(q8_0_tiled, X8_CALL_Q8_0, 2, 1)
X8_ENTRY_T(iq4_nl_tiled, X8_CALL_IQ4_NL, 3, 1)
X8_ENTRY_T(q4_0_tiled, X8_CALL_Q4_0, 0, 1)
X8_ENTRY_T(q4_1_tiled, X8_CALL_Q4_1, 1, 1)
X8_ENTRY_T(q5_0_tiled, X8_CALL_Q5_0, 4, 1)
X8_ENTRY_T(q5_1_tiled, X8_CALL_Q5_1, 5, 1)
X8_K_ENTRY_CH(q4_k_tiled, X8_Q4_K, 0)

__attribute__((unused)) static void XN(fill_tiled)(XN(fn) * table) {
    table[T_Q8_0] = XN(q8_0_tiled);
    table[T_IQ4_NL] = XN(iq4_nl_tiled);
    table[T_Q4_0] = XN(q4_0_tiled);
    table[T_Q4_1] = XN(q4_1_tiled);
    table[T_Q5_0] = XN(q5_0_tiled);
    table[T_Q5_1] = XN(q5_1_tiled);
    table[T_Q4_K] = XN(q4_k_tiled);
}
#endif

/* ---- ready for another width ------------------------------------------------------------- */

#undef X8_ENTRY
#undef X8_ENTRY_T
#undef X8_KEEP_DOT
#undef X8_B32_TILE
#undef X8_K_ENTRY
#undef X8_K_ENTRY_CH
#undef X8_K_TILE
#undef X8_Q4_K_ROW
#undef X8_Q4_K_ROW_CALL
#undef X8_Q6_K_ROW_CALL
#undef X8_EMBED
#undef X8_CALL_Q8_0
#undef X8_CALL_IQ4_NL
#undef v_shuf8
#undef X8_CALL_Q4_0
#undef X8_CALL_Q4_1
#undef X8_CALL_Q5_0
#undef X8_CALL_Q5_1
#undef XN
#undef XL
#undef VI
#undef VF
#undef v_and
#undef v_or
#undef v_xor
#undef v_srli16
#undef v_slli16
#undef v_add32
#undef v_sub32
#undef v_mullo32
#undef v_madd16
#undef v_set1_8
#undef v_set1_32
#undef v_zero
#undef v_dot4
#undef v_abs8
#undef v_sign8
#undef X8_AVX2
#undef X8_PAIRS16
#undef v_maddubs
#undef v_add16
#undef v_slli32
#undef v_srli32
#undef v_set1_16
#undef v_packs32
#undef v_lane32
#undef f_mul
#undef f_add
#undef f_sub
#undef f_cvt
#undef f_set1
#undef f_zero
#undef f_store
#undef X8_FN
#undef X8_INL
#undef X8_WIDTH
#undef X8_DOT256
