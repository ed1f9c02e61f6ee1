/* x8_kernels.h: the products of x8 groups (repack.h) with 8-bit activations, for one
 * x86 instruction set and vector width: included by its file (dot_avx2.c, dot_avxvnni.c,
 * dot_avx512.c), once per width, after it defines
 *
 *   X8_TARGET   the target attribute's string ("avx2,f16c", ...)
 *   X8_VNNI     1 where vpdpbusd (4 unsigned-by-signed byte products added to an int32)
 *               exists, 0 for AVX2's vpmaddubsw + vpmaddwd
 *   X8_DOT256   (optional) the 256-bit vpdpbusd's intrinsic: AVX-VNNI's VEX
 *               _mm256_dpbusd_avx_epi32 (default: AVX-512 VL's _mm256_dpbusd_epi32)
 *   X8_B32_TILE (optional, 0 by default) 1: Q8_0, Q4_0, Q4_1, IQ4_NL take more than X8_XT rows
 *               as a tile, each block decoded once (b32_tile: the sets without VNNI)
 *   X8_WIDTH    256: one group, lane i its row i (defines x8_q8_0 .. x8_iq4_xs, and x8_fill
 *               to put them in a table of x8_fn);
 *               512: two consecutive groups, lanes 0-7 the first's rows, 8-15 the
 *               next's (defines x16_q8_0 .. x16_q6_k, x16_fill; needs AVX-512 BW, and with
 *               X8_VNNI 0 takes AVX2's 16-bit sums for Q4_0, Q4_1, Q4_K, Q5_K and Q6_K's
 *               tile and elsewhere the VNNI paths with AVX2's three instructions in
 *               place of vpdpbusd: dot_avx512bw.c)
 *
 * A word (32 bytes: 4 quants of every row of a group) is multiplied by 4 activation
 * bytes broadcast to every lane, the 4 products added exactly into each row's int32
 * (the unsigned weights times the signed activations: Q4_0's nibbles, Q6_K's q + 32 and
 * Q8_0's q + 128 (its sign flipped), with the offset's product taken back from the
 * activations' sums g; AVX2's pairs stay within 16 bits: 2 * 63 * 127 for Q6_K, and
 * Q8_0 takes |q| times the activations given q's sign; without VNNI, Q4_0, Q4_1, Q4_K,
 * Q5_K and (in a tile) Q6_K add several words' pairs in 16 bits before one vpmaddwd:
 * q4_isum, k_isum, k6_isum).
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
 */
#ifndef X8_TARGET
#error "define X8_TARGET, X8_VNNI and X8_WIDTH before including x8_kernels.h"
#endif

#include <immintrin.h>

#include "repack.h"

#define X8_FN __attribute__((target(X8_TARGET)))
#define X8_INL static inline __attribute__((always_inline, target(X8_TARGET)))

/* ---- the vector operations of one width --------------------------------------------------- */

#if X8_WIDTH == 256
#define XN(name) x8_##name
#define XL 8
#define VI __m256i
#define VF __m256
#define v_and _mm256_and_si256
#define v_or _mm256_or_si256
#define v_xor _mm256_xor_si256
#define v_srli16 _mm256_srli_epi16
#define v_slli16 _mm256_slli_epi16
#define v_add32 _mm256_add_epi32
#define v_sub32 _mm256_sub_epi32
#define v_mullo32 _mm256_mullo_epi32
#define v_madd16 _mm256_madd_epi16
#define v_maddubs _mm256_maddubs_epi16
#define v_add16 _mm256_add_epi16
#define v_slli32 _mm256_slli_epi32
#define v_set1_16 _mm256_set1_epi16
#define v_packs32 _mm256_packs_epi32
#define v_lane32(v, i) _mm256_permutevar8x32_epi32((v), _mm256_set1_epi32(i)) /* lane i, every lane */
#define v_set1_8 _mm256_set1_epi8
#define v_set1_32 _mm256_set1_epi32
#define v_zero _mm256_setzero_si256
#define f_mul _mm256_mul_ps
#define f_add _mm256_add_ps
#define f_sub _mm256_sub_ps
#define f_cvt _mm256_cvtepi32_ps
#define f_set1 _mm256_set1_ps
#define f_zero _mm256_setzero_ps
#define f_store _mm256_storeu_ps

/* `bytes` bytes at p of the group (gs: ignored) */
X8_INL VI XN(ld)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_loadu_si256((const __m256i *)p);
}
/* 16 bytes per group at p, widened: the 8 halves as floats; bytes to int16 */
X8_INL VF XN(ld_halves)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
X8_INL VI XN(ld_u8_i16)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}
/* 8 bytes per group at p as int32 lanes, unsigned or signed */
X8_INL VI XN(ld_u8_i32)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
X8_INL VI XN(ld_i8_i32)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* |q| and x given q's sign (x where q > 0, -x where q < 0, 0 where q = 0) */
#define v_abs8 _mm256_abs_epi8
#define v_sign8 _mm256_sign_epi8
#if X8_VNNI
#ifdef X8_DOT256 /* the VEX encoding (AVX-VNNI: dot_avxvnni.c) */
#define v_dot4 X8_DOT256
#else /* AVX-512 VL's EVEX encoding */
#define v_dot4 _mm256_dpbusd_epi32
#endif
#else
X8_INL VI v_dot4(VI acc, VI u, VI x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
#endif

#elif X8_WIDTH == 512
#define XN(name) x16_##name
#define XL 16
#define VI __m512i
#define VF __m512
#define v_and _mm512_and_si512
#define v_or _mm512_or_si512
#define v_xor _mm512_xor_si512
#define v_srli16 _mm512_srli_epi16
#define v_slli16 _mm512_slli_epi16
#define v_add32 _mm512_add_epi32
#define v_sub32 _mm512_sub_epi32
#define v_mullo32 _mm512_mullo_epi32
#define v_madd16 _mm512_madd_epi16
#define v_maddubs _mm512_maddubs_epi16
#define v_add16 _mm512_add_epi16
#define v_slli32 _mm512_slli_epi32
#define v_set1_16 _mm512_set1_epi16
#define v_packs32 _mm512_packs_epi32
#define v_lane32(v, i) _mm512_permutexvar_epi32(_mm512_set1_epi32(i), (v)) /* lane i, every lane */
#define v_set1_8 _mm512_set1_epi8
#define v_set1_32 _mm512_set1_epi32
#define v_zero _mm512_setzero_si512
#if X8_VNNI
#define v_dot4 _mm512_dpbusd_epi32
#else /* AVX-512 BW without VNNI: AVX2's three instructions, on 512-bit vectors */
X8_INL VI XN(dot4)(VI acc, VI u, VI x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
}
#define v_dot4 XN(dot4)
#endif
#define v_abs8 _mm512_abs_epi8
X8_INL VI XN(sign8)(VI x, VI q) { /* q = 0 gives x, not 0: its |q| is 0 */
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);
}
#define v_sign8 XN(sign8)
#define f_mul _mm512_mul_ps
#define f_add _mm512_add_ps
#define f_sub _mm512_sub_ps
#define f_cvt _mm512_cvtepi32_ps
#define f_set1 _mm512_set1_ps
#define f_zero _mm512_setzero_ps
#define f_store _mm512_storeu_ps

