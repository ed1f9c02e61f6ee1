/* x8_iq4xs_kernels.h: IQ4_XS's products: a few rows (iq4xs_body) and a tile (iq4xs_rows).
 * A part of x8_kernels.h, which includes it once per vector width under its X8_TARGET and
 * X8_WIDTH (so no include guard): see there for the layout, the exact sums and the order
 * of the float terms. */
#ifndef XN
#error "x8_iq4xs_kernels.h is included by x8_kernels.h"
#endif

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
            a[k] = XN(dot4_at)(a[k], u[w], xs[k] + 4 * w);
            b[k] = XN(dot4_at)(b[k], u[w + 1], xs[k] + 4 * w + 4);
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
