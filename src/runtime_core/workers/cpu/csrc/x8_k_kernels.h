/* x8_k_kernels.h: the K-quants' products (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): a few rows (k_body),
 * the chunked rows and the tile (k_tile). A part of x8_kernels.h, which includes it once per
 * vector width under its X8_TARGET and X8_WIDTH (so no include guard): see there for the
 * layout, the exact sums and the order of the float terms. */
#ifndef XN
#error "x8_k_kernels.h is included by x8_kernels.h"
#endif

/* ---- K-quants: Q2_K, Q4_K, Q5_K (d * dw) * isum - (d * dmin) * imin; Q3_K, Q6_K (d * dw) * isum */

#ifndef X8_KINDS
#define X8_KINDS
enum { X8_Q4_K, X8_Q5_K, X8_Q6_K, X8_Q3_K, X8_Q2_K };
/* Q2_K, Q3_K and Q6_K: a scale per 16-element group; Q3_K's and Q6_K's quants signed,
 * taken as unsigned q + X8_K_OFFSET (Q3_K's low 2 bits and high bit, 0 .. 7; Q6_K's 6
 * bits) less the offset times the group's activation sum g; Q2_K's unsigned (2 bits),
 * with a min per group (imin) */
#define X8_K_GROUPS(kind) ((kind) == X8_Q6_K || (kind) == X8_Q3_K || (kind) == X8_Q2_K)
#define X8_K_OFFSET(kind) ((kind) == X8_Q6_K ? 32 : (kind) == X8_Q3_K ? 4 : 0)
/* bytes of a group's super-block (repack.c) */
#define X8_K_BYTES(kind)                                                                 \
    ((kind) == X8_Q4_K   ? 1184                                                              \
     : (kind) == X8_Q5_K ? 1440                                                              \
     : (kind) == X8_Q6_K ? 1680                                                              \
     : (kind) == X8_Q3_K ? 912                                                               \
                         : 672)
#endif