X8_INL VI XN(ld)(const uint8_t *p, int64_t gs) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + gs)), 1);
}
X8_INL __m256i XN(ld16x2)(const uint8_t *p, int64_t gs) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                   _mm_loadu_si128((const __m128i *)(p + gs)), 1);
}
X8_INL VF XN(ld_halves)(const uint8_t *p, int64_t gs) { return _mm512_cvtph_ps(XN(ld16x2)(p, gs)); }
X8_INL VI XN(ld_u8_i16)(const uint8_t *p, int64_t gs) { return _mm512_cvtepu8_epi16(XN(ld16x2)(p, gs)); }
X8_INL __m128i XN(ld8x2)(const uint8_t *p, int64_t gs) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + gs)));
}
X8_INL VI XN(ld_u8_i32)(const uint8_t *p, int64_t gs) { return _mm512_cvtepu8_epi32(XN(ld8x2)(p, gs)); }
X8_INL VI XN(ld_i8_i32)(const uint8_t *p, int64_t gs) { return _mm512_cvtepi8_epi32(XN(ld8x2)(p, gs)); }
#else
#error "X8_WIDTH is 256 or 512"
#endif

/* IQ4_NL's 16 values (quant.h) in every 128-bit lane, and a byte shuffle by them */
X8_INL VI XN(iq4_table)(void) {
    const __m128i t = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
#if X8_WIDTH == 256
    return _mm256_broadcastsi128_si256(t);
#else
    return _mm512_broadcast_i32x4(t);
#endif
}
#if X8_WIDTH == 256
#define v_shuf8 _mm256_shuffle_epi8
#else
#define v_shuf8 _mm512_shuffle_epi8
#endif

/* 4 activation bytes at p, broadcast to every lane */
X8_INL VI XN(bcast)(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v_set1_32(v);
}

/* AVX2's own (256-bit vectors without VNNI): the running sums kept word by word */
#define X8_AVX2 (!X8_VNNI && X8_WIDTH == 256)
/* Without VNNI (AVX2, AVX-512 BW): vpmaddubsw's pairs of several words added in 16 bits,
 * then one vpmaddwd (by ones, or by the scale), where VNNI takes one vpdpbusd a word:
 * Q4_0, Q4_1 (q4_isum), Q4_K, Q5_K (k_isum) and Q6_K's tile (k6_isum) */
#define X8_PAIRS16 (!X8_VNNI)

#ifndef X8_KEEP /* v stays in a register here: no reordering of its sums across this point */
#define X8_KEEP(v) __asm__("" : "+x"(v))
#endif
/* AVX2's v_dot4 is three instructions that GCC would regroup: its running sums are kept
 * word by word (VNNI's accumulate in the instruction) */
#if !X8_AVX2
#define X8_KEEP_DOT(v) ((void)0)
#else
#define X8_KEEP_DOT(v) X8_KEEP(v)
#endif

/* `bytes` bytes at p into the first-level cache (prefetch) or the second (prefetch2) */
X8_INL void XN(prefetch)(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}
X8_INL void XN(prefetch2)(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}
/* a block of `bytes` bytes into the cache repack.h's X8_L2_BLOCK picks for its size */
X8_INL void XN(prefetch_block)(const uint8_t *p, int bytes) {
    if (bytes < X8_L2_BLOCK) XN(prefetch)(p, bytes);
    else XN(prefetch2)(p, bytes);
}

/* Prefetch `bytes` X8_AHEAD(bytes) bytes ahead of offset `at` of the group (pair) being
 * read, in the order this pass reads memory: past a group's end, the next group a pass
 * takes: for two groups at once, the pair after this one (not the second group, which
 * is being read already: short rows then went unprefetched) */
X8_INL void XN(ahead)(const uint8_t *grp, int64_t gs, int64_t at, int bytes) {
    int64_t o = at + X8_AHEAD(bytes);
    if (XL == 16 && o >= gs) o += gs;
    XN(prefetch_block)(grp + o, bytes);
    if (XL == 16) XN(prefetch_block)(grp + gs + o, bytes);
}

/* out[k][i] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), lane by lane */
X8_INL void XN(finish)(VF acc[X8_XT][8], int nj, float (*out)[XL]) {
    for (int k = 0; k < nj; ++k) {
        VF *a = acc[k];
        f_store(out[k], f_add(f_add(f_add(a[0], a[1]), f_add(a[2], a[3])),
                              f_add(f_add(a[4], a[5]), f_add(a[6], a[7]))));
    }
}

X8_INL void XN(zero)(VF acc[X8_XT][8], int nj) {
    for (int k = 0; k < nj; ++k)
        for (int i = 0; i < 8; ++i) acc[k][i] = f_zero();
}

/* ---- Q8_0, IQ4_NL: (dw * d) * sumi ----------------------------------------------------------- */

/* A group block's 8 words of signed quants: Q8_0's as stored; IQ4_NL's (Q4_0's layout)
 * the values its nibbles index, word w < 4 the low nibbles (elements 4w ..), w >= 4 the
 * high ones (elements 16 + 4 (w - 4) ..): word w multiplies activations 4w .. 4w + 3
 * (IQ4_XS's sub-block s has IQ4_NL's layout at b + 64 + 128 s). With VNNI, into u each plus 128 (an unsigned byte: vpdpbusd's operand; IQ4_NL's by a
 * table of the values plus 128), q left unset; without, q and its magnitudes u. */
