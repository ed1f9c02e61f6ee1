/* x8_kernels.h: the products of x8 groups (repack.h) with 8-bit activations, for one
 * x86 instruction set: included by its file (dot_avx2.c, dot_avx512.c) after it defines
 *
 *   X8_TARGET   the target attribute's string ("avx2,f16c", ...)
 *   X8_VNNI     1 where vpdpbusd (4 unsigned-by-signed byte products added to an int32)
 *               exists, 0 for AVX2's vpmaddubsw + vpmaddwd
 *
 * and defines x8_q8_0, x8_q4_0, x8_q4_1, x8_q4_k, x8_q5_k, x8_q6_k (x8_fn, dot.h).
 *
 * Vector lane i is row i of the group. A word (32 bytes: 4 quants of every row) is
 * multiplied by 4 activation bytes broadcast to every lane, the 4 products added
 * exactly into each row's int32 (the unsigned weights times the signed activations:
 * Q4_0's nibbles, Q6_K's q + 32 and Q8_0's q + 128 (its sign flipped), with the offset's
 * product taken back from the activations' sums g; AVX2's pairs stay within 16 bits:
 * 2 * 63 * 127 for Q6_K, and Q8_0 takes |q| times the activations given q's sign).
 * Every integer sum is exact, so its order is free; the float terms and their 8
 * running sums per row (block c into sum c mod 8) are dot.h's, in its order, so every
 * row's bits are the stored row's on every instruction set.
 *
 * The activation rows j0 .. j0 + nj - 1 (nj <= X8_XT) share one decoding of each block:
 * a prefill multiplies every block read from memory with X8_XT rows while it is in cache.
 */
#ifndef X8_TARGET
#error "define X8_TARGET and X8_VNNI before including x8_kernels.h"
#endif

#include <immintrin.h>

#include "repack.h"

#define X8_FN __attribute__((target(X8_TARGET)))
#define X8_INL static inline __attribute__((always_inline, target(X8_TARGET)))

#ifndef X8_PREFETCH
#define X8_PREFETCH 1536 /* bytes ahead of the block being read */
#endif

X8_INL __m256i x8_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 4 activation bytes at p, broadcast to every lane */
X8_INL __m256i x8_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc + the sums of 4 products of unsigned bytes u and signed bytes x, per int32 lane */
X8_INL __m256i x8_dot4(__m256i acc, __m256i u, __m256i x) {
#if X8_VNNI
    return _mm256_dpbusd_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

X8_INL void x8_prefetch(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

/* out[k][i] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), lane by lane */
X8_INL void x8_finish(__m256 acc[X8_XT][8], int nj, float (*out)[8]) {
    for (int k = 0; k < nj; ++k) {
        __m256 *a = acc[k];
        __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])),
                                 _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7])));
        _mm256_storeu_ps(out[k], s);
    }
}

X8_INL void x8_zero(__m256 acc[X8_XT][8], int nj) {
    for (int k = 0; k < nj; ++k)
        for (int i = 0; i < 8; ++i) acc[k][i] = _mm256_setzero_ps();
}

/* ---- Q8_0: (dw * d) * sumi -------------------------------------------------------------------- */

X8_INL void x8_q8_0_body(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j0,
                         float (*out)[8], const int NJ) {
    __m256 acc[X8_XT][8];
    x8_zero(acc, NJ);
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * 272;
        x8_prefetch(b + X8_PREFETCH, 272);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        __m256i u[8], q[8];
        for (int w = 0; w < 8; ++w) {
            q[w] = x8_load(b + 16 + 32 * w);
#if X8_VNNI
            u[w] = _mm256_xor_si256(q[w], _mm256_set1_epi8((char)0x80)); /* q + 128 */
#else
            u[w] = _mm256_abs_epi8(q[w]);
#endif
        }
        for (int k = 0; k < NJ; ++k) {
            const int64_t j = j0 + k;
            const int8_t *xq = x->q + j * x->n + 32 * c;
#if X8_VNNI
            __m256i si = _mm256_set1_epi32(-128 * x->g[j * 2 * nc + c]);
            for (int w = 0; w < 8; ++w) si = x8_dot4(si, u[w], x8_bcast(xq + 4 * w));
#else
            __m256i si = _mm256_setzero_si256();
            for (int w = 0; w < 8; ++w)
                si = x8_dot4(si, u[w], _mm256_sign_epi8(x8_bcast(xq + 4 * w), q[w]));
#endif
            const __m256 fac = _mm256_mul_ps(dw, _mm256_set1_ps(x->d[j * nc + c]));
            acc[k][c & 7] = _mm256_add_ps(acc[k][c & 7], _mm256_mul_ps(fac, _mm256_cvtepi32_ps(si)));
        }
    }
    x8_finish(acc, NJ, out);
}

/* ---- Q4_0: (dw * d) * (sumi - 8 g); Q4_1: (dw * d) * sumi + m * s ------------------------------- */