/* word w of sub-blocks 2p (lo) and 2p + 1 (hi) of a group super-block as unsigned bytes */
X8_INL void XN(k_word)(const uint8_t *b, int64_t gs, const int kind, int p, int w, VI *lo, VI *hi) {
    if (kind == X8_Q2_K || kind == X8_Q3_K) { /* 2 bits: bits 4 (p & 1) .. of the area of
                                               * sub-blocks 4 (p >> 1) ..; Q3_K's high bit
                                               * (bit 2p, 2p + 1) to bit 2 */
        const VI m2 = v_set1_8(3);
        const VI v = XN(ld)(b + (kind == X8_Q2_K ? 160 : 144) + 256 * (p >> 1) + 32 * w, gs);
        *lo = v_and((p & 1) ? v_srli16(v, 4) : v, m2);
        *hi = v_and(v_srli16(v, (p & 1) ? 6 : 2), m2);
        if (kind == X8_Q3_K) {
            const VI four = v_set1_8(4), h = XN(ld)(b + 656 + 32 * w, gs);
            const VI hlo = p == 0 ? v_slli16(h, 2) : p == 1 ? h : v_srli16(h, 2 * p - 2);
            const VI hhi = p == 0 ? v_slli16(h, 1) : v_srli16(h, 2 * p - 1);
            *lo = v_or(*lo, v_and(hlo, four));
            *hi = v_or(*hi, v_and(hhi, four));
        }
        return;
    }
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

/* the scales of 16-element group j of the group's rows as int32 lanes: Q6_K's and Q3_K's
 * int8 at 16 + 8 j, Q2_K's the low nibble of its byte at 32 + 8 j */
X8_INL VI XN(k_gscale)(const uint8_t *b, int64_t gs, const int kind, int j) {
    if (kind == X8_Q2_K) return v_and(XN(ld_u8_i32)(b + 32 + 8 * j, gs), v_set1_32(15));
    return XN(ld_i8_i32)(b + 16 + 8 * j, gs);
}

#if X8_PAIRS16
/* Q6_K's (and Q3_K's, Q2_K's) tile without VNNI: after a super-block's 64 decoded words,
 * dec[64 + j] (j < 16) holds in each row's lane the int16 pair (s, s) of group j's scale
 * s, and dec[80 + m] (m < 8) the pair (s of group 2m, s of group 2m + 1), decoded once
 * for the tile's rows. */
#define K6_SCALES 24
X8_INL void XN(k6_scales)(const uint8_t *b, int64_t gs, const int kind, VI *out) {
    const VI low = v_set1_32(0xFFFF);
    VI s[16];
    for (int j = 0; j < 16; ++j) s[j] = XN(k_gscale)(b, gs, kind, j); /* int32, signed */
    for (int j = 0; j < 16; ++j) out[j] = v_or(v_and(s[j], low), v_slli32(s[j], 16));
    for (int m = 0; m < 8; ++m) out[16 + m] = v_or(v_and(s[2 * m], low), v_slli32(s[2 * m + 1], 16));
}

/* The same integer sums as k_isum's Q6_K, Q3_K and Q2_K (exact, so the same bits), with
 * half its multiplications: the products of two words (q + 32 <= 63 times |x| <= 128,
 * pairs summed by vpmaddubsw: 2 * 2 * 63 * 128 < 2^15; Q3_K's q + 4 <= 7, Q2_K's q <= 3)
 * added in 16 bits, then times the group's scale by vpmaddwd (sc: k6_scales); the
 * offset's sum over the super-block, 32 (Q3_K: 4; Q2_K none) * sum_j s_j g_j, by
 * vpmaddwd of the scale pairs and the rows' group sums (|g| <= 16 * 128 fits in 16
 * bits), taken once at the end. */
X8_INL void XN(k6_isum)(const VI *dec, const VI *sc, const int kind, const int NJ,
                        const int8_t *const *xq, const int32_t *const *xg, VI *isum) {
    for (int k = 0; k < NJ; ++k) {
        if (X8_K_OFFSET(kind) == 0) { /* Q2_K: no offset (its mins: k_terms) */
            isum[k] = v_zero();
            continue;
        }
        /* the 16 group sums as int16 pairs: lanes (g0 g1) (g2 g3) (g8 g9) (g10 g11) (g4 g5)
         * (g6 g7) (g12 g13) (g14 g15) (512 bits: ld reads the row's sums into both halves,
         * packs works in 128-bit lanes, so lanes 8-15 repeat 0-7) */
        const VI gp = v_packs32(XN(ld)((const uint8_t *)xg[k], 0), XN(ld)((const uint8_t *)(xg[k] + 8), 0));
        static const int lane_of_pair[8] = {0, 1, 4, 5, 2, 3, 6, 7};
        VI corr = v_zero();
        for (int m = 0; m < 8; ++m) corr = v_add32(corr, v_madd16(sc[16 + m], v_lane32(gp, lane_of_pair[m])));
        isum[k] = v_sub32(v_zero(), kind == X8_Q6_K ? v_slli32(corr, 5) : v_slli32(corr, 2));
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
 * alo, ahi; Q2_K's, Q3_K's and Q6_K's a group's sums times its scale into isum after its
 * 4 words */
X8_INL void XN(k_word_sums)(const uint8_t *b, int64_t gs, const int kind, const VI *dec, const int NJ,
                            const int8_t *const *xq, const int32_t *const *xg, int p, int w, VI *alo,
                            VI *ahi, VI *isum) {
    if (X8_K_GROUPS(kind) && w == 4)
        for (int k = 0; k < NJ; ++k) {
            alo[k] = v_set1_32(-X8_K_OFFSET(kind) * xg[k][4 * p + 1]);
            ahi[k] = v_set1_32(-X8_K_OFFSET(kind) * xg[k][4 * p + 3]);
        }
    VI lo, hi;
    if (dec) lo = dec[16 * p + 2 * w], hi = dec[16 * p + 2 * w + 1];
    else XN(k_word)(b, gs, kind, p, w, &lo, &hi);
    for (int k = 0; k < NJ; ++k) {
        if (dec && kind == X8_Q5_K) { /* Q5_K's tile: see k_tile_q5_k */
            alo[k] = v_dot4(alo[k], lo, XN(bcast)(xq[k] + 64 * p + 4 * w));
            ahi[k] = v_dot4(ahi[k], hi, XN(bcast)(xq[k] + 64 * p + 32 + 4 * w));
        } else {
            alo[k] = XN(dot4_at)(alo[k], lo, xq[k] + 64 * p + 4 * w);
            ahi[k] = XN(dot4_at)(ahi[k], hi, xq[k] + 64 * p + 32 + 4 * w);
        }
        X8_KEEP_DOT(alo[k]);
        X8_KEEP_DOT(ahi[k]);
    }
    if (X8_K_GROUPS(kind) && (w & 3) == 3) { /* groups 4p + h (lo), 4p + 2 + h (hi) */
        const int h = w >> 2, glo = 4 * p + h, ghi = 4 * p + 2 + h;
        const VI slo = XN(k_gscale)(b, gs, kind, glo);
        const VI shi = XN(k_gscale)(b, gs, kind, ghi);
        for (int k = 0; k < NJ; ++k)
            isum[k] = v_add32(isum[k], v_add32(v_mullo32(alo[k], slo), v_mullo32(ahi[k], shi)));
    }
}

/* k_isum's sums of sub-blocks 2p (lo) and 2p + 1 (hi), added into isum */
X8_INL void XN(k_isum_p)(const uint8_t *b, int64_t gs, const int kind, const VI *dec, const int NJ,
                         const int8_t *const *xq, const int32_t *const *xg, int p, VI *isum) {
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
        return;
    }
#endif
    /* the sums of sub-blocks 2p (lo), 2p + 1 (hi); Q2_K's, Q3_K's and Q6_K's of their
     * 16-element groups 4p + h, 4p + 2 + h (words 4h ..), q + 32 (Q3_K: q + 4; Q2_K:
     * q) times x less 32 (4; 0) times the group's g */
    VI alo[X8_XT], ahi[X8_XT];
    for (int k = 0; k < NJ; ++k) {
        alo[k] = X8_K_GROUPS(kind) ? v_set1_32(-X8_K_OFFSET(kind) * xg[k][4 * p]) : v_zero();
        ahi[k] = X8_K_GROUPS(kind) ? v_set1_32(-X8_K_OFFSET(kind) * xg[k][4 * p + 2]) : v_zero();
    }
    if (X8_K_GROUPS(kind) && NJ <= 2) { /* unrolled: w picks its words' high-bit shifts
                                       * and group (AVX2, one row: 12-15 % faster; 3-4
                                       * rows measured 3-7 % slower) */
#pragma GCC unroll 8
        for (int w = 0; w < 8; ++w) XN(k_word_sums)(b, gs, kind, dec, NJ, xq, xg, p, w, alo, ahi, isum);
    } else { /* left a loop: unrolled, AVX2's Q5_K tiles (which took this path
              * before their 16-bit sums) measured 5-15 % slower */
        for (int w = 0; w < 8; ++w) XN(k_word_sums)(b, gs, kind, dec, NJ, xq, xg, p, w, alo, ahi, isum);
    }
    if (!X8_K_GROUPS(kind)) { /* sub-blocks 2p, 2p + 1 */
        const VI slo = XN(ld_u8_i32)(b + 32 + 16 * p, gs);
        const VI shi = XN(ld_u8_i32)(b + 40 + 16 * p, gs);
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
    if (X8_K_GROUPS(kind) && dec) { /* a tile's: its scales decoded after its words */
        XN(k6_isum)(dec, dec + 64, kind, NJ, xq, xg, isum);
        return;
    }
#endif
    for (int k = 0; k < NJ; ++k) isum[k] = v_zero();
    /* Q2_K's and Q3_K's words decoded here: p unrolled, each 2-bit field and high bit an
     * immediate shift away, not a shift by a register. In cache (1024 x 4096, 1 thread,
     * AMD Zen 4, the builds in turn, ms; AVX-512 / AVX-512 BW / AVX2): 1 row Q3_K 0.098
     * -> 0.077, 0.132 -> 0.122, 0.131 -> 0.122, Q2_K 0.080 -> 0.066, 0.097 -> 0.091,
     * 0.096 -> 0.092; 3 rows Q3_K 0.143 -> 0.140, 0.202 -> 0.199, 0.246 -> 0.220, Q2_K
     * 0.130 -> 0.122, 0.184 -> 0.177, 0.223 -> 0.207; 4 rows 1.00-1.12x; 2 rows Q2_K with
     * VNNI 0.100 -> 0.094, without 6-7 % slower (left a loop there). */
    if ((kind == X8_Q2_K || kind == X8_Q3_K) && !dec && (NJ != 2 || X8_VNNI)) {
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) XN(k_isum_p)(b, gs, kind, dec, NJ, xq, xg, p, isum);
    } else {
        for (int p = 0; p < 4; ++p) XN(k_isum_p)(b, gs, kind, dec, NJ, xq, xg, p, isum);
    }
}

/* the float terms of super-block sb (b) for rows j0 .. j0 + NJ - 1 into acc[k][sb mod 8] */
X8_INL void XN(k_terms)(const uint8_t *b, int64_t gs, const int kind, const VI *isum, const int NJ,
                        const XRows *x, int64_t j0, int64_t nc, int64_t sb, VF (*acc)[8],
                        const int32_t *const *xg) {
    const VF dw = XN(ld_halves)(b, gs);
    if (kind == X8_Q2_K) { /* imin: the groups' mins (high nibbles) times their sums g, as
                            * int16 pairs (m <= 15, |g| <= 16 * 128) by vpmaddwd */
        const VF dmin = XN(ld_halves)(b + 16, gs);
        VI mp[8];
        for (int q = 0; q < 8; ++q)
            mp[q] = v_or(v_srli32(XN(ld_u8_i32)(b + 32 + 16 * q, gs), 4), /* groups 2q, 2q + 1 */
                         v_slli32(v_srli32(XN(ld_u8_i32)(b + 40 + 16 * q, gs), 4), 16));
        for (int k = 0; k < NJ; ++k) {
            VI imin = v_zero();
            for (int q = 0; q < 8; ++q) {
                const uint32_t g0 = (uint32_t)xg[k][2 * q] & 0xFFFFu, g1 = (uint32_t)xg[k][2 * q + 1];
                imin = v_add32(imin, v_madd16(mp[q], v_set1_32((int32_t)(g1 << 16 | g0))));
            }
            const VF xd = f_set1(x->d[(j0 + k) * nc + sb]);
            VF term = f_mul(f_mul(xd, dw), f_cvt(isum[k]));
            term = f_sub(term, f_mul(f_mul(xd, dmin), f_cvt(imin)));
            acc[k][sb & 7] = f_add(acc[k][sb & 7], term);
        }
        return;
    }
    if (X8_K_GROUPS(kind)) {
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

/* super-block sb (at b) for NJ (<= X8_XT) rows j0 ..: its integer sums, its words decoded
 * here (dec NULL: k_body) or taken from dec (a tile's, X8_XT rows at a time), then its
 * float terms into acc */
X8_INL void XN(k_chunk)(const uint8_t *b, int64_t gs, const int kind, const VI *dec, const XRows *x,
                        int64_t j0, int64_t nc, int64_t sb, VF (*acc)[8], const int NJ) {
    const int8_t *xq[X8_XT];
    const int32_t *xg[X8_XT];
    XN(k_rows)(xq, xg, x, j0, nc, sb, NJ);
    VI isum[X8_XT];
    XN(k_isum)(b, gs, kind, dec, NJ, xq, xg, isum);
    XN(k_terms)(b, gs, kind, isum, NJ, x, j0, nc, sb, acc, xg);
}

/* NJ (<= X8_XT) rows: each word decoded once and multiplied with the NJ rows' activations */
X8_INL void XN(k_body)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                       float (*out)[XL], const int NJ, const int kind) {
    const int gb = X8_K_BYTES(kind);
    VF acc[X8_XT][8];
    XN(zero)(acc, NJ);
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * gb;
        XN(ahead)(grp, gs, sb * gb, gb);
        XN(k_chunk)(b, gs, kind, NULL, x, j0, nc, sb, acc, NJ);
    }
    XN(finish)(acc, NJ, out);
}

#if X8_AVX2
/* Q4_K's product of one activation row on AVX2 (k_body's NJ 1: the same integer sums,
 * the same float terms in the same order), with fewer instructions a super-block (about
 * 425 where k_body took 636, most of them scalar: its front end, not its vector ports,
 * bounded it): its 4 sub-block pairs unrolled (their words at constant offsets, no
 * pointers to step or keep on the stack), each pair's two scales as int16 pairs (s, s) by
 * one vpshufb each from the 16 scale bytes broadcast to both halves (k_isum_p:
 * vpmovzxbd, a shift and an or each), the activation sums' int16 pairs broadcast from
 * memory (k_terms: vpermd each), and the prefetch one instruction a cache line (k_body: a
 * loop of them). In the second-level cache (512 x 4096, 1 row, every call timed alone,
 * the fastest of 1800 in turn with the build before: a script not kept; an Intel Xeon,
 * Emerald Rapids) 23.4-24.1 GB/s before, 27.8-28.8 after (avx512-intel's 30.9). Tried and
 * left: the pairs' first word's products as the 16-bit sums' start (no vpaddw with
 * zero; no faster), the words' 16-bit sums without X8_KEEP (26.4 -> 25.3 GB/s). A decode
 * step's products of the 8B shape's Q4_K_S (its Q6_K head by q6_k_row below;
 * `benchmarks/cpu_builds_ab.py OLD@avx2 NEW@avx2 --model MODEL --threads T --rows 1
 * --rounds 21`, two runs, the host's memory reading 10-12 GB/s a core) 1 thread 0.913,
 * 0.929 of the time, 2 threads 0.956, 0.901. The avxvnni and avx512 sets (and
 * avx512-zen4) take this kernel for Q4_K's one row (AVX2's entry: dot_avxvnni.c,
 * dot_avx512.c): that step at 1 thread 0.915 and 0.947.
 * Its prefetch runs 24 super-blocks ahead (Q4_K_ROW_AHEAD), not k_body's 8: on AMD Zen 4
 * (EPYC family 25, model 17; avx512-zen4 takes this kernel), with 8 ahead a decode step's
 * products of the 8B shape's Q4_K_S took 1.035-1.043 of k_body's time from memory (three
 * runs, 1 thread), though 0.87 of it in the second-level cache: the faster loop caught up
 * with its prefetches. `cpu_builds_ab.py EIGHT OLD SIXTEEN TWENTYFOUR --model MODEL
 * --threads T --rows 1 --rounds 21`, over 8 ahead: 1 thread k_body 0.962 and 0.920, 16
 * ahead 0.969 and 0.934, 24 ahead 0.944 and 0.914; 2 threads 0.973, 0.977, 0.952 (the
 * same bits). 4 ahead and the first level (8 ahead) were slower still (`cpu_x8_loop.py`,
 * 114688 x 4096: 1.19x and 2.0x the time). Not measured on Intel. */
#define Q4_K_ROW_AHEAD (3 * X8_AHEAD(1184))
X8_INL void XN(q4_k_row)(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j, float (*out)[XL]) {
    const VI m4 = v_set1_8(0x0F);
    /* slo: rows 0-3 (low half), 4-7 (high half) byte r (< 8) twice as int16; shi byte 8 + r */
    const VI pick_lo = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
                                        4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    const VI pick_hi = _mm256_add_epi8(pick_lo, _mm256_setr_epi8(8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0,
                                                                 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0));
    const int8_t *xq0 = x->q + j * x->qs;
    const int32_t *xg0 = x->g + j * 2 * nc;
    const float *xd = x->d + j * nc;
    VF acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = f_zero();
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * 1184;
        const int8_t *xq = xq0 + 256 * sb;
        const int32_t *xg = xg0 + 16 * sb;
#pragma GCC unroll 19
        for (int l = 0; l < 19; ++l) _mm_prefetch((const char *)b + Q4_K_ROW_AHEAD + 64 * l, _MM_HINT_T1);
        VI isum = v_zero();
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
            const VI sc = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * p)));
            const VI slo = _mm256_shuffle_epi8(sc, pick_lo), shi = _mm256_shuffle_epi8(sc, pick_hi);
            VI plo, phi;