X8_INL void XN(b32_words)(const uint8_t *b, int64_t gs, const int nl, VI u[8], VI q[8]) {
    const VI bias = v_set1_8((char)0x80);
    if (nl) {
        const VI m4 = v_set1_8(0x0F);
#if X8_VNNI
        const VI table = v_xor(XN(iq4_table)(), bias);
        VI *out = u;
#else
        const VI table = XN(iq4_table)();
        VI *out = q;
#endif
        for (int w = 0; w < 4; ++w) {
            const VI v = XN(ld)(b + 16 + 32 * w, gs);
            out[w] = v_shuf8(table, v_and(v, m4));
            out[w + 4] = v_shuf8(table, v_and(v_srli16(v, 4), m4));
        }
    } else {
        for (int w = 0; w < 8; ++w) {
#if X8_VNNI
            u[w] = v_xor(XN(ld)(b + 16 + 32 * w, gs), bias);
#else
            q[w] = XN(ld)(b + 16 + 32 * w, gs);
#endif
        }
    }
#if X8_VNNI
    (void)q;
#else
    (void)bias;
    for (int w = 0; w < 8; ++w) u[w] = v_abs8(q[w]);
#endif
}

X8_INL void XN(q8_0_body)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                          float (*out)[XL], const int NJ, const int nl) {
    const int gb = nl ? 144 : 272;
    VF acc[X8_XT][8];
    XN(zero)(acc, NJ);
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * gb;
        XN(ahead)(grp, gs, c * gb, gb);
        const VF dw = XN(ld_halves)(b, gs);
        VI u[8], q[8];
        XN(b32_words)(b, gs, nl, u, q);
        for (int k = 0; k < NJ; ++k) {
            const int64_t j = j0 + k;
            const int8_t *xq = x->q + j * x->qs + 32 * c;
#if X8_VNNI /* two chains of vpdpbusd (its latency, not its throughput, bounds one) */
            VI si = v_set1_32(-128 * x->g[j * 2 * nc + c]), si2 = v_zero();
            for (int w = 0; w < 8; w += 2) {
                si = v_dot4(si, u[w], XN(bcast)(xq + 4 * w));
                si2 = v_dot4(si2, u[w + 1], XN(bcast)(xq + 4 * w + 4));
            }
            si = v_add32(si, si2);
#else
            VI si = v_zero();
            for (int w = 0; w < 8; ++w) si = v_dot4(si, u[w], v_sign8(XN(bcast)(xq + 4 * w), q[w]));
#endif
            const VF fac = f_mul(dw, f_set1(x->d[j * nc + c]));
            acc[k][c & 7] = f_add(acc[k][c & 7], f_mul(fac, f_cvt(si)));
        }
    }
    XN(finish)(acc, NJ, out);
}

/* ---- Q4_0: (dw * d) * (sumi - 8 g); Q4_1: (dw * d) * sumi + m * s ------------------------------- */

/* init plus a block's exact integer sum: the nibbles of its 4 words' low (lo) and high
 * (hi) halves times the activations xq, 4 bytes a word */
X8_INL VI XN(q4_isum)(const VI *lo, const VI *hi, const int8_t *xq, VI init) {
#if X8_PAIRS16 /* 8 words' pairs in 16 bits: |sum| <= 8 * 2 * 15 * 128 < 2^15 */
    VI s16 = v_add16(v_maddubs(lo[0], XN(bcast)(xq)), v_maddubs(hi[0], XN(bcast)(xq + 16)));
    for (int w = 1; w < 4; ++w)
        s16 = v_add16(s16, v_add16(v_maddubs(lo[w], XN(bcast)(xq + 4 * w)),
                                   v_maddubs(hi[w], XN(bcast)(xq + 16 + 4 * w))));
    return v_add32(init, v_madd16(s16, v_set1_16(1)));
#else /* two chains (exact: their order is free) */
    VI si = init, si2 = v_zero();
    for (int w = 0; w < 4; ++w) {
        si = v_dot4(si, lo[w], XN(bcast)(xq + 4 * w));
        si2 = v_dot4(si2, hi[w], XN(bcast)(xq + 16 + 4 * w));
    }
    return v_add32(si, si2);
#endif
}

X8_INL void XN(q4_body)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                        float (*out)[XL], const int NJ, const int q4_1) {
    const int gb = q4_1 ? 160 : 144, at = q4_1 ? 32 : 16;
    const VI m4 = v_set1_8(0x0F);
    VF acc[X8_XT][8];
    XN(zero)(acc, NJ);
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * gb;
        XN(ahead)(grp, gs, c * gb, gb);
        const VF dw = XN(ld_halves)(b, gs);
        const VF mw = q4_1 ? XN(ld_halves)(b + 16, gs) : f_zero();
        VI lo[4], hi[4];
        for (int w = 0; w < 4; ++w) {
            VI v = XN(ld)(b + at + 32 * w, gs);
            lo[w] = v_and(v, m4);
            hi[w] = v_and(v_srli16(v, 4), m4);
        }
        for (int k = 0; k < NJ; ++k) {
            const int64_t j = j0 + k;
            const int8_t *xq = x->q + j * x->qs + 32 * c;
            const VI si = XN(q4_isum)(lo, hi, xq, q4_1 ? v_zero() : v_set1_32(-8 * x->g[j * 2 * nc + c]));
            const VF fac = f_mul(dw, f_set1(x->d[j * nc + c]));
            VF term = f_mul(fac, f_cvt(si));
            if (q4_1) term = f_add(term, f_mul(mw, f_set1(x->s[j * nc + c])));
            acc[k][c & 7] = f_add(acc[k][c & 7], term);
        }
    }
    XN(finish)(acc, NJ, out);
}

/* Q4_0, Q4_1, Q8_0, IQ4_NL for a tile of nj (> X8_XT) rows: each block decoded once,
 * then the rows one after another (their running sums in acc, memory): q4_body's and
 * q8_0_body's arithmetic, in their order */
