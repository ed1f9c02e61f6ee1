/* x8_pair_kernels.h: AVX-512's decode products of one x8 group (repack.h) on 512-bit
 * vectors holding two consecutive words of it: included by dot_avx512.c after
 * x8_kernels.h's 256-bit instantiation (its x8_k_terms, x8_finish and helpers), under
 * its X8_TARGET. Defines xp_q4_0, xp_q4_1, xp_iq4_nl, xp_q4_k and xp_q6_k (x8_fn).
 *
 * x8_kernels.h's 512-bit kernels take two groups, one word of each per vector, from two
 * streams gs bytes apart: every load is two 256-bit loads and an insert. These read one
 * stream: a 64-byte load is words 2m, 2m + 1 of the group (lanes 0-7 word 2m's rows,
 * 8-15 word 2m + 1's, the same 8 rows), with each half's 4 activation bytes put in its
 * lanes by one vpermd from the 64 activation bytes of the sub-block pair. Every word's
 * high bits (Q6_K) come from one broadcast 32-byte load, a masked shift and a ternary
 * logic operation. Each row's integer sums are computed in the two halves separately
 * and added at the end of each block (super-block): exact, so the float terms (Q4_0's
 * and Q4_1's as x8_q4_body's, x8_k_terms' for the K-quants), and so the bits, are
 * every other kernel's (dot.h).
 *
 * Measured faster than the 256-bit one-group kernels for few activation rows (a decode
 * step's): see dot_avx512.c.
 */
#ifndef X8_TARGET
#error "include after dot_avx512.c's X8_TARGET"
#endif

#define XP_FN __attribute__((target(X8_TARGET)))
#define XP_INL static inline __attribute__((always_inline, target(X8_TARGET)))

/* the activation dwords of words 2m, 2m + 1 of the low (sub-block 2p) and high (2p + 1)
 * halves of the 64 activation bytes of sub-block pair p: lanes 0-7, lanes 8-15 */
#define XP_IDX(a) _mm512_set_epi32(a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a, a, a, a, a, a, a, a)

/* 8 bytes at p (one per row), signed or unsigned, as int32 in lanes 0-7 and again 8-15 */
XP_INL __m512i xp_i8_twice(const uint8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm512_cvtepi8_epi32(_mm_set1_epi64x(v));
}
XP_INL __m512i xp_u8_twice(const uint8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm512_cvtepu8_epi32(_mm_set1_epi64x(v));
}

/* How far ahead of the block being read a decode product prefetches, into the
 * second-level cache (repack.h's X8_AHEAD is the other kernels'). Into the first level,
 * measured on AMD Zen 5 (one row from memory, a step's products over distinct matrices,
 * 4 of 14336 x 4096 in turn, 132 MB, the median call, 1 thread): Q4_0 37-38 GB/s at 3360
 * bytes, 41-43 at 6720, 44-47 at 13440 and beyond; Q6_K 35-36, 38, 38-39; a decode step
 * of the 8B shape (4 blocks, 1 thread, ms a token): Q4_0 17.7 at 3360, 15.8-15.9 at
 * 6720, 15.3-15.6 at 13440; Q6_K 24.2, 22.4-22.6, 21.3-21.8; Q4_K_S 17.3-17.6, 16.5,
 * 17.4-17.5. On AMD Zen 4 (EPYC family 25, model 17) those first-level distances
 * halved Q6_K's rate (its step's products 10.6-11.3 GB/s) and cost Q4_0 a fifth; into
 * the second level, at these distances (Q4_K's measured against half and twice it,
 * Q4_0's and Q6_K's against half), a step of the 8B shape's products (1 thread, ms a
 * token) Q4_0 33.7-34.1 -> 22.0-22.3, Q4_K_S 34.2-37.1 -> 27.6-27.7, Q6_K 75.5-79.7 ->
 * 30.7-34.5; not yet measured on Zen 5. */
#define XP_AHEAD_Q4 26880   /* 187 of Q4_0's blocks of a group, 168 of Q4_1's */
#define XP_AHEAD_Q4_K 13440 /* 11.4 super-blocks */
#define XP_AHEAD_Q6_K 26880 /* 16 super-blocks */