#pragma GCC unroll 8
            for (int w = 0; w < 8; ++w) {
                VI v = XN(ld)(b + 160 + 256 * p + 32 * w, 0);
                X8_KEEP(v); /* loaded once (GCC loaded it again for the low nibbles' vpand) */
                const VI lo = v_maddubs(v_and(v, m4), XN(bcast)(xq + 64 * p + 4 * w));
                const VI hi = v_maddubs(v_and(v_srli16(v, 4), m4), XN(bcast)(xq + 64 * p + 32 + 4 * w));
                plo = w ? v_add16(plo, lo) : lo;
                phi = w ? v_add16(phi, hi) : hi;
                X8_KEEP(plo); /* word by word, as k_isum_p */
                X8_KEEP(phi);
            }
            isum = v_add32(isum, v_add32(v_madd16(plo, slo), v_madd16(phi, shi)));
        }
        /* k_terms: the 8 sub-blocks' activation sums as int16 pairs (s0 s1) (s4 s5) ..
         * (s2 s3) (s6 s7) .., each pair broadcast from memory */
        const __m256i sub = _mm256_hadd_epi32(_mm256_loadu_si256((const __m256i *)xg),
                                              _mm256_loadu_si256((const __m256i *)(xg + 8)));
        int32_t pairs[8] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i *)pairs, _mm256_packs_epi32(sub, sub));
        __asm__("" : "+m"(pairs)); /* read back from memory (GCC took each out of the
                                     * register with two shuffles) */
        static const int lane_of_p[4] = {0, 4, 1, 5};
        VI imin = v_zero();
        for (int p = 0; p < 4; ++p)
            imin = v_add32(imin, v_madd16(XN(ld_u8_i16)(b + 96 + 16 * p, 0), v_set1_32(pairs[lane_of_p[p]])));
        const VF xdv = f_set1(xd[sb]);
        VF term = f_mul(f_mul(xdv, XN(ld_halves)(b, 0)), f_cvt(isum));
        term = f_sub(term, f_mul(f_mul(xdv, XN(ld_halves)(b + 16, 0)), f_cvt(imin)));
        acc[sb & 7] = f_add(acc[sb & 7], term);
    }
    f_store(out[0], f_add(f_add(f_add(acc[0], acc[1]), f_add(acc[2], acc[3])),
                          f_add(f_add(acc[4], acc[5]), f_add(acc[6], acc[7])))); /* XN(finish)'s */
}