X8_INL void XN(b32_tile)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0, int nj,
                         float (*out)[XL], const int kind /* 0 Q4_0, 1 Q4_1, 2 Q8_0, 3 IQ4_NL */) {
    const int gb = kind == 2 ? 272 : kind == 1 ? 160 : 144, at = kind == 1 ? 32 : 16;
    const int signed_q = kind >= 2;
    const VI m4 = v_set1_8(0x0F);
    VF acc[X8_TILE][8];
    for (int k = 0; k < nj; ++k)
        for (int i = 0; i < 8; ++i) acc[k][i] = f_zero();
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * gb;
        XN(ahead)(grp, gs, c * gb, gb);
        const VF dw = XN(ld_halves)(b, gs);
        const VF mw = kind == 1 ? XN(ld_halves)(b + 16, gs) : f_zero();
        VI u[8], q[8];
        if (signed_q) {
            XN(b32_words)(b, gs, kind == 3, u, q);
        } else {
            for (int w = 0; w < 4; ++w) {
                VI v = XN(ld)(b + at + 32 * w, gs);
                u[w] = v_and(v, m4);
                u[4 + w] = v_and(v_srli16(v, 4), m4);
            }
        }
        for (int k = 0; k < nj; ++k) {
            const int64_t j = j0 + k;
            const int8_t *xq = x->q + j * x->qs + 32 * c;
            VI si;
            if (signed_q) {
#if X8_VNNI
                si = v_set1_32(-128 * x->g[j * 2 * nc + c]);
                VI si2 = v_zero();
                for (int w = 0; w < 8; w += 2) {
                    si = v_dot4(si, u[w], XN(bcast)(xq + 4 * w));
                    si2 = v_dot4(si2, u[w + 1], XN(bcast)(xq + 4 * w + 4));
                }
                si = v_add32(si, si2);
#else
                si = v_zero();
                for (int w = 0; w < 8; ++w) si = v_dot4(si, u[w], v_sign8(XN(bcast)(xq + 4 * w), q[w]));
#endif
            } else {
                si = XN(q4_isum)(u, u + 4, xq, kind == 1 ? v_zero() : v_set1_32(-8 * x->g[j * 2 * nc + c]));
            }
            const VF fac = f_mul(dw, f_set1(x->d[j * nc + c]));
            VF term = f_mul(fac, f_cvt(si));
            if (kind == 1) term = f_add(term, f_mul(mw, f_set1(x->s[j * nc + c])));
            acc[k][c & 7] = f_add(acc[k][c & 7], term);
        }
    }
    for (int k = 0; k < nj; k += X8_XT) XN(finish)(acc + k, nj - k < X8_XT ? nj - k : X8_XT, out + k);
}

/* ---- IQ4_XS: (d * dw) * isum, isum the sub-blocks' sums times their scales -------------------- */

/* isum[k] += the exact sum of one sub-block's 8 words of signed quants q (u: their
 * magnitudes; with VNNI, q + 128) times activations xs[k] (its 32, 4 bytes a word), times
 * the sub-block's scale sc, for NJ (<= X8_XT) rows; gsum[k]: the 32 activations' sum (VNNI
 * takes back the offset's product from it). Each word is loaded once for the rows; with
 * VNNI two chains of sums a row (vpdpbusd's latency, not its throughput, bounds one). */
X8_INL void XN(iq4xs_sub)(const VI *u, const VI *q, const VI sc, const int NJ, const int8_t *const *xs,
                          const int32_t *gsum, VI *isum) {
#if X8_VNNI
    (void)q;
    VI a[X8_XT], b[X8_XT];
    for (int k = 0; k < NJ; ++k) {
        a[k] = v_set1_32(-128 * gsum[k]);
        b[k] = v_zero();
    }
    for (int w = 0; w < 8; w += 2)
        for (int k = 0; k < NJ; ++k) {
            a[k] = v_dot4(a[k], u[w], XN(bcast)(xs[k] + 4 * w));
            b[k] = v_dot4(b[k], u[w + 1], XN(bcast)(xs[k] + 4 * w + 4));
        }
    for (int k = 0; k < NJ; ++k) isum[k] = v_add32(isum[k], v_mullo32(v_add32(a[k], b[k]), sc));
#else /* each word's pairs of products (|q| <= 127 times |x| <= 127, two: < 2^15) times the
       * scale by vpmaddwd (sc as the int16 pair (s, s)), where v_dot4 takes it by ones and
       * a vpmulld after: one chain of 32-bit adds a row */
    (void)gsum;
    const VI sc16 = v_or(v_and(sc, v_set1_32(0xFFFF)), v_slli32(sc, 16));
    for (int w = 0; w < 8; ++w)
        for (int k = 0; k < NJ; ++k) {
            const VI p = v_maddubs(u[w], v_sign8(XN(bcast)(xs[k] + 4 * w), q[w]));
            isum[k] = v_add32(isum[k], v_madd16(p, sc16));
        }
#endif
}

/* sub-block s of super-block sb for rows j0 .. j0 + NJ - 1 (iq4xs_sub) */
X8_INL void XN(iq4xs_rows_sub)(const VI *u, const VI *q, const VI sc, const int NJ, const XRows *x,
                               int64_t nc, int64_t j0, int64_t sb, int s, VI *isum) {
    const int8_t *xs[X8_XT];
    int32_t gsum[X8_XT];
    for (int k = 0; k < NJ; ++k) {
        const int64_t j = j0 + k;
        const int32_t *g = x->g + j * 2 * nc + 16 * sb + 2 * s;
        xs[k] = x->q + j * x->qs + 256 * sb + 32 * s;
        gsum[k] = g[0] + g[1];
    }
    XN(iq4xs_sub)(u, q, sc, NJ, xs, gsum, isum);
}

/* nj (<= X8_TILE) rows: each super-block's 64 words decoded once (the values its nibbles
 * index; for VNNI plus 128, the activations' sums taking it back), then taken by X8_XT
 * rows at a time, sub-block by sub-block (each word loaded once for the X8_XT rows);
 * their running sums in acc (memory), in kquant_term's order */
X8_INL void XN(iq4xs_rows)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                           int nj, float (*out)[XL]) {
    VF acc[X8_TILE][8];
    for (int k = 0; k < nj; ++k)
        for (int i = 0; i < 8; ++i) acc[k][i] = f_zero();
    VI u[64], sc[8];
    VI q[64];
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * 1104;
        XN(ahead)(grp, gs, sb * 1104, 1104);
        const VF dw = XN(ld_halves)(b, gs);
        for (int s = 0; s < 8; ++s) {
            sc[s] = XN(ld_i8_i32)(b + 16 + 8 * s, gs);
            XN(b32_words)(b + 64 + 128 * s, gs, 1, u + 8 * s, q + 8 * s);
        }
        for (int k0 = 0; k0 < nj; k0 += X8_XT) {
            const int n = nj - k0 < X8_XT ? nj - k0 : X8_XT;
            VI isum[X8_XT];
            for (int k = 0; k < X8_XT; ++k) isum[k] = v_zero();
            for (int s = 0; s < 8; ++s) {
                switch (n) {
                case 1: XN(iq4xs_rows_sub)(u + 8 * s, q + 8 * s, sc[s], 1, x, nc, j0 + k0, sb, s, isum); break;
                case 2: XN(iq4xs_rows_sub)(u + 8 * s, q + 8 * s, sc[s], 2, x, nc, j0 + k0, sb, s, isum); break;
                case 3: XN(iq4xs_rows_sub)(u + 8 * s, q + 8 * s, sc[s], 3, x, nc, j0 + k0, sb, s, isum); break;
                default: XN(iq4xs_rows_sub)(u + 8 * s, q + 8 * s, sc[s], X8_XT, x, nc, j0 + k0, sb, s, isum); break;
                }
            }
            for (int k = 0; k < n; ++k) {
                const VF fac = f_mul(f_set1(x->d[(j0 + k0 + k) * nc + sb]), dw);
                acc[k0 + k][sb & 7] = f_add(acc[k0 + k][sb & 7], f_mul(fac, f_cvt(isum[k])));
            }
        }
    }
    for (int k = 0; k < nj; k += X8_XT) XN(finish)(acc + k, nj - k < X8_XT ? nj - k : X8_XT, out + k);
}

