/* x8_b32_kernels.h: the 32-element blocks' products: Q8_0 and IQ4_NL (q8_0_body), Q4_0,
 * Q4_1, Q5_0 and Q5_1 (q4_body), and their tile (b32_tile). A part of x8_kernels.h,
 * which includes it once per vector width under its X8_TARGET and X8_WIDTH (so no
 * include guard): see there for the layout, the exact sums and the order of the float
 * terms. */
#ifndef XN
#error "x8_b32_kernels.h is included by x8_kernels.h"
#endif

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
        if (NJ == 1 && !nl) XN(ahead_by)(grp, gs, c * gb, gb, X8_AHEAD_Q8_0_ROW, 1); /* repack.h */
        else {
            XN(ahead)(grp, gs, c * gb, gb);
            if (X8_EMBED && !nl) XN(ahead_by)(grp, gs, c * gb, gb, X8_AHEAD_L1, 1); /* repack.h */
        }
        const VF dw = XN(ld_halves)(b, gs);
        VI u[8], q[8];
        XN(b32_words)(b, gs, nl, u, q);
        for (int k = 0; k < NJ; ++k) {
            const int64_t j = j0 + k;
            const int8_t *xq = x->q + j * x->qs + 32 * c;
#if X8_VNNI /* two chains of vpdpbusd (its latency, not its throughput, bounds one) */
            VI si = v_set1_32(-128 * x->g[j * 2 * nc + c]), si2 = v_zero();
            for (int w = 0; w < 8; w += 2) {
                si = XN(dot4_at)(si, u[w], xq + 4 * w);
                si2 = XN(dot4_at)(si2, u[w + 1], xq + 4 * w + 4);
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

/* init plus a block's exact integer sum: the nibbles (Q5_0, Q5_1: five bits, q5) of its
 * 4 words' low (lo) and high (hi) halves times the activations xq, 4 bytes a word */
X8_INL VI XN(q4_isum)(const VI *lo, const VI *hi, const int8_t *xq, VI init, const int q5) {
#if X8_PAIRS16 /* 8 words' pairs in 16 bits: |sum| <= 8 * 2 * 15 * 128 < 2^15; five bits
                * 4 words' (4 * 2 * 31 * 128 < 2^15), the halves apart */
    const VI one = v_set1_16(1);
    if (!q5) { /* the nibbles: all 8 words in one 16-bit sum */
        VI s16 = v_add16(v_maddubs(lo[0], XN(bcast)(xq)), v_maddubs(hi[0], XN(bcast)(xq + 16)));
        for (int w = 1; w < 4; ++w)
            s16 = v_add16(s16, v_add16(v_maddubs(lo[w], XN(bcast)(xq + 4 * w)),
                                       v_maddubs(hi[w], XN(bcast)(xq + 16 + 4 * w))));
        return v_add32(init, v_madd16(s16, one));
    }
    VI l16 = v_maddubs(lo[0], XN(bcast)(xq)), h16 = v_maddubs(hi[0], XN(bcast)(xq + 16));
    for (int w = 1; w < 4; ++w) {
        l16 = v_add16(l16, v_maddubs(lo[w], XN(bcast)(xq + 4 * w)));
        h16 = v_add16(h16, v_maddubs(hi[w], XN(bcast)(xq + 16 + 4 * w)));
    }
    return v_add32(init, v_add32(v_madd16(l16, one), v_madd16(h16, one)));
#else
    (void)q5; /* two chains (exact: their order is free) */
    VI si = init, si2 = v_zero();
    for (int w = 0; w < 4; ++w) {
        si = XN(dot4_at)(si, lo[w], xq + 4 * w);
        si2 = XN(dot4_at)(si2, hi[w], xq + 16 + 4 * w);
    }
    return v_add32(si, si2);
#endif
}

#ifndef X8_B_KINDS /* once for both widths */
#define X8_B_KINDS
/* The kinds of the 4- and 5-bit blocks (b32_tile's numbering): Q4_0, Q4_1, Q5_0, Q5_1 */
enum { X8_B_Q4_0 = 0, X8_B_Q4_1 = 1, X8_B_Q5_0 = 4, X8_B_Q5_1 = 5 };
#define X8_B_MIN(kind) ((kind) == X8_B_Q4_1 || (kind) == X8_B_Q5_1) /* (dw d) sumi + m s */
#define X8_B_FIVE(kind) ((kind) >= X8_B_Q5_0)
/* a group block's bytes; where its quants' first word starts */
#define X8_B_BYTES(kind) \
    ((kind) == X8_B_Q4_0 ? 144 : (kind) == X8_B_Q4_1 ? 160 : (kind) == X8_B_Q5_0 ? 176 : 192)
#define X8_B_AT(kind) ((kind) == X8_B_Q4_0 ? 16 : (kind) == X8_B_Q5_1 ? 64 : (kind) == X8_B_Q5_0 ? 48 : 32)
/* the offset taken back as -offset * g (Q4_0 8, Q5_0 16; the others 0) */
#define X8_B_OFFSET(kind) ((kind) == X8_B_Q4_0 ? 8 : (kind) == X8_B_Q5_0 ? 16 : 0)
#endif

/* a block's 4 words of nibbles (lo: elements 4w .., hi: 16 + 4w ..), Q5_0's and Q5_1's
 * with their fifth bits (repack.c's order: element 4w + b's at bit w of byte b of the
 * word before the nibbles, 16 + 4w + b's at bit 4 + w) at bit 4 */
X8_INL void XN(b4_words)(const uint8_t *b, int64_t gs, const int kind, VI *lo, VI *hi) {
    const VI m4 = v_set1_8(0x0F), bit4 = v_set1_8(0x10);
    const int at = X8_B_AT(kind);
    const VI h = X8_B_FIVE(kind) ? XN(ld)(b + at - 32, gs) : v_zero();
    for (int w = 0; w < 4; ++w) {
        const VI v = XN(ld)(b + at + 32 * w, gs);
        lo[w] = v_and(v, m4);
        hi[w] = v_and(v_srli16(v, 4), m4);
        if (X8_B_FIVE(kind)) {
            lo[w] = v_or(lo[w], v_and(v_slli16(h, 4 - w), bit4));
            hi[w] = v_or(hi[w], v_and(w == 0 ? h : v_srli16(h, w), bit4));
        }
    }
}

/* a 4- or 5-bit block's exact integer sum for an activation row (q4_isum's: its bytes xq,
 * its sum g), the offset taken back: without VNNI g broadcast from memory, shifted (the
 * offsets are 8 and 16) and subtracted at the end, 3 instructions (load, vpslld, vpsubd)
 * where the product set into every lane took 6 (load, neg, shl, vmovd, vpbroadcastd,
 * vpaddd); with VNNI the product starts the vpdpbusd chain */
X8_INL VI XN(b4_isum)(const VI *lo, const VI *hi, const int8_t *xq, const int32_t *g, const int kind) {
#if X8_PAIRS16
    const VI si = XN(q4_isum)(lo, hi, xq, v_zero(), X8_B_FIVE(kind));
    if (!X8_B_OFFSET(kind)) return si;
    return v_sub32(si, v_slli32(XN(bcast)((const int8_t *)g), X8_B_OFFSET(kind) == 8 ? 3 : 4));
#else
    const VI init = X8_B_OFFSET(kind) ? v_set1_32(-X8_B_OFFSET(kind) * *g) : v_zero();
    return XN(q4_isum)(lo, hi, xq, init, X8_B_FIVE(kind));
#endif
}

X8_INL void XN(q4_body)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                        float (*out)[XL], const int NJ, const int kind) {
    const int gb = X8_B_BYTES(kind), has_min = X8_B_MIN(kind);
    VF acc[X8_XT][8];
    XN(zero)(acc, NJ);
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * gb;
        XN(ahead)(grp, gs, c * gb, gb);
        if (X8_EMBED && kind != X8_B_Q4_0) XN(ahead_by)(grp, gs, c * gb, gb, X8_AHEAD_L1, 1); /* repack.h */
        const VF dw = XN(ld_halves)(b, gs);
        const VF mw = has_min ? XN(ld_halves)(b + 16, gs) : f_zero();
        VI lo[4], hi[4];
        XN(b4_words)(b, gs, kind, lo, hi);
        for (int k = 0; k < NJ; ++k) {
            const int64_t j = j0 + k;
            const VI si = XN(b4_isum)(lo, hi, x->q + j * x->qs + 32 * c, x->g + j * 2 * nc + c, kind);
            const VF fac = f_mul(dw, f_set1(x->d[j * nc + c]));
            VF term = f_mul(fac, f_cvt(si));
            if (has_min) term = f_add(term, f_mul(mw, f_set1(x->s[j * nc + c])));
            acc[k][c & 7] = f_add(acc[k][c & 7], term);
        }
    }
    XN(finish)(acc, NJ, out);
}