/* Q6_K's product of one activation row on AVX2 (k_body's NJ 1: the same integer sums,
 * the same float terms in the same order), with k6_isum's 16-bit sums (a tile's, there
 * decoded once for its rows): each group's words (q + 32 <= 63 times |x| <= 128) summed
 * in 16 bits two at a time (2 * 2 * 63 * 128 < 2^15), then times the group's scale s by
 * vpmaddwd with (s, s) (one vpshufb of its sign-extended int32), where k_word_sums takes
 * vpmaddubsw, vpmaddwd by ones and an addition a word and vpmulld a group; the offset's
 * 32 * sum_j s_j g_j once a super-block by vpmaddwd of the scale pairs (s_2m, s_2m+1) and
 * the group sums' int16 pairs, each broadcast from memory. About 520 operations on the
 * vector ports a super-block where k_body took 650. The 8B shape's head is Q6_K in its
 * Q4_0 and Q4_K_S files (108 of a step's 600 MB). In the second-level cache (256 and 512
 * x 4096, 1 row, as Q4_K's above) 20.3-21.4 GB/s before, 23.8-23.9 after (avx512-intel's
 * 29.3). */
X8_INL void XN(q6_k_row)(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j, float (*out)[XL]) {
    const VI m4 = v_set1_8(0x0F), two = v_set1_8(0x30);
    /* the low 16 bits of each int32 lane twice */
    const VI twice = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                      0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const int8_t *xq0 = x->q + j * x->qs;
    const int32_t *xg0 = x->g + j * 2 * nc;
    const float *xd = x->d + j * nc;
    VF acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = f_zero();
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * 1680;
        const int8_t *xq = xq0 + 256 * sb;
        const int32_t *xg = xg0 + 16 * sb;
#pragma GCC unroll 27
        for (int l = 0; l < 27; ++l) _mm_prefetch((const char *)b + X8_AHEAD(1680) + 64 * l, _MM_HINT_T1);
        VI sc[16]; /* group j's scale, int32 lanes */
#pragma GCC unroll 16
        for (int g = 0; g < 16; ++g) sc[g] = XN(ld_i8_i32)(b + 16 + 8 * g, 0);
        /* the offset: 32 sum_j s_j g_j, the group sums as int16 pairs (g0 g1) (g2 g3) (g8
         * g9) (g10 g11) (g4 g5) (g6 g7) (g12 g13) (g14 g15) (k6_isum's), each broadcast */
        int32_t gp[8] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i *)gp, _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)xg),
                                                             _mm256_loadu_si256((const __m256i *)(xg + 8))));
        __asm__("" : "+m"(gp)); /* read back from memory, not shuffled out of a register */
        static const int lane_of_pair[8] = {0, 1, 4, 5, 2, 3, 6, 7};
        VI corr = v_zero();