/* NJ (<= X8_XT) rows: each sub-block's 8 words decoded and taken by the rows at once
 * (iq4xs_rows' arithmetic, in its order) */
X8_INL void XN(iq4xs_body)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                           float (*out)[XL], const int NJ) {
    VF acc[X8_XT][8];
    XN(zero)(acc, NJ);
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * 1104;
        XN(ahead)(grp, gs, sb * 1104, 1104);
        VI isum[X8_XT];
        for (int k = 0; k < NJ; ++k) isum[k] = v_zero();
        for (int s = 0; s < 8; ++s) {
            VI u[8], q[8];
            XN(b32_words)(b + 64 + 128 * s, gs, 1, u, q);
            XN(iq4xs_rows_sub)(u, q, XN(ld_i8_i32)(b + 16 + 8 * s, gs), NJ, x, nc, j0, sb, s, isum);
        }
        const VF dw = XN(ld_halves)(b, gs);
        for (int k = 0; k < NJ; ++k) {
            const VF fac = f_mul(f_set1(x->d[(j0 + k) * nc + sb]), dw);
            acc[k][sb & 7] = f_add(acc[k][sb & 7], f_mul(fac, f_cvt(isum[k])));
        }
    }
    XN(finish)(acc, NJ, out);
}

X8_FN __attribute__((unused)) static void XN(iq4_xs)(const uint8_t *grp, int64_t gs, int64_t nc,
                                                     const XRows *x, int64_t j0, int nj,
                                                     float (*out)[XL]) {
    switch (nj) {
    case 1: XN(iq4xs_body)(grp, gs, nc, x, j0, out, 1); break;
    case 2: XN(iq4xs_body)(grp, gs, nc, x, j0, out, 2); break;
    case 3: XN(iq4xs_body)(grp, gs, nc, x, j0, out, 3); break;
    case 4: XN(iq4xs_body)(grp, gs, nc, x, j0, out, 4); break;
    default: XN(iq4xs_rows)(grp, gs, nc, x, j0, nj, out); break;
    }
}

/* ---- K-quants: Q4_K, Q5_K (d * dw) * isum - (d * dmin) * imin; Q6_K (d * dw) * isum -------- */

#ifndef X8_KINDS
#define X8_KINDS
enum { X8_Q4_K, X8_Q5_K, X8_Q6_K };
#endif

/* word w of sub-blocks 2p (lo) and 2p + 1 (hi) of a group super-block as unsigned bytes */
X8_INL void XN(k_word)(const uint8_t *b, int64_t gs, const int kind, int p, int w, VI *lo, VI *hi) {
    const VI m4 = v_set1_8(0x0F);
    const int at = kind == X8_Q4_K ? 160 : kind == X8_Q5_K ? 416 : 144;
    const VI v = XN(ld)(b + at + 256 * p + 32 * w, gs);
    *lo = v_and(v, m4);
    *hi = v_and(v_srli16(v, 4), m4);
    if (kind == X8_Q5_K) { /* bit w of each byte to bit 4 */
        const VI bit4 = v_set1_8(0x10);
        const VI h0 = XN(ld)(b + 160 + 64 * p, gs), h1 = XN(ld)(b + 192 + 64 * p, gs);
        VI a = w <= 4 ? v_slli16(h0, 4 - w) : v_srli16(h0, w - 4);
        VI c = w <= 4 ? v_slli16(h1, 4 - w) : v_srli16(h1, w - 4);
        *lo = v_or(*lo, v_and(a, bit4));
        *hi = v_or(*hi, v_and(c, bit4));
    } else if (kind == X8_Q6_K) { /* the high 2 bits to bits 4-5 */
        const VI two = v_set1_8(0x30);
        const VI h = XN(ld)(b + 1168 + 128 * p + 32 * (w >> 1), gs);
        VI a = (w & 1) ? h : v_slli16(h, 4);
        VI c = (w & 1) ? v_srli16(h, 2) : v_slli16(h, 2);
        *lo = v_or(*lo, v_and(a, two));
        *hi = v_or(*hi, v_and(c, two));
    }
}

#if X8_PAIRS16
/* Q6_K's tile without VNNI: after a super-block's 64 decoded words, dec[64 + j] (j < 16)
 * holds in each row's lane the int16 pair (s, s) of group j's scale s, and dec[80 + m]
 * (m < 8) the pair (s of group 2m, s of group 2m + 1), decoded once for the tile's rows. */
#define K6_SCALES 24
X8_INL void XN(k6_scales)(const uint8_t *b, int64_t gs, VI *out) {
    const VI low = v_set1_32(0xFFFF);
    VI s[16];
    for (int j = 0; j < 16; ++j) s[j] = XN(ld_i8_i32)(b + 16 + 8 * j, gs); /* sign-extended */
    for (int j = 0; j < 16; ++j) out[j] = v_or(v_and(s[j], low), v_slli32(s[j], 16));
    for (int m = 0; m < 8; ++m) out[16 + m] = v_or(v_and(s[2 * m], low), v_slli32(s[2 * m + 1], 16));
}

/* The same integer sums as k_isum's Q6_K (exact, so the same bits), with half its
 * multiplications: the products of two words (q + 32 <= 63 times |x| <= 128, pairs
 * summed by vpmaddubsw: 2 * 2 * 63 * 128 < 2^15) added in 16 bits, then times the
 * group's scale by vpmaddwd (sc: k6_scales); the offset's sum over the super-block,
 * 32 * sum_j s_j g_j, by vpmaddwd of the scale pairs and the rows' group sums (|g| <=
 * 16 * 128 fits in 16 bits), taken once at the end. */