X8_INL void x8_q4_body(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j0,
                       float (*out)[8], const int NJ, const int q4_1) {
    const int gb = q4_1 ? 160 : 144, at = q4_1 ? 32 : 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[X8_XT][8];
    x8_zero(acc, NJ);
    for (int64_t c = 0; c < nc; ++c) {
        const uint8_t *b = grp + c * gb;
        x8_prefetch(b + X8_PREFETCH, gb);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        const __m256 mw = q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)))
                               : _mm256_setzero_ps();
        __m256i lo[4], hi[4];
        for (int w = 0; w < 4; ++w) {
            __m256i v = x8_load(b + at + 32 * w);
            lo[w] = _mm256_and_si256(v, m4);
            hi[w] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        for (int k = 0; k < NJ; ++k) {
            const int64_t j = j0 + k;
            const int8_t *xq = x->q + j * x->n + 32 * c;
            __m256i si = q4_1 ? _mm256_setzero_si256() : _mm256_set1_epi32(-8 * x->g[j * 2 * nc + c]);
            for (int w = 0; w < 4; ++w) {
                si = x8_dot4(si, lo[w], x8_bcast(xq + 4 * w));
                si = x8_dot4(si, hi[w], x8_bcast(xq + 16 + 4 * w));
            }
            const __m256 fac = _mm256_mul_ps(dw, _mm256_set1_ps(x->d[j * nc + c]));
            __m256 term = _mm256_mul_ps(fac, _mm256_cvtepi32_ps(si));
            if (q4_1) term = _mm256_add_ps(term, _mm256_mul_ps(mw, _mm256_set1_ps(x->s[j * nc + c])));
            acc[k][c & 7] = _mm256_add_ps(acc[k][c & 7], term);
        }
    }
    x8_finish(acc, NJ, out);
}

/* ---- K-quants: Q4_K, Q5_K (d * dw) * isum - (d * dmin) * imin; Q6_K (d * dw) * isum -------- */

enum { X8_Q4_K, X8_Q5_K, X8_Q6_K };

/* word w of sub-blocks 2p (lo) and 2p + 1 (hi) of a group super-block as unsigned bytes */
X8_INL void x8_k_word(const uint8_t *b, const int kind, int p, int w, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int at = kind == X8_Q4_K ? 160 : kind == X8_Q5_K ? 416 : 144;
    const __m256i v = x8_load(b + at + 256 * p + 32 * w);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (kind == X8_Q5_K) { /* bit w of each byte to bit 4 */
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        const __m256i h0 = x8_load(b + 160 + 64 * p), h1 = x8_load(b + 192 + 64 * p);
        __m256i a = w <= 4 ? _mm256_slli_epi16(h0, 4 - w) : _mm256_srli_epi16(h0, w - 4);
        __m256i c = w <= 4 ? _mm256_slli_epi16(h1, 4 - w) : _mm256_srli_epi16(h1, w - 4);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(a, bit4));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(c, bit4));
    } else if (kind == X8_Q6_K) { /* the high 2 bits to bits 4-5 */
        const __m256i two = _mm256_set1_epi8(0x30);
        const __m256i h = x8_load(b + 1168 + 128 * p + 32 * (w >> 1));
        __m256i a = (w & 1) ? h : _mm256_slli_epi16(h, 4);
        __m256i c = (w & 1) ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(a, two));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(c, two));
    }
}

/* Each word is decoded once and multiplied with the NJ rows' activations at once; per
 * row, the sums of a sub-block (Q6_K: of a 16-element group) times its scale go into
 * isum, exactly. */