#pragma GCC unroll 8
        for (int m = 0; m < 8; ++m) {
            const VI pair = _mm256_blend_epi16(sc[2 * m], v_slli32(sc[2 * m + 1], 16), 0xAA);
            corr = v_add32(corr, v_madd16(pair, v_set1_32(gp[lane_of_pair[m]])));
        }
        VI isum = v_sub32(v_zero(), v_slli32(corr, 5));
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p)
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) { /* groups 4p + h (lo: sub-block 2p), 4p + 2 + h (hi) */
                const VI slo = _mm256_shuffle_epi8(sc[4 * p + h], twice);
                const VI shi = _mm256_shuffle_epi8(sc[4 * p + 2 + h], twice);
#pragma GCC unroll 2
                for (int half = 0; half < 2; ++half) { /* words w0, w0 + 1 */
                    const int w0 = 4 * h + 2 * half;
                    /* their high bits: word 2k's in bits 0-1 (lo), 2-3 (hi); 2k + 1's 4-5, 6-7 */
                    VI hb = XN(ld)(b + 1168 + 128 * p + 32 * (w0 >> 1), 0);
                    VI v0 = XN(ld)(b + 144 + 256 * p + 32 * w0, 0);
                    VI v1 = XN(ld)(b + 144 + 256 * p + 32 * w0 + 32, 0);
                    X8_KEEP(hb); /* each loaded once, as Q4_K's */
                    X8_KEEP(v0);
                    X8_KEEP(v1);
                    const VI lo0 = v_or(v_and(v0, m4), v_and(v_slli16(hb, 4), two));
                    const VI hi0 = v_or(v_and(v_srli16(v0, 4), m4), v_and(v_slli16(hb, 2), two));
                    const VI lo1 = v_or(v_and(v1, m4), v_and(hb, two));
                    const VI hi1 = v_or(v_and(v_srli16(v1, 4), m4), v_and(v_srli16(hb, 2), two));
                    const int8_t *xp = xq + 64 * p + 4 * w0;
                    const VI plo = v_add16(v_maddubs(lo0, XN(bcast)(xp)), v_maddubs(lo1, XN(bcast)(xp + 4)));
                    const VI phi = v_add16(v_maddubs(hi0, XN(bcast)(xp + 32)), v_maddubs(hi1, XN(bcast)(xp + 36)));
                    isum = v_add32(isum, v_add32(v_madd16(plo, slo), v_madd16(phi, shi)));
                }
            }
        const VF xdv = f_set1(xd[sb]);
        acc[sb & 7] = f_add(acc[sb & 7], f_mul(f_mul(xdv, XN(ld_halves)(b, 0)), f_cvt(isum)));
    }
    f_store(out[0], f_add(f_add(f_add(acc[0], acc[1]), f_add(acc[2], acc[3])),
                          f_add(f_add(acc[4], acc[5]), f_add(acc[6], acc[7])))); /* XN(finish)'s */
}
#define X8_Q4_K_ROW 1
#else
#define X8_Q4_K_ROW 0
#endif