X8_INL void XN(k6_isum)(const VI *dec, const VI *sc, const int NJ, const int8_t *const *xq,
                        const int32_t *const *xg, VI *isum) {
    for (int k = 0; k < NJ; ++k) {
        /* the 16 group sums as int16 pairs: lanes (g0 g1) (g2 g3) (g8 g9) (g10 g11) (g4 g5)
         * (g6 g7) (g12 g13) (g14 g15) (512 bits: ld reads the row's sums into both halves,
         * packs works in 128-bit lanes, so lanes 8-15 repeat 0-7) */
        const VI gp = v_packs32(XN(ld)((const uint8_t *)xg[k], 0), XN(ld)((const uint8_t *)(xg[k] + 8), 0));
        static const int lane_of_pair[8] = {0, 1, 4, 5, 2, 3, 6, 7};
        VI corr = v_zero();
        for (int m = 0; m < 8; ++m) corr = v_add32(corr, v_madd16(sc[16 + m], v_lane32(gp, lane_of_pair[m])));
        isum[k] = v_sub32(v_zero(), v_slli32(corr, 5));
    }
    for (int p = 0; p < 4; ++p)
        for (int h = 0; h < 2; ++h) { /* groups 4p + h (sub-block 2p: lo), 4p + 2 + h (hi) */
            const VI slo = sc[4 * p + h], shi = sc[4 * p + 2 + h];
            for (int half = 0; half < 2; ++half) { /* words 4h + 2 half, + 1 */
                const int w0 = 4 * h + 2 * half;
                const VI lo0 = dec[16 * p + 2 * w0], hi0 = dec[16 * p + 2 * w0 + 1];
                const VI lo1 = dec[16 * p + 2 * w0 + 2], hi1 = dec[16 * p + 2 * w0 + 3];
                for (int k = 0; k < NJ; ++k) {
                    const int8_t *xp = xq[k] + 64 * p + 4 * w0;
                    const VI plo = v_add16(v_maddubs(lo0, XN(bcast)(xp)), v_maddubs(lo1, XN(bcast)(xp + 4)));
                    const VI phi = v_add16(v_maddubs(hi0, XN(bcast)(xp + 32)), v_maddubs(hi1, XN(bcast)(xp + 36)));
                    isum[k] = v_add32(isum[k], v_add32(v_madd16(plo, slo), v_madd16(phi, shi)));
                }
            }
        }
}
#endif

/* k_isum's word w of sub-blocks 2p (lo), 2p + 1 (hi) for NJ rows: its products into
 * alo, ahi; Q6_K's a group's sums times its scale into isum after its 4 words */
X8_INL void XN(k_word_sums)(const uint8_t *b, int64_t gs, const int kind, const VI *dec, const int NJ,
                            const int8_t *const *xq, const int32_t *const *xg, int p, int w, VI *alo,
                            VI *ahi, VI *isum) {
    if (kind == X8_Q6_K && w == 4)
        for (int k = 0; k < NJ; ++k) {
            alo[k] = v_set1_32(-32 * xg[k][4 * p + 1]);
            ahi[k] = v_set1_32(-32 * xg[k][4 * p + 3]);
        }
    VI lo, hi;
    if (dec) lo = dec[16 * p + 2 * w], hi = dec[16 * p + 2 * w + 1];
    else XN(k_word)(b, gs, kind, p, w, &lo, &hi);
    for (int k = 0; k < NJ; ++k) {
        alo[k] = v_dot4(alo[k], lo, XN(bcast)(xq[k] + 64 * p + 4 * w));
        ahi[k] = v_dot4(ahi[k], hi, XN(bcast)(xq[k] + 64 * p + 32 + 4 * w));
        X8_KEEP_DOT(alo[k]);
        X8_KEEP_DOT(ahi[k]);
    }
    if (kind == X8_Q6_K && (w & 3) == 3) { /* groups 4p + h (lo), 4p + 2 + h (hi) */
        const int h = w >> 2, glo = 4 * p + h, ghi = 4 * p + 2 + h;
        const VI slo = XN(ld_i8_i32)(b + 16 + 8 * glo, gs);
        const VI shi = XN(ld_i8_i32)(b + 16 + 8 * ghi, gs);
        for (int k = 0; k < NJ; ++k)
            isum[k] = v_add32(isum[k], v_add32(v_mullo32(alo[k], slo), v_mullo32(ahi[k], shi)));
    }
}

/* The integer sums of super-block b (isum[k], exact) for the NJ rows of xq, xg: per row,
 * the sums of a sub-block (Q6_K: of a 16-element group) times its scale. The words come
 * decoded from dec (XN(k_decode): a tile's rows share one decoding) or, dec NULL, are
 * decoded here for these NJ rows. */