/* lanes 0-7 plus lanes 8-15 */
XP_INL __m256i xp_fold(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* The integer sums of super-block b (1184 bytes Q4_K, 1680 Q6_K) for NJ rows, as
 * x8_k_isum computes them (the same exact values). */
XP_INL void xp_k_isum(const uint8_t *b, const int kind, const int NJ, const int8_t *const *xq,
                      const int32_t *const *xg, __m256i *isum) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    const __m512i idx_lo[4] = {XP_IDX(0), XP_IDX(2), XP_IDX(4), XP_IDX(6)};
    const __m512i idx_hi[4] = {XP_IDX(8), XP_IDX(10), XP_IDX(12), XP_IDX(14)};
    const int at = kind == X8_Q4_K ? 160 : 144;
    __m512i acc[X8_XT];
    for (int k = 0; k < NJ; ++k) acc[k] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
        __m512i xa[X8_XT];
        for (int k = 0; k < NJ; ++k) xa[k] = _mm512_loadu_si512((const void *)(xq[k] + 64 * p));
        if (kind == X8_Q4_K) { /* sub-blocks 2p (lo), 2p + 1 (hi): words 0-7 */
            __m512i alo[X8_XT], ahi[X8_XT];
            for (int k = 0; k < NJ; ++k) alo[k] = ahi[k] = _mm512_setzero_si512();
            for (int m = 0; m < 4; ++m) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + at + 256 * p + 64 * m));
                const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (int k = 0; k < NJ; ++k) {
                    alo[k] = _mm512_dpbusd_epi32(alo[k], lo, _mm512_permutexvar_epi32(idx_lo[m], xa[k]));
                    ahi[k] = _mm512_dpbusd_epi32(ahi[k], hi, _mm512_permutexvar_epi32(idx_hi[m], xa[k]));
                }
            }
            const __m512i slo = xp_u8_twice(b + 32 + 16 * p), shi = xp_u8_twice(b + 40 + 16 * p);
            for (int k = 0; k < NJ; ++k)
                acc[k] = _mm512_add_epi32(acc[k], _mm512_add_epi32(_mm512_mullo_epi32(alo[k], slo),
                                                                   _mm512_mullo_epi32(ahi[k], shi)));
            continue;
        }
        /* Q6_K: groups 4p + h (lo: words 4h ..), 4p + 2 + h (hi); q + 32 times x less
         * 32 times the group's activation sum g, taken once (lanes 0-7) */
        for (int h = 0; h < 2; ++h) {
            __m512i alo[X8_XT], ahi[X8_XT];
            for (int k = 0; k < NJ; ++k) {
                alo[k] = _mm512_maskz_set1_epi32(0x00FF, -32 * xg[k][4 * p + h]);
                ahi[k] = _mm512_maskz_set1_epi32(0x00FF, -32 * xg[k][4 * p + 2 + h]);
            }
            for (int m = 2 * h; m < 2 * h + 2; ++m) { /* words 2m, 2m + 1 */
                const __m512i v = _mm512_loadu_si512((const void *)(b + at + 256 * p + 64 * m));
                /* their high bits: word 2m's in bits 0-1 (lo) and 2-3 (hi), 2m + 1's in
                 * 4-5 and 6-7; to bits 4-5: word 2m's shifted by 4 (lanes 0-7 only) */
                const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 1168 + 128 * p + 32 * m)));
                const __m512i t = _mm512_mask_slli_epi16(hb, 0x0000FFFF, hb, 4);
                /* x | (y & 0x30): ternary logic 0xF8 on (x, y, 0x30) */
                const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(v, m4), t, two, 0xF8);
                const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                                                             _mm512_srli_epi16(t, 2), two, 0xF8);
                for (int k = 0; k < NJ; ++k) {
                    alo[k] = _mm512_dpbusd_epi32(alo[k], lo, _mm512_permutexvar_epi32(idx_lo[m], xa[k]));
                    ahi[k] = _mm512_dpbusd_epi32(ahi[k], hi, _mm512_permutexvar_epi32(idx_hi[m], xa[k]));
                }
            }
            const __m512i slo = xp_i8_twice(b + 16 + 8 * (4 * p + h));
            const __m512i shi = xp_i8_twice(b + 16 + 8 * (4 * p + 2 + h));
            for (int k = 0; k < NJ; ++k)
                acc[k] = _mm512_add_epi32(acc[k], _mm512_add_epi32(_mm512_mullo_epi32(alo[k], slo),
                                                                   _mm512_mullo_epi32(ahi[k], shi)));
        }
    }
    for (int k = 0; k < NJ; ++k) isum[k] = xp_fold(acc[k]);
}

XP_INL void xp_k_body(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j0, float (*out)[8],
                      const int NJ, const int kind) {
    const int gb = kind == X8_Q4_K ? 1184 : 1680;
    __m256 acc[X8_XT][8];
    x8_zero(acc, NJ);
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * gb;
        x8_prefetch2(b + (kind == X8_Q4_K ? XP_AHEAD_Q4_K : XP_AHEAD_Q6_K), gb);
        const int8_t *xq[X8_XT];
        const int32_t *xg[X8_XT];
        x8_k_rows(xq, xg, x, j0, nc, sb, NJ);
        __m256i isum[X8_XT];
        xp_k_isum(b, kind, NJ, xq, xg, isum);
        x8_k_terms(b, 0, kind, isum, NJ, x, j0, nc, sb, acc, xg);
    }
    x8_finish(acc, NJ, out);
}