/* NJ rows (X8_XT < nj <= X8_TILE) of a tile: a super-block's words decoded once (into
 * dec, in cache), then taken by the rows X8_XT at a time (k_chunk); each row's running sums
 * in acc (memory). Every row computes what k_body computes, in its order. */
X8_INL void XN(k_tile)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0, int nj,
                       float (*out)[XL], const int kind) {
    const int gb = X8_K_BYTES(kind);
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
        if (X8_K_GROUPS(kind)) XN(k6_scales)(b, gs, kind, dec + 64);
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

#if X8_EMBED
/* Q5_K's tile with X8_EMBED: a function of its own, its products' broadcasts apart from
 * vpdpbusd (k_word_sums). Inlined into its entry beside k_body's embedded broadcasts, the
 * tile measured 6-15 % slower than before them (AMD Zen 4, in cache, 1024 x 4096, 8 rows
 * 0.278 -> 0.310-0.319 ms, 16 rows 0.505 -> 0.533-0.548; as here 0.286 and 0.504); the
 * other K-quants' tiles gain from them inline (Q4_K 16 rows 0.481 -> 0.458-0.463) and
 * measured slower as a function of their own (Q6_K 16 rows 0.583 -> 0.599-0.614). */
X8_FN __attribute__((noinline)) static void XN(k_tile_q5_k)(const uint8_t *grp, int64_t gs, int64_t nc,
                                                           const XRows *x, int64_t j0, int nj,
                                                           float (*out)[XL]) {
    XN(k_tile)(grp, gs, nc, x, j0, nj, out, X8_Q5_K);
}
#define X8_K_TILE(KIND)                                                                    \
    ((KIND) == X8_Q5_K ? XN(k_tile_q5_k)(grp, gs, nc, x, j0, nj, out)                        \
                       : XN(k_tile)(grp, gs, nc, x, j0, nj, out, KIND))
#else
#define X8_K_TILE(KIND) XN(k_tile)(grp, gs, nc, x, j0, nj, out, KIND)
#endif