X8_INL void XN(k_isum)(const uint8_t *b, int64_t gs, const int kind, const VI *dec, const int NJ,
                       const int8_t *const *xq, const int32_t *const *xg, VI *isum) {
#if X8_PAIRS16
    if (kind == X8_Q6_K && dec) { /* a tile's: its scales decoded after its words */
        XN(k6_isum)(dec, dec + 64, NJ, xq, xg, isum);
        return;
    }
#endif
    for (int k = 0; k < NJ; ++k) isum[k] = v_zero();
    for (int p = 0; p < 4; ++p) {
#if X8_PAIRS16
        if (kind == X8_Q4_K || kind == X8_Q5_K) { /* pairs of products summed in 16 bits
                                                   * over a run of words (Q4_K all 8: 8 * 2
                                                   * * 15 * 127 < 2^15; Q5_K 4: 4 * 2 * 31
                                                   * * 127 < 2^15), then times the scale */
            const int run = kind == X8_Q4_K ? 8 : 4;
            const VI s0 = XN(ld_u8_i32)(b + 32 + 16 * p, gs);
            const VI s1 = XN(ld_u8_i32)(b + 40 + 16 * p, gs);
            const VI slo = v_or(s0, v_slli32(s0, 16));
            const VI shi = v_or(s1, v_slli32(s1, 16));
            for (int w0 = 0; w0 < 8; w0 += run) {
                VI plo[X8_XT], phi[X8_XT];
                for (int k = 0; k < NJ; ++k) plo[k] = phi[k] = v_zero();
                /* unrolled: no counter or word addresses to compute (AVX2's Q4_K tile
                 * of 32 rows 1.23x as fast, benchmarks/cpu_repack.py --rows 32: 116 ->
                 * 142 GMAC/s; 4 rows 1.06x; one row, Q5_K and AVX-512 BW the same) */
#pragma GCC unroll 8
                for (int w = w0; w < w0 + run; ++w) {
                    VI lo, hi;
                    if (dec) lo = dec[16 * p + 2 * w], hi = dec[16 * p + 2 * w + 1];
                    else XN(k_word)(b, gs, kind, p, w, &lo, &hi);
                    for (int k = 0; k < NJ; ++k) {
                        const int8_t *xp = xq[k] + 64 * p + 4 * w;
                        plo[k] = v_add16(plo[k], v_maddubs(lo, XN(bcast)(xp)));
                        phi[k] = v_add16(phi[k], v_maddubs(hi, XN(bcast)(xp + 32)));
                        /* word by word: GCC otherwise adds the words' products as a
                         * tree, spilling them (one row's products took 1.2x as long
                         * in cache: benchmarks/cpu_x8_loop.py) */
                        X8_KEEP(plo[k]);
                        X8_KEEP(phi[k]);
                    }
                }
                for (int k = 0; k < NJ; ++k)
                    isum[k] = v_add32(isum[k], v_add32(v_madd16(plo[k], slo), v_madd16(phi[k], shi)));
            }
            continue;
        }
#endif
        /* the sums of sub-blocks 2p (lo), 2p + 1 (hi); Q6_K's of their 16-element groups
         * 4p + h, 4p + 2 + h (words 4h ..), q + 32 times x less 32 times the group's g */
        VI alo[X8_XT], ahi[X8_XT];
        for (int k = 0; k < NJ; ++k) {
            alo[k] = kind == X8_Q6_K ? v_set1_32(-32 * xg[k][4 * p]) : v_zero();
            ahi[k] = kind == X8_Q6_K ? v_set1_32(-32 * xg[k][4 * p + 2]) : v_zero();
        }
        if (kind == X8_Q6_K && NJ <= 2) { /* unrolled: w picks its words' high-bit shifts
                                           * and group (AVX2, one row: 12-15 % faster; 3-4
                                           * rows measured 3-7 % slower) */
#pragma GCC unroll 8
            for (int w = 0; w < 8; ++w) XN(k_word_sums)(b, gs, kind, dec, NJ, xq, xg, p, w, alo, ahi, isum);
        } else { /* left a loop: unrolled, AVX2's Q5_K tiles (which took this path
                  * before their 16-bit sums) measured 5-15 % slower */
            for (int w = 0; w < 8; ++w) XN(k_word_sums)(b, gs, kind, dec, NJ, xq, xg, p, w, alo, ahi, isum);
        }
        if (kind != X8_Q6_K) { /* sub-blocks 2p, 2p + 1 */
            const VI slo = XN(ld_u8_i32)(b + 32 + 16 * p, gs);
            const VI shi = XN(ld_u8_i32)(b + 40 + 16 * p, gs);
            for (int k = 0; k < NJ; ++k)
                isum[k] = v_add32(isum[k], v_add32(v_mullo32(alo[k], slo), v_mullo32(ahi[k], shi)));
        }
    }
}

/* the float terms of super-block sb (b) for rows j0 .. j0 + NJ - 1 into acc[k][sb mod 8] */
X8_INL void XN(k_terms)(const uint8_t *b, int64_t gs, const int kind, const VI *isum, const int NJ,
                        const XRows *x, int64_t j0, int64_t nc, int64_t sb, VF (*acc)[8],
                        const int32_t *const *xg) {
    const VF dw = XN(ld_halves)(b, gs);
    if (kind == X8_Q6_K) {
        for (int k = 0; k < NJ; ++k) {
            const VF xd = f_set1(x->d[(j0 + k) * nc + sb]);
            acc[k][sb & 7] = f_add(acc[k][sb & 7], f_mul(f_mul(xd, dw), f_cvt(isum[k])));
        }
        return;
    }
    const VF dmin = XN(ld_halves)(b + 16, gs);
    VI mn[4];
    for (int p = 0; p < 4; ++p) mn[p] = XN(ld_u8_i16)(b + 96 + 16 * p, gs);
    for (int k = 0; k < NJ; ++k) {
        VI imin = v_zero();
#if X8_WIDTH == 256 /* the 8 sub-blocks' sums (|s| <= 32 * 128) as int16 pairs, in lanes
                     * (s0 s1) (s4 s5) .. (s2 s3) (s6 s7) .. */
        const __m256i sub = _mm256_hadd_epi32(_mm256_loadu_si256((const __m256i *)xg[k]),
                                              _mm256_loadu_si256((const __m256i *)(xg[k] + 8)));
        const __m256i pairs = _mm256_packs_epi32(sub, sub);
        static const int lane_of_p[4] = {0, 4, 1, 5};
        for (int p = 0; p < 4; ++p)
            imin = v_add32(imin, v_madd16(mn[p], _mm256_permutevar8x32_epi32(pairs, v_set1_32(lane_of_p[p]))));
#else
        for (int p = 0; p < 4; ++p) { /* sub-blocks 2p, 2p + 1: their activation sums */
            int32_t s0 = xg[k][4 * p] + xg[k][4 * p + 1], s1 = xg[k][4 * p + 2] + xg[k][4 * p + 3];
            VI xs = v_set1_32((int32_t)((uint32_t)s1 << 16 | ((uint32_t)s0 & 0xFFFFu)));
            imin = v_add32(imin, v_madd16(mn[p], xs));
        }
#endif
        const VF xd = f_set1(x->d[(j0 + k) * nc + sb]);
        VF term = f_mul(f_mul(xd, dw), f_cvt(isum[k]));
        term = f_sub(term, f_mul(f_mul(xd, dmin), f_cvt(imin)));
        acc[k][sb & 7] = f_add(acc[k][sb & 7], term);
    }
}

X8_INL void XN(k_rows)(const int8_t **xq, const int32_t **xg, const XRows *x, int64_t j0, int64_t nc,
                       int64_t sb, const int NJ) {
    for (int k = 0; k < NJ; ++k) {
        xq[k] = x->q + (j0 + k) * x->qs + 256 * sb;
        xg[k] = x->g + (j0 + k) * 2 * nc + 16 * sb;
    }
}