/* Q4_0: (dw * d) * (sumi - 8 g); Q4_1: (dw * d) * sumi + m * s, as x8_q4_body computes
 * them; IQ4_NL (Q4_0's layout): (dw * d) * (sumi' - 128 g), sumi' the sum of the values
 * its nibbles index plus 128 (vpshufb of them, an unsigned byte each) times x, as
 * x8_q8_0_body computes it: words 0-1 and 2-3 of a block per 64-byte load */
enum { XP_Q4_0, XP_Q4_1, XP_IQ4_NL };
XP_INL void xp_q4_body(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j0, float (*out)[8],
                       const int NJ, const int kind) {
    const int q4_1 = kind == XP_Q4_1, nl = kind == XP_IQ4_NL;
    const int gb = q4_1 ? 160 : 144, at = q4_1 ? 32 : 16;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i table = _mm512_xor_si512(x16_iq4_table(), _mm512_set1_epi8((char)0x80));
    const __m512i idx_lo[2] = {XP_IDX(0), XP_IDX(2)}, idx_hi[2] = {XP_IDX(4), XP_IDX(6)};
    __m256 acc[X8_XT][8];
    x8_zero(acc, NJ);
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * gb;
        x8_prefetch2(b + XP_AHEAD_Q4, gb);
        const __m256 dw = x8_ld_halves(b, 0);
        const __m256 mw = q4_1 ? x8_ld_halves(b + 16, 0) : _mm256_setzero_ps();
        __m512i lo[2], hi[2];
        for (int m = 0; m < 2; ++m) {
            const __m512i v = _mm512_loadu_si512((const void *)(b + at + 64 * m));
            lo[m] = _mm512_and_si512(v, m4);
            hi[m] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (nl) {
                lo[m] = _mm512_shuffle_epi8(table, lo[m]);
                hi[m] = _mm512_shuffle_epi8(table, hi[m]);
            }
        }
        for (int k = 0; k < NJ; ++k) {
            const int64_t j = j0 + k;
            const __m512i xa = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x->q + j * x->qs + 32 * c)));
            __m512i si = q4_1 ? _mm512_setzero_si512()
                              : _mm512_maskz_set1_epi32(0x00FF, (nl ? -128 : -8) * x->g[j * 2 * nc + c]);
            __m512i si2 = _mm512_setzero_si512();
            for (int m = 0; m < 2; ++m) {
                si = _mm512_dpbusd_epi32(si, lo[m], _mm512_permutexvar_epi32(idx_lo[m], xa));
                si2 = _mm512_dpbusd_epi32(si2, hi[m], _mm512_permutexvar_epi32(idx_hi[m], xa));
            }
            const __m256i s = xp_fold(_mm512_add_epi32(si, si2));
            const __m256 fac = _mm256_mul_ps(dw, _mm256_set1_ps(x->d[j * nc + c]));
            __m256 term = _mm256_mul_ps(fac, _mm256_cvtepi32_ps(s));
            if (q4_1) term = _mm256_add_ps(term, _mm256_mul_ps(mw, _mm256_set1_ps(x->s[j * nc + c])));
            acc[k][c & 7] = _mm256_add_ps(acc[k][c & 7], term);
        }
    }
    x8_finish(acc, NJ, out);
}

/* nj <= X8_XT rows (a decode step's): dot_avx512.c sets these for the row counts where
 * they measured faster */
#define XP_ENTRY(NAME, BODY, KIND)                                                                     \
    XP_FN __attribute__((unused)) static void NAME(const uint8_t *grp, int64_t gs, int64_t nc,    \
                                                   const XRows *x, int64_t j0, int nj,           \
                                                   float (*out)[8]) {                            \
        (void)gs;                                                                                \
        switch (nj) {                                                                            \
        case 1: BODY(grp, nc, x, j0, out, 1, KIND); break;                                       \
        case 2: BODY(grp, nc, x, j0, out, 2, KIND); break;                                       \
        case 3: BODY(grp, nc, x, j0, out, 3, KIND); break;                                       \
        default: BODY(grp, nc, x, j0, out, 4, KIND); break;                                      \
        }                                                                                        \
    }
XP_ENTRY(xp_q4_0, xp_q4_body, XP_Q4_0)
XP_ENTRY(xp_q4_1, xp_q4_body, XP_Q4_1)
XP_ENTRY(xp_iq4_nl, xp_q4_body, XP_IQ4_NL)
XP_ENTRY(xp_q4_k, xp_k_body, X8_Q4_K)
XP_ENTRY(xp_q6_k, xp_k_body, X8_Q6_K)

#undef XP_ENTRY
#undef XP_IDX
#undef XP_FN
#undef XP_INL