#if X8_AVX2
/* Q4_0's product of one activation row on AVX2 (q4_body's NJ 1, the same integer sums
 * and float terms in the same order): 8 blocks a pass, block c's running sum acc[c mod
 * 8] in a register (q4_body's acc[k][c & 7], an index the compiler cannot resolve, is
 * loaded and stored again in memory every block), the addresses stepped rather than
 * computed from j and c, -8 g as a shift of g broadcast from memory (not imul, neg, vmovd
 * and vpbroadcastd from a register), and the group's 144-byte blocks prefetched a cache
 * line at a time (2.25 a block, not 3): 53 instructions a block where q4_body's NJ 1 took
 * 75, of which 36 on the vector ports (8 vpmaddubsw, 7 vpaddw, 12 to split the nibbles,
 * the float term's 6): about the floor of vpmaddubsw's way, as the ports are what bound
 * it (an Intel Xeon, Emerald Rapids, ~3 GHz: 13.5 cycles a block, 14.4 before;
 * avx512-intel's two groups per 512-bit vector 9). Its rate is what a decode step reads
 * at on such a core: in the second-level cache (512 x 4096, 1 row, every call timed
 * alone, the fastest of 1800 in turn with the build before: a script not kept) 25.5-26.7
 * GB/s before, 27.9-28.7 after (each word loaded once: 28.0), where the machine's read
 * bandwidth is about 31 GB/s a core on a quiet host. A decode step's products of the 8B
 * shape's Q4_0 (`benchmarks/cpu_builds_ab.py OLD@avx2 NEW@avx2 --model MODEL --threads T
 * --rows 1 --rounds 21`, two runs; the host's memory then reading 10-12 GB/s a core,
 * so mostly bound by it) 1 thread 0.960, 0.982 of the time, 2 threads 0.996, 0.997, the
 * same bits. avx512-zen4's one row of Q4_0 is this (AVX2's entry): not measured on Zen 4.
 * Tried and left: the pass's 18
 * prefetches spread over its 8 blocks (2 or 3 each, as q4_body's, in case 18 at once
 * took the fill buffers), and Q4_K's 19 and Q6_K's 27 likewise: in cache within 1 %, a
 * decode step's products of the 8B shape's Q4_0 (`benchmarks/cpu_builds_ab.py OLD@avx2
 * NEW@avx2 --model MODEL --threads 1 --rows 1 --rounds 15`, the host's memory then
 * reading 12 GB/s a core) 0.987 against this one's 1.006. */