/* NJ (<= X8_XT) rows: each word decoded once and multiplied with the NJ rows' activations */
X8_INL void XN(k_body)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                       float (*out)[XL], const int NJ, const int kind) {
    const int gb = kind == X8_Q4_K ? 1184 : kind == X8_Q5_K ? 1440 : 1680;
    VF acc[X8_XT][8];
    XN(zero)(acc, NJ);
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * gb;
        XN(ahead)(grp, gs, sb * gb, gb);
        const int8_t *xq[X8_XT];
        const int32_t *xg[X8_XT];
        XN(k_rows)(xq, xg, x, j0, nc, sb, NJ);
        VI isum[X8_XT];
        XN(k_isum)(b, gs, kind, NULL, NJ, xq, xg, isum);
        XN(k_terms)(b, gs, kind, isum, NJ, x, j0, nc, sb, acc, xg);
    }
    XN(finish)(acc, NJ, out);
}

/* NJ rows (X8_XT < nj <= X8_TILE) of a tile: a super-block's words decoded once (into
 * dec, in cache), then taken by the rows X8_XT at a time; each row's running sums in
 * acc (memory). Every row computes what k_body computes, in its order. */
X8_INL void XN(k_chunk)(const uint8_t *b, int64_t gs, const int kind, const VI *dec, const XRows *x,
                        int64_t j0, int64_t nc, int64_t sb, VF (*acc)[8], const int NJ) {
    const int8_t *xq[X8_XT];
    const int32_t *xg[X8_XT];
    XN(k_rows)(xq, xg, x, j0, nc, sb, NJ);
    VI isum[X8_XT];
    XN(k_isum)(b, gs, kind, dec, NJ, xq, xg, isum);
    XN(k_terms)(b, gs, kind, isum, NJ, x, j0, nc, sb, acc, xg);
}

X8_INL void XN(k_tile)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0, int nj,
                       float (*out)[XL], const int kind) {
    const int gb = kind == X8_Q4_K ? 1184 : kind == X8_Q5_K ? 1440 : 1680;
    VF acc[X8_TILE][8];
#if X8_PAIRS16
    VI dec[64 + K6_SCALES];
#else
    VI dec[64];
#endif
    for (int k = 0; k < nj; ++k)
        for (int i = 0; i < 8; ++i) acc[k][i] = f_zero();
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * gb;
        XN(ahead)(grp, gs, sb * gb, gb);
        for (int p = 0; p < 4; ++p)
            for (int w = 0; w < 8; ++w) XN(k_word)(b, gs, kind, p, w, &dec[16 * p + 2 * w], &dec[16 * p + 2 * w + 1]);
#if X8_PAIRS16
        if (kind == X8_Q6_K) XN(k6_scales)(b, gs, dec + 64);
#endif
        int k = 0;
        for (; k + X8_XT <= nj; k += X8_XT) XN(k_chunk)(b, gs, kind, dec, x, j0 + k, nc, sb, acc + k, X8_XT);
        switch (nj - k) {
        case 1: XN(k_chunk)(b, gs, kind, dec, x, j0 + k, nc, sb, acc + k, 1); break;
        case 2: XN(k_chunk)(b, gs, kind, dec, x, j0 + k, nc, sb, acc + k, 2); break;
        case 3: XN(k_chunk)(b, gs, kind, dec, x, j0 + k, nc, sb, acc + k, 3); break;
        default: break;
        }
    }
    for (int k = 0; k < nj; k += X8_XT) XN(finish)(acc + k, nj - k < X8_XT ? nj - k : X8_XT, out + k);
}

/* ---- the entries: one body per row count, so that its loops unroll -------------------------- */

/* nj <= X8_TILE rows: more than X8_XT as a tile (b32_tile), else at once */
#define X8_ENTRY(NAME, CALL, KIND)                                                             \
    X8_FN __attribute__((unused)) static void XN(NAME)(const uint8_t *grp, int64_t gs, int64_t nc, \
                                                       const XRows *x, int64_t j0, int nj,      \
                                                       float (*out)[XL]) {                      \
        if (X8_B32_TILE && nj > X8_XT) {                                                        \
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

/* the K-quants: more than X8_XT rows (and X8_K_CHUNKED) as a tile (k_tile) */
#define X8_K_ENTRY(NAME, KIND)                                                           \
    X8_FN __attribute__((unused)) static void XN(NAME)(const uint8_t *grp, int64_t gs, int64_t nc, \
                                                       const XRows *x, int64_t j0, int nj,      \
                                                       float (*out)[XL]) {                      \
        if (nj > X8_XT && nj > X8_K_CHUNKED(KIND)) {                                            \
            XN(k_tile)(grp, gs, nc, x, j0, nj, out, KIND);                                      \
            return;                                                                             \
        }                                                                                       \
        for (int k = 0; k < nj; k += X8_XT) {                                                   \
            const int64_t jk = j0 + k;                                                          \
            float(*ok)[XL] = out + k;                                                           \
            switch (nj - k) {                                                                   \
            case 1: XN(k_body)(grp, gs, nc, x, jk, ok, 1, KIND); break;                         \
            case 2: XN(k_body)(grp, gs, nc, x, jk, ok, 2, KIND); break;                         \
            case 3: XN(k_body)(grp, gs, nc, x, jk, ok, 3, KIND); break;                         \
            default: XN(k_body)(grp, gs, nc, x, jk, ok, 4, KIND); break;                        \
            }                                                                                   \
        }                                                                                       \
    }

#define X8_CALL_Q8_0(N) XN(q8_0_body)(grp, gs, nc, x, jk, ok, N, 0)
#define X8_CALL_IQ4_NL(N) XN(q8_0_body)(grp, gs, nc, x, jk, ok, N, 1)
#define X8_CALL_Q4_0(N) XN(q4_body)(grp, gs, nc, x, jk, ok, N, 0)
#define X8_CALL_Q4_1(N) XN(q4_body)(grp, gs, nc, x, jk, ok, N, 1)

#ifndef X8_B32_TILE /* the sets without VNNI: measured no faster with it */
#define X8_B32_TILE 0
#endif
X8_ENTRY(q8_0, X8_CALL_Q8_0, 2)
X8_ENTRY(iq4_nl, X8_CALL_IQ4_NL, 3)
X8_ENTRY(q4_0, X8_CALL_Q4_0, 0)
X8_ENTRY(q4_1, X8_CALL_Q4_1, 1)
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
    table[T_Q4_K] = XN(q4_k);
    table[T_Q5_K] = XN(q5_k);
    table[T_Q6_K] = XN(q6_k);
}

/* ---- ready for another width ------------------------------------------------------------- */

#undef X8_ENTRY
#undef X8_KEEP_DOT
#undef X8_B32_TILE
#undef X8_K_ENTRY
#undef X8_CALL_Q8_0
#undef X8_CALL_IQ4_NL
#undef v_shuf8
#undef X8_CALL_Q4_0
#undef X8_CALL_Q4_1
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