X8_INL void x8_k_body(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j0,
                      float (*out)[8], const int NJ, const int kind) {
    const int gb = kind == X8_Q4_K ? 1184 : kind == X8_Q5_K ? 1440 : 1680;
    __m256 acc[X8_XT][8];
    x8_zero(acc, NJ);
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = grp + sb * gb;
        x8_prefetch(b + X8_PREFETCH, gb);
        const int8_t *xq[X8_XT];
        const int32_t *xg[X8_XT];
        for (int k = 0; k < NJ; ++k) {
            xq[k] = x->q + (j0 + k) * x->n + 256 * sb;
            xg[k] = x->g + (j0 + k) * 2 * nc + 16 * sb;
        }
        __m256i isum[X8_XT];
        for (int k = 0; k < NJ; ++k) isum[k] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
            /* the sums of sub-blocks 2p (lo), 2p + 1 (hi); Q6_K's of their 16-element groups
             * 4p + h, 4p + 2 + h (words 4h ..), q + 32 times x less 32 times the group's g */
            __m256i alo[X8_XT], ahi[X8_XT];
            for (int k = 0; k < NJ; ++k) {
                alo[k] = kind == X8_Q6_K ? _mm256_set1_epi32(-32 * xg[k][4 * p]) : _mm256_setzero_si256();
                ahi[k] = kind == X8_Q6_K ? _mm256_set1_epi32(-32 * xg[k][4 * p + 2]) : _mm256_setzero_si256();
            }
            for (int w = 0; w < 8; ++w) {
                if (kind == X8_Q6_K && w == 4)
                    for (int k = 0; k < NJ; ++k) {
                        alo[k] = _mm256_set1_epi32(-32 * xg[k][4 * p + 1]);
                        ahi[k] = _mm256_set1_epi32(-32 * xg[k][4 * p + 3]);
                    }
                __m256i lo, hi;
                x8_k_word(b, kind, p, w, &lo, &hi);
                for (int k = 0; k < NJ; ++k) {
                    alo[k] = x8_dot4(alo[k], lo, x8_bcast(xq[k] + 64 * p + 4 * w));
                    ahi[k] = x8_dot4(ahi[k], hi, x8_bcast(xq[k] + 64 * p + 32 + 4 * w));
                }
                if (kind == X8_Q6_K && (w & 3) == 3) { /* groups 4p + h (lo), 4p + 2 + h (hi) */
                    const int h = w >> 2, glo = 4 * p + h, ghi = 4 * p + 2 + h;
                    const __m256i slo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + 8 * glo)));
                    const __m256i shi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + 8 * ghi)));
                    for (int k = 0; k < NJ; ++k)
                        isum[k] = _mm256_add_epi32(isum[k], _mm256_add_epi32(_mm256_mullo_epi32(alo[k], slo),
                                                                             _mm256_mullo_epi32(ahi[k], shi)));
                }
            }
            if (kind != X8_Q6_K) { /* sub-blocks 2p, 2p + 1 */
                const __m256i slo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 32 + 16 * p)));
                const __m256i shi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 40 + 16 * p)));
                for (int k = 0; k < NJ; ++k)
                    isum[k] = _mm256_add_epi32(isum[k], _mm256_add_epi32(_mm256_mullo_epi32(alo[k], slo),
                                                                         _mm256_mullo_epi32(ahi[k], shi)));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        if (kind == X8_Q6_K) {
            for (int k = 0; k < NJ; ++k) {
                const __m256 xd = _mm256_set1_ps(x->d[(j0 + k) * nc + sb]);
                const __m256 term = _mm256_mul_ps(_mm256_mul_ps(xd, dw), _mm256_cvtepi32_ps(isum[k]));
                acc[k][sb & 7] = _mm256_add_ps(acc[k][sb & 7], term);
            }
            continue;
        }
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)));
        __m256i mn[4];
        for (int p = 0; p < 4; ++p) mn[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 96 + 16 * p)));
        for (int k = 0; k < NJ; ++k) {
            __m256i imin = _mm256_setzero_si256();
            for (int p = 0; p < 4; ++p) { /* sub-blocks 2p, 2p + 1: their activation sums */
                int32_t s0 = xg[k][4 * p] + xg[k][4 * p + 1], s1 = xg[k][4 * p + 2] + xg[k][4 * p + 3];
                __m256i xs = _mm256_set1_epi32((int32_t)((uint32_t)s1 << 16 | ((uint32_t)s0 & 0xFFFFu)));
                imin = _mm256_add_epi32(imin, _mm256_madd_epi16(mn[p], xs));
            }
            const __m256 xd = _mm256_set1_ps(x->d[(j0 + k) * nc + sb]);
            __m256 term = _mm256_mul_ps(_mm256_mul_ps(xd, dw), _mm256_cvtepi32_ps(isum[k]));
            term = _mm256_sub_ps(term, _mm256_mul_ps(_mm256_mul_ps(xd, dmin), _mm256_cvtepi32_ps(imin)));
            acc[k][sb & 7] = _mm256_add_ps(acc[k][sb & 7], term);
        }
    }
    x8_finish(acc, NJ, out);
}

/* ---- the x8_fn entries: one body per row count, so that its loops unroll ------------------- */

#define X8_ENTRY(NAME, CALL)                                                                   \
    X8_FN __attribute__((unused)) static void NAME(const uint8_t *grp, int64_t nc, const XRows *x, int64_t j0, int nj,  \
                           float (*out)[8]) {                                                   \
        switch (nj) {                                                                           \
        case 1: CALL(1); break;                                                                 \
        case 2: CALL(2); break;                                                                 \
        case 3: CALL(3); break;                                                                 \
        default: CALL(4); break;                                                                \
        }                                                                                       \
    }

#define X8_CALL_Q8_0(N) x8_q8_0_body(grp, nc, x, j0, out, N)
#define X8_CALL_Q4_0(N) x8_q4_body(grp, nc, x, j0, out, N, 0)
#define X8_CALL_Q4_1(N) x8_q4_body(grp, nc, x, j0, out, N, 1)
#define X8_CALL_Q4_K(N) x8_k_body(grp, nc, x, j0, out, N, X8_Q4_K)
#define X8_CALL_Q5_K(N) x8_k_body(grp, nc, x, j0, out, N, X8_Q5_K)
#define X8_CALL_Q6_K(N) x8_k_body(grp, nc, x, j0, out, N, X8_Q6_K)

X8_ENTRY(x8_q8_0, X8_CALL_Q8_0)
X8_ENTRY(x8_q4_0, X8_CALL_Q4_0)
X8_ENTRY(x8_q4_1, X8_CALL_Q4_1)
X8_ENTRY(x8_q4_k, X8_CALL_Q4_K)
X8_ENTRY(x8_q5_k, X8_CALL_Q5_K)
X8_ENTRY(x8_q6_k, X8_CALL_Q6_K)