X8_INL void XN(q4_0_blk)(const uint8_t *b, const int8_t *xq, float d, const int32_t *g, VF *acc) {
    const VI m4 = v_set1_8(0x0F);
    const VF dw = XN(ld_halves)(b, 0);
    VI s16 = v_zero();
    for (int w = 0; w < 4; ++w) {
        VI v = XN(ld)(b + 16 + 32 * w, 0);
        X8_KEEP(v); /* loaded once (GCC loaded it again for the low nibbles' vpand) */
        const VI lo = v_and(v, m4), hi = v_and(v_srli16(v, 4), m4);
        s16 = v_add16(s16, v_add16(v_maddubs(lo, XN(bcast)(xq + 4 * w)), v_maddubs(hi, XN(bcast)(xq + 16 + 4 * w))));
    }
    const VI si = v_sub32(v_madd16(s16, v_set1_16(1)), v_slli32(_mm256_broadcastd_epi32(_mm_cvtsi32_si128(*g)), 3));
    *acc = f_add(*acc, f_mul(f_mul(dw, f_set1(d)), f_cvt(si)));
}

X8_INL void XN(q4_0_row)(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j, float (*out)[XL]) {
    const int8_t *xq = x->q + j * x->qs;
    const float *xd = x->d + j * nc;
    const int32_t *xg = x->g + j * 2 * nc;
    VF acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = f_zero();
    int64_t c = 0;
    for (; c + 8 <= nc; c += 8) {
        const uint8_t *b = grp + 144 * c;
#pragma GCC unroll 18
        for (int l = 0; l < 18; ++l) _mm_prefetch((const char *)b + X8_AHEAD_BYTES + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i)
            XN(q4_0_blk)(b + 144 * i, xq + 32 * (c + i), xd[c + i], xg + c + i, &acc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
        if (c + i < nc) {
            XN(ahead)(grp, 0, (c + i) * 144, 144);
            XN(q4_0_blk)(grp + 144 * (c + i), xq + 32 * (c + i), xd[c + i], xg + c + i, &acc[i]);
        }
    f_store(out[0], f_add(f_add(f_add(acc[0], acc[1]), f_add(acc[2], acc[3])),
                          f_add(f_add(acc[4], acc[5]), f_add(acc[6], acc[7])))); /* XN(finish)'s */
}
#endif

/* Q4_0, Q4_1, Q8_0, IQ4_NL, Q5_0, Q5_1 for a tile of nj (> X8_XT) rows: each block
 * decoded once, then the rows one after another (their running sums in acc, memory):
 * q4_body's and q8_0_body's arithmetic, in their order. The rows' loop unrolled twice:
 * a loop step and its compare a pair of rows (AVX2's Q4_0 37.5 instructions a row and
 * block, with b4_isum's offset, where 42 were) */
X8_INL void XN(b32_tile)(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0, int nj,
                         float (*out)[XL],
                         const int kind /* 0 Q4_0, 1 Q4_1, 2 Q8_0, 3 IQ4_NL, 4 Q5_0, 5 Q5_1 */) {
    const int signed_q = kind == 2 || kind == 3;
    const int gb = kind == 2 ? 272 : kind == 3 ? 144 : X8_B_BYTES(kind);
    VF acc[X8_TILE][8];
    for (int k = 0; k < nj; ++k)
        for (int i = 0; i < 8; ++i) acc[k][i] = f_zero();
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * gb;
        XN(ahead)(grp, gs, c * gb, gb);
        const VF dw = XN(ld_halves)(b, gs);
        const VF mw = !signed_q && X8_B_MIN(kind) ? XN(ld_halves)(b + 16, gs) : f_zero();
        VI u[8], q[8];
        if (signed_q) XN(b32_words)(b, gs, kind == 3, u, q);
        else XN(b4_words)(b, gs, kind, u, u + 4);
#pragma GCC unroll 2
        for (int k = 0; k < nj; ++k) {
            const int64_t j = j0 + k;
            const int8_t *xq = x->q + j * x->qs + 32 * c;
            VI si;
            if (signed_q) {
#if X8_VNNI
                si = v_set1_32(-128 * x->g[j * 2 * nc + c]);
                VI si2 = v_zero();
                for (int w = 0; w < 8; w += 2) {
                    si = XN(dot4_at)(si, u[w], xq + 4 * w);
                    si2 = XN(dot4_at)(si2, u[w + 1], xq + 4 * w + 4);
                }
                si = v_add32(si, si2);
#else
                si = v_zero();
                for (int w = 0; w < 8; ++w) si = v_dot4(si, u[w], v_sign8(XN(bcast)(xq + 4 * w), q[w]));
#endif
            } else {
                si = XN(b4_isum)(u, u + 4, xq, x->g + j * 2 * nc + c, kind);
            }
            const VF fac = f_mul(dw, f_set1(x->d[j * nc + c]));
            VF term = f_mul(fac, f_cvt(si));
            if (!signed_q && X8_B_MIN(kind)) term = f_add(term, f_mul(mw, f_set1(x->s[j * nc + c])));
            acc[k][c & 7] = f_add(acc[k][c & 7], term);
        }
    }
    for (int k = 0; k < nj; k += X8_XT) XN(finish)(acc + k, nj - k < X8_XT ? nj - k : X8_XT, out + k);
}
