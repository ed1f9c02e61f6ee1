/* dot_avx2.c: the products with AVX2 and F16C (x86-64 hosts that have both; the module
 * picks this set at import when the processor reports them).
 *
 * The same arithmetic as dot_portable.c, bit for bit (dot.h). A block's 32 weights are
 * spread to 32 unsigned bytes (or, for the signed Q8_0, Q3_K and Q6_K, their
 * magnitudes, the activations taking their signs), multiplied with the 32 activation
 * bytes and added in pairs (vpmaddubsw), then in pairs again, times the 16-element
 * scale of the K-quants (vpmaddwd): 8 exact int32 partial sums, added up exactly. The
 * 32-element types take 8 blocks at once: their 8 sums side by side, their 8 float
 * terms in one vector, added to the 8 running sums, lane i taking block i mod 8.
 */
#include "dot.h"
#include "ieee32.h"
#include "repack.h"

#ifdef GPP_HAVE_AVX2

#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

/* the exact sum of 8 int32 */
AVX2_INLINE int hsum_i32(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    return _mm_cvtsi128_si32(a);
}

/* lane i = the exact sum of the 8 int32 of p[i] */
AVX2_INLINE __m256i hsum_8x8(const __m256i p[8]) {
    __m256i t0 = _mm256_hadd_epi32(p[0], p[1]), t1 = _mm256_hadd_epi32(p[2], p[3]);
    __m256i t2 = _mm256_hadd_epi32(p[4], p[5]), t3 = _mm256_hadd_epi32(p[6], p[7]);
    __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31));
}


AVX2_INLINE float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

AVX2_INLINE __m256i loadu256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high nibbles */
AVX2_INLINE __m256i nibbles16(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* byte l = 0x10 where bit l of qh is set */
AVX2_INLINE __m256i bit4_bytes(uint32_t qh) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0x0000000000000000LL);
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* 8 int32 sums of pairs of (u * x) pairs, each pair times its 16-bit scale */
AVX2_INLINE __m256i dot_us(__m256i u, __m256i x, __m256i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale16);
}

/* ---- the 32-element types --------------------------------------------------------------- */

/* The halves at bytes 0-1 (lo) and 2-3 (hi) of 8 blocks of bb bytes from b, as floats. */
/* The halves at bytes 0-1 (lo) and 2-3 (hi) of the first n (<= 8) of 8 blocks of bb
 * bytes from b, as floats (0 past n). */
AVX2_INLINE void halves8(const uint8_t *b, const int bb, int n, __m256 *lo, __m256 *hi) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i at = _mm256_mullo_epi32(lane, _mm256_set1_epi32(bb));
    __m256i v;
    if (n >= 8) {
        __m128i lo4 = _mm_cvtsi32_si128((int)load_u32(b));
        lo4 = _mm_insert_epi32(lo4, (int)load_u32(b + bb), 1);
        lo4 = _mm_insert_epi32(lo4, (int)load_u32(b + 2 * bb), 2);
        lo4 = _mm_insert_epi32(lo4, (int)load_u32(b + 3 * bb), 3);
        __m128i hi4 = _mm_cvtsi32_si128((int)load_u32(b + 4 * bb));
        hi4 = _mm_insert_epi32(hi4, (int)load_u32(b + 5 * bb), 1);
        hi4 = _mm_insert_epi32(hi4, (int)load_u32(b + 6 * bb), 2);
        hi4 = _mm_insert_epi32(hi4, (int)load_u32(b + 7 * bb), 3);
        v = _mm256_set_m128i(hi4, lo4);
    } else {
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
        v = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)b, at, mask, 1);
    }
    const __m256i pick_lo = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i pick_hi = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                             2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick_lo), 0x08)));
    if (hi)
        *hi = _mm256_cvtph_ps(_mm256_castsi256_si128(
            _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick_hi), 0x08)));
}

/* IQ4_NL's and IQ4_XS's 16 values in each 128-bit lane, for vpshufb */
AVX2_INLINE __m256i iq4_table(void) {
    const __m128i t = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
    return _mm256_set_m128i(t, t);
}

/* kind: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1, 5 IQ4_NL. Block b's weights as bytes u
 * (for the signed ones, Q8_0 and IQ4_NL, their magnitudes, wq the signed bytes). */
#define LEGACY_SIGNED(kind) ((kind) == 0 || (kind) == 5)
AVX2_INLINE __m256i legacy_bytes(const uint8_t *b, const int kind, __m256i *wq) {
    if (LEGACY_SIGNED(kind)) {
        *wq = kind == 0 ? loadu256(b + 2) : _mm256_shuffle_epi8(iq4_table(), nibbles16(b + 2));
        return _mm256_sign_epi8(*wq, *wq);
    }
    if (kind == 1) return nibbles16(b + 2);
    if (kind == 2) return nibbles16(b + 4);
    if (kind == 3) return _mm256_or_si256(nibbles16(b + 6), bit4_bytes(load_u32(b + 2)));
    return _mm256_or_si256(nibbles16(b + 8), bit4_bytes(load_u32(b + 4)));
}

AVX2_INLINE void legacy_body(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,
                             float *out, const int NJ, const int kind, const int bb) {
    float acc[XT][8];
    const int8_t *xq[XT];
    const float *xd[XT], *xs[XT];
    const int32_t *xg[XT];
    for (int k = 0; k < NJ; ++k) {
        memset(acc[k], 0, sizeof acc[k]);
        xq[k] = x->q + (j0 + k) * x->qs;
        xd[k] = x->d + (j0 + k) * nc;
        xs[k] = (kind == 2 || kind == 4) ? x->s + (j0 + k) * nc : NULL;
        xg[k] = x->g + (j0 + k) * 2 * nc;
    }
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int with_m = kind == 2 || kind == 4;
    /* 8 blocks at a time; the last group may hold fewer (n), its other lanes left as
     * they are */
    for (int64_t c = 0; c < nc; c += 8) {
        const int n = nc - c < 8 ? (int)(nc - c) : 8;
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
        const uint8_t *b0 = w + bb * c;
        __m256i u[8], wq[8];
        __m256 dw, m = _mm256_setzero_ps();
        halves8(b0, bb, n, &dw, with_m ? &m : NULL);
        for (int i = 0; i < n; ++i) u[i] = legacy_bytes(b0 + bb * i, kind, &wq[i]);
        for (int k = 0; k < NJ; ++k) {
            __m256i p[8];
            for (int i = 0; i < 8; ++i) {
                if (i < n) {
                    __m256i xv = loadu256(xq[k] + 32 * (c + i));
                    if (LEGACY_SIGNED(kind)) xv = _mm256_sign_epi8(xv, wq[i]);
                    p[i] = dot_us(u[i], xv, ones);
                } else {
                    p[i] = _mm256_setzero_si256();
                }
            }
            __m256i si = hsum_8x8(p);
            if (kind == 1 || kind == 3)
                si = _mm256_sub_epi32(
                    si, _mm256_slli_epi32(_mm256_maskload_epi32(xg[k] + c, live), kind == 1 ? 3 : 4));
            __m256 fac = _mm256_mul_ps(dw, _mm256_maskload_ps(xd[k] + c, live));
            __m256 term = _mm256_mul_ps(fac, _mm256_cvtepi32_ps(si));
            if (with_m) term = _mm256_add_ps(term, _mm256_mul_ps(m, _mm256_maskload_ps(xs[k] + c, live)));
            __m256 a = _mm256_loadu_ps(acc[k]);
            _mm256_storeu_ps(acc[k], n == 8 ? _mm256_add_ps(a, term)
                                            : _mm256_blendv_ps(a, _mm256_add_ps(a, term),
                                                               _mm256_castsi256_ps(live)));
        }
    }
    for (int k = 0; k < NJ; ++k) out[k] = sum8(acc[k]);
}

/* nw weight rows (rows of row_bytes from w) times one activation row j: per row the
 * operations of legacy_body, the activation's loads shared */
AVX2_INLINE void legacy_rows_body(const uint8_t *w, int64_t row_bytes, const int NW, int64_t nc,
                                  const XRows *x, int64_t j, float *out, const int kind,
                                  const int bb) {
    float acc[WT][8];
    for (int r = 0; r < NW; ++r) memset(acc[r], 0, sizeof acc[r]);
    const int8_t *xq = x->q + j * x->qs;
    const float *xd = x->d + j * nc;
    const float *xs = (kind == 2 || kind == 4) ? x->s + j * nc : NULL;
    const int32_t *xg = x->g + j * 2 * nc;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int with_m = kind == 2 || kind == 4;
    for (int64_t c = 0; c < nc; c += 8) {
        const int n = nc - c < 8 ? (int)(nc - c) : 8;
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
        __m256i xv[8];
        for (int i = 0; i < n; ++i) xv[i] = loadu256(xq + 32 * (c + i));
        const __m256 dx = _mm256_maskload_ps(xd + c, live);
        const __m256 sx = with_m ? _mm256_maskload_ps(xs + c, live) : _mm256_setzero_ps();
        const __m256i gx = (kind == 1 || kind == 3)
                               ? _mm256_slli_epi32(_mm256_maskload_epi32(xg + c, live), kind == 1 ? 3 : 4)
                               : _mm256_setzero_si256();
        for (int r = 0; r < NW; ++r) {
            const uint8_t *b0 = w + r * row_bytes + bb * c;
            __m256 dw, m = _mm256_setzero_ps();
            halves8(b0, bb, n, &dw, with_m ? &m : NULL);
            __m256i p[8];
            for (int i = 0; i < 8; ++i) {
                if (i < n) {
                    __m256i wq;
                    __m256i u = legacy_bytes(b0 + bb * i, kind, &wq);
                    p[i] = dot_us(u, LEGACY_SIGNED(kind) ? _mm256_sign_epi8(xv[i], wq) : xv[i], ones);
                } else {
                    p[i] = _mm256_setzero_si256();
                }
            }
            __m256i si = hsum_8x8(p);
            if (kind == 1 || kind == 3) si = _mm256_sub_epi32(si, gx);
            __m256 fac = _mm256_mul_ps(dw, dx);
            __m256 term = _mm256_mul_ps(fac, _mm256_cvtepi32_ps(si));
            if (with_m) term = _mm256_add_ps(term, _mm256_mul_ps(m, sx));
            __m256 a = _mm256_loadu_ps(acc[r]);
            _mm256_storeu_ps(acc[r], n == 8 ? _mm256_add_ps(a, term)
                                            : _mm256_blendv_ps(a, _mm256_add_ps(a, term),
                                                               _mm256_castsi256_ps(live)));
        }
    }
    for (int r = 0; r < NW; ++r) out[r] = sum8(acc[r]);
}

#define LEGACY_ROWS(NAME, KIND, BB)                                                            \
    AVX2 static void q8_rows_##NAME(const uint8_t *w, int64_t row_bytes, int nw, int64_t nc,  \
                                    const XRows *x, int64_t j, float *out) {                   \
        switch (nw) {                                                                          \
        case 1: legacy_rows_body(w, row_bytes, 1, nc, x, j, out, KIND, BB); break;             \
        case 2: legacy_rows_body(w, row_bytes, 2, nc, x, j, out, KIND, BB); break;             \
        case 3: legacy_rows_body(w, row_bytes, 3, nc, x, j, out, KIND, BB); break;             \
        default: legacy_rows_body(w, row_bytes, 4, nc, x, j, out, KIND, BB); break;            \
        }                                                                                      \
    }

LEGACY_ROWS(Q8_0, 0, 34)
LEGACY_ROWS(Q4_0, 1, 18)
LEGACY_ROWS(Q4_1, 2, 20)
LEGACY_ROWS(Q5_0, 3, 22)
LEGACY_ROWS(Q5_1, 4, 24)
LEGACY_ROWS(IQ4_NL, 5, 18)

#define LEGACY(NAME, KIND, BB)                                                                 \
    AVX2 static void q8_##NAME(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,      \
                               int nj, float *out) {                                           \
        switch (nj) {                                                                          \
        case 1: legacy_body(w, nc, x, j0, out, 1, KIND, BB); break;                            \
        case 2: legacy_body(w, nc, x, j0, out, 2, KIND, BB); break;                            \
        case 3: legacy_body(w, nc, x, j0, out, 3, KIND, BB); break;                            \
        default: legacy_body(w, nc, x, j0, out, 4, KIND, BB); break;                           \
        }                                                                                      \
    }

LEGACY(Q8_0, 0, 34)
LEGACY(Q4_0, 1, 18)
LEGACY(Q4_1, 2, 20)
LEGACY(Q5_0, 3, 22)
LEGACY(Q5_1, 4, 24)
LEGACY(IQ4_NL, 5, 18)

/* ---- x8 groups (repack.h) ----------------------------------------------------------------- */

/* x8_kernels.h with vpmaddubsw: Q4_0's, Q4_1's, Q4_K's and Q5_K's pairs of products
 * summed in 16 bits before one vpmaddwd (q4_isum, k_isum), Q8_0's and Q6_K's by
 * vpmaddubsw, vpmaddwd and an addition a word (Q6_K's tile in 16 bits: k6_isum) */
#define X8_TARGET "avx2,f16c"
#define X8_VNNI 0
#define X8_B32_TILE 1 /* Q8_0's prefill: measured 20 % faster */
#define X8_WIDTH 256
#include "x8_kernels.h"

/* ---- K-quants ---------------------------------------------------------------------------- */

/* A super-block decoded: the 8 chunks' weights as bytes u[s] (unsigned, or magnitudes
 * with sign[s] carrying the signs); scales: Q4_K, Q5_K one per chunk (lane s of sc),
 * Q2_K, Q3_K, Q6_K one per 16-element group, in the order hsum_groups leaves the
 * groups' sums (sc: chunks 0-3, sc2: chunks 4-7); mins: Q4_K, Q5_K per chunk (mn),
 * Q2_K per group in file order (mn: groups 0-7, mn2: 8-15). */
typedef struct {
    __m256i u[8], sign[8];
    __m256i sc, sc2, mn, mn2;
    float d, dmin;
} Super;

/* groups (chunk c, half k) of 4 chunks' pair sums p[0..3]: lanes
 * [c0k0, c1k0, c2k0, c3k0, c0k1, c1k1, c2k1, c3k1] */
AVX2_INLINE __m256i hsum_groups(const __m256i *p) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

/* 16 group scales (group 2 s + k of chunk s) as the lanes hsum_groups gives */
AVX2_INLINE void group_order(const int sc[16], __m256i *first, __m256i *second) {
    *first = _mm256_setr_epi32(sc[0], sc[2], sc[4], sc[6], sc[1], sc[3], sc[5], sc[7]);
    *second = _mm256_setr_epi32(sc[8], sc[10], sc[12], sc[14], sc[9], sc[11], sc[13], sc[15]);
}

/* the 8 scales (bytes 0-7) and mins (bytes 8-15) of a Q4_K / Q5_K super-block's 12 bytes */
static inline void k4_unpack(const uint8_t *p, uint8_t out[16]) {
    uint32_t u[4];
    memcpy(u, p, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    u[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
    uint32_t mins_low = u[1] & m6;
    u[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
    u[2] = mins_low;
    u[0] &= m6;
    memcpy(out, u, 16);
}

/* kind: 0 Q2_K, 1 Q3_K, 2 Q4_K, 3 Q5_K, 4 Q6_K */
AVX2_INLINE void decode_super(const uint8_t *b, Super *S, const int kind) {
    const __m256i m2 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0x0F);
    const __m256i one = _mm256_set1_epi8(1);
    int sc[16];
    if (kind == 0) { /* Q2_K */
        S->d = h2f(b + 80);
        S->dmin = h2f(b + 82);
        for (int h = 0; h < 2; ++h) {
            __m256i q = loadu256(b + 16 + 32 * h);
            for (int t = 0; t < 4; ++t)
                S->u[4 * h + t] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * t), m2);
        }
        for (int g = 0; g < 16; ++g) sc[g] = b[g] & 15;
        __m128i raw = _mm_loadu_si128((const __m128i *)b);
        __m128i mins = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
        S->mn = _mm256_cvtepu8_epi32(mins);
        S->mn2 = _mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8));
        group_order(sc, &S->sc, &S->sc2);
    } else if (kind == 1) { /* Q3_K: q = low + 4 high - 4, signed */
        S->d = h2f(b + 108);
        S->dmin = 0.0f;
        __m256i hm = loadu256(b);
        for (int h = 0; h < 2; ++h) {
            __m256i q = loadu256(b + 32 + 32 * h);
            for (int t = 0; t < 4; ++t) {
                int s = 4 * h + t;
                __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * t), m2);
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(hm, s), one);
                __m256i v = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)),
                                            _mm256_set1_epi8(4));
                S->sign[s] = v;
                S->u[s] = _mm256_sign_epi8(v, v);
            }
        }
        for (int g = 0; g < 16; ++g) sc[g] = k3_scale(b + 96, g);
        group_order(sc, &S->sc, &S->sc2);
    } else if (kind == 2 || kind == 3) { /* Q4_K, Q5_K */
        S->d = h2f(b);
        S->dmin = h2f(b + 2);
        const uint8_t *qs = b + (kind == 2 ? 16 : 48);
        __m256i qh = kind == 3 ? loadu256(b + 16) : _mm256_setzero_si256();
        for (int g = 0; g < 4; ++g) {
            __m256i q = loadu256(qs + 32 * g);
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (kind == 3) {
                __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one);
                __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
            }
            S->u[2 * g] = lo;
            S->u[2 * g + 1] = hi;
        }
        uint8_t sm[16];
        k4_unpack(b + 4, sm);
        __m128i v = _mm_loadu_si128((const __m128i *)sm);
        S->sc = _mm256_cvtepu8_epi32(v);
        S->mn = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
    } else { /* Q6_K: q = low | high << 4, minus 32, signed */
        S->d = h2f(b + 208);
        S->dmin = 0.0f;
        for (int h = 0; h < 2; ++h) {
            __m256i qh = loadu256(b + 128 + 32 * h);
            __m256i ql0 = loadu256(b + 64 * h), ql1 = loadu256(b + 64 * h + 32);
            for (int t = 0; t < 4; ++t) {
                int s = 4 * h + t;
                __m256i ql = (t & 1) ? ql1 : ql0;
                __m256i low = _mm256_and_si256((t >> 1) ? _mm256_srli_epi16(ql, 4) : ql, m4);
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), m2);
                __m256i v = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)),
                                            _mm256_set1_epi8(32));
                S->sign[s] = v;
                S->u[s] = _mm256_sign_epi8(v, v);
            }
        }
        for (int g = 0; g < 16; ++g) sc[g] = (int8_t)b[192 + g];
        group_order(sc, &S->sc, &S->sc2);
    }
}

AVX2_INLINE void kquant_body(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,
                             float *out, const int NJ, const int kind, const int bb) {
    float acc[XT][8];
    const int8_t *xq[XT];
    const float *xd[XT];
    const int32_t *xg[XT];
    for (int k = 0; k < NJ; ++k) {
        memset(acc[k], 0, sizeof acc[k]);
        xq[k] = x->q + (j0 + k) * x->qs;
        xd[k] = x->d + (j0 + k) * nc;
        xg[k] = x->g + (j0 + k) * 2 * nc;
    }
    const int signed_q = kind == 1 || kind == 4, per_chunk = kind == 2 || kind == 3;
    const __m256i ones = _mm256_set1_epi16(1);
    Super S;
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        decode_super(w + bb * sb, &S, kind);
        for (int k = 0; k < NJ; ++k) {
            const int8_t *xb = xq[k] + 256 * sb;
            const int32_t *g = xg[k] + 16 * sb;
            __m256i p[8];
            for (int s = 0; s < 8; ++s) {
                __m256i xv = loadu256(xb + 32 * s);
                if (signed_q) xv = _mm256_sign_epi8(xv, S.sign[s]);
                p[s] = dot_us(S.u[s], xv, ones);
            }
            int isum, imin = 0;
            if (per_chunk) {
                isum = hsum_i32(_mm256_mullo_epi32(hsum_8x8(p), S.sc));
                __m256i pairs = _mm256_permute4x64_epi64(
                    _mm256_hadd_epi32(loadu256(g), loadu256(g + 8)), 0xD8); /* sum of chunk s */
                imin = hsum_i32(_mm256_mullo_epi32(pairs, S.mn));
            } else {
                __m256i a = _mm256_mullo_epi32(hsum_groups(p), S.sc);
                __m256i b2 = _mm256_mullo_epi32(hsum_groups(p + 4), S.sc2);
                isum = hsum_i32(_mm256_add_epi32(a, b2));
                if (kind == 0)
                    imin = hsum_i32(_mm256_add_epi32(_mm256_mullo_epi32(loadu256(g), S.mn),
                                                     _mm256_mullo_epi32(loadu256(g + 8), S.mn2)));
            }
            float term = (xd[k][sb] * S.d) * (float)isum;
            if (kind == 0 || per_chunk) term = term - (xd[k][sb] * S.dmin) * (float)imin;
            acc[k][sb & 7] += term;
        }
    }
    for (int k = 0; k < NJ; ++k) out[k] = sum8(acc[k]);
}

#define KQUANT(NAME, KIND, BB)                                                                 \
    AVX2 static void q8_##NAME(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,      \
                               int nj, float *out) {                                           \
        switch (nj) {                                                                          \
        case 1: kquant_body(w, nc, x, j0, out, 1, KIND, BB); break;                            \
        case 2: kquant_body(w, nc, x, j0, out, 2, KIND, BB); break;                            \
        case 3: kquant_body(w, nc, x, j0, out, 3, KIND, BB); break;                            \
        default: kquant_body(w, nc, x, j0, out, 4, KIND, BB); break;                           \
        }                                                                                      \
    }

KQUANT(Q2_K, 0, 84)
KQUANT(Q3_K, 1, 110)
KQUANT(Q4_K, 2, 144)
KQUANT(Q5_K, 3, 176)
KQUANT(Q6_K, 4, 210)

/* IQ4_XS, llama.cpp's way: two sub-blocks' nibbles from one 32-byte load, their values
 * by a byte shuffle, each sub-block's 16-bit pair sums times its scale by vpmaddwd into
 * 8 int32 lanes (|pair| <= 2 * 127 * 127, |scale| <= 32: 8 sub-blocks stay far within
 * 31 bits), one exact horizontal sum per super-block: kquant_term's isum, without the
 * 8 sums of chunks decode_super's scales would take. */
AVX2_INLINE void iq4xs_body(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,
                            float *out, const int NJ) {
    float acc[XT][8];
    const int8_t *xq[XT];
    const float *xd[XT];
    for (int k = 0; k < NJ; ++k) {
        memset(acc[k], 0, sizeof acc[k]);
        xq[k] = x->q + (j0 + k) * x->qs;
        xd[k] = x->d + (j0 + k) * nc;
    }
    const __m256i table = iq4_table(), m4 = _mm256_set1_epi8(0x0F);
    for (int64_t sb = 0; sb < nc / 8; ++sb) {
        const uint8_t *b = w + 136 * sb;
        __m256i u[8], v[8], sc[8];
        for (int h = 0; h < 4; ++h) {
            const __m256i q = loadu256(b + 8 + 32 * h);
            const __m256i lo = _mm256_and_si256(q, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            v[2 * h] = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20));
            v[2 * h + 1] = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31));
        }
        for (int s = 0; s < 8; ++s) {
            u[s] = _mm256_sign_epi8(v[s], v[s]);
            sc[s] = _mm256_set1_epi16((short)iq4xs_scale(b, s));
        }
        const float dw = h2f(b);
        for (int k = 0; k < NJ; ++k) {
            const int8_t *xb = xq[k] + 256 * sb;
            __m256i sum = _mm256_setzero_si256();
            for (int s = 0; s < 8; ++s) {
                const __m256i xv = _mm256_sign_epi8(loadu256(xb + 32 * s), v[s]);
                sum = _mm256_add_epi32(sum, dot_us(u[s], xv, sc[s]));
            }
            acc[k][sb & 7] += (xd[k][sb] * dw) * (float)hsum_i32(sum);
        }
    }
    for (int k = 0; k < NJ; ++k) out[k] = sum8(acc[k]);
}

AVX2 static void q8_IQ4_XS(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0, int nj,
                           float *out) {
    switch (nj) {
    case 1: iq4xs_body(w, nc, x, j0, out, 1); break;
    case 2: iq4xs_body(w, nc, x, j0, out, 2); break;
    case 3: iq4xs_body(w, nc, x, j0, out, 3); break;
    default: iq4xs_body(w, nc, x, j0, out, 4); break;
    }
}

/* ---- float activations ----------------------------------------------------------------- */

/* 8 weights of element i.. of a row as floats: kind 0 F32, 1 F16, 2 BF16 */
AVX2_INLINE __m256 load8(const uint8_t *row, int64_t i, const int kind) {
    if (kind == 0) return _mm256_loadu_ps((const float *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    if (kind == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2_INLINE void float_body(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,
                            float *out, const int NJ, const int kind) {
    __m256 acc[XT];
    const float *xf[XT];
    for (int k = 0; k < NJ; ++k) {
        acc[k] = _mm256_setzero_ps();
        xf[k] = x->f + (j0 + k) * x->n;
    }
    for (int64_t i = 0; i < 32 * nc; i += 8) {
        __m256 wv = load8(w, i, kind);
        for (int k = 0; k < NJ; ++k)
            acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(wv, _mm256_loadu_ps(xf[k] + i)));
    }
    float a[8];
    for (int k = 0; k < NJ; ++k) {
        _mm256_storeu_ps(a, acc[k]);
        out[k] = sum8(a);
    }
}

/* quantized weights, float activations ("f32" mode): chunks dequantized exactly */
AVX2_INLINE void dequant_body(int t, const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,
                              float *out, const int NJ) {
    __m256 acc[XT];
    const float *xf[XT];
    for (int k = 0; k < NJ; ++k) {
        acc[k] = _mm256_setzero_ps();
        xf[k] = x->f + (j0 + k) * x->n;
    }
    float v[32];
    for (int64_t c = 0; c < nc; ++c) {
        dequant_chunk(w, t, c, v);
        for (int i = 0; i < 32; i += 8) {
            __m256 wv = _mm256_loadu_ps(v + i);
            for (int k = 0; k < NJ; ++k)
                acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(wv, _mm256_loadu_ps(xf[k] + 32 * c + i)));
        }
    }
    float a[8];
    for (int k = 0; k < NJ; ++k) {
        _mm256_storeu_ps(a, acc[k]);
        out[k] = sum8(a);
    }
}

#define FLOAT_DOT(NAME, KIND)                                                                  \
    AVX2 static void f_##NAME(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0, int nj,\
                              float *out) {                                                    \
        switch (nj) {                                                                          \
        case 1: float_body(w, nc, x, j0, out, 1, KIND); break;                                 \
        case 2: float_body(w, nc, x, j0, out, 2, KIND); break;                                 \
        case 3: float_body(w, nc, x, j0, out, 3, KIND); break;                                 \
        default: float_body(w, nc, x, j0, out, 4, KIND); break;                                \
        }                                                                                      \
    }

#define DEQUANT_DOT(NAME)                                                                      \
    AVX2 static void f_##NAME(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0, int nj,\
                              float *out) {                                                    \
        switch (nj) {                                                                          \
        case 1: dequant_body(T_##NAME, w, nc, x, j0, out, 1); break;                           \
        case 2: dequant_body(T_##NAME, w, nc, x, j0, out, 2); break;                           \
        case 3: dequant_body(T_##NAME, w, nc, x, j0, out, 3); break;                           \
        default: dequant_body(T_##NAME, w, nc, x, j0, out, 4); break;                          \
        }                                                                                      \
    }

FLOAT_DOT(F32, 0)
FLOAT_DOT(F16, 1)
FLOAT_DOT(BF16, 2)
DEQUANT_DOT(Q8_0)
DEQUANT_DOT(Q4_0)
DEQUANT_DOT(Q4_1)
DEQUANT_DOT(Q5_0)
DEQUANT_DOT(Q5_1)
DEQUANT_DOT(Q2_K)
DEQUANT_DOT(Q3_K)
DEQUANT_DOT(Q4_K)
DEQUANT_DOT(Q5_K)
DEQUANT_DOT(Q6_K)
DEQUANT_DOT(IQ4_NL)
DEQUANT_DOT(IQ4_XS)

/* ---- attention's vectors ---------------------------------------------------------------- */

AVX2_INLINE __m256 cache8(const void *rows, int half, int64_t at) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)rows + at)));
    return _mm256_loadu_ps((const float *)rows + at);
}

AVX2_INLINE float cache1(const void *rows, int half, int64_t at) {
    return half ? _cvtsh_ss(((const uint16_t *)rows)[at]) : ((const float *)rows)[at];
}

/* Attention computes dot.h's order (dot_portable.c: scores_portable, mix_portable), and
 * only its independent chains side by side: the scores of NQ heads (the heads sharing a
 * KV head) against KB keys at once, each score's own 8 running sums (lane i: elements i
 * mod 8) as one key alone computes them, each key vector loaded once for the NQ heads;
 * the mix's columns NV vectors at a time for the NQ heads, each column's sum over the
 * positions in order (t = 0, 1, ..), one position's value vectors loaded once for them
 * all (docs/workers.md: one head at a time read its keys and values once per head, 2-3.7x
 * slower from memory). */

/* keys (scores) or column vectors (mix) a tile takes for each of NQ heads: 8 accumulators */
#define ATT_PER_HEAD(NQ) ((NQ) == 1 ? 8 : (NQ) == 2 ? 4 : 2)

/* lane a: sum8 (dot.h) of acc[a]'s lanes, a < 8 (hadd adds lanes 0 + 1, 2 + 3; the
 * second hadd their pairs; then the halves) */
AVX2_INLINE __m256 sums8(const __m256 *acc) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* the scores of NQ heads against keys t0 .. t0 + KB - 1 (NQ * KB <= 8, hd a multiple of 8) */
AVX2_INLINE void scores_tile(const float *q, const int NQ, const void *keys, int half, int64_t t0,
                             const int KB, int64_t hd, float scale, float *scores, int64_t ss) {
    __m256 acc[8];
    for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i += 8) {
        if (NQ == 1) { /* 8 keys: each load taken by its product */
            const __m256 qv = _mm256_loadu_ps(q + i);
            for (int b = 0; b < KB; ++b)
                acc[b] = _mm256_add_ps(acc[b], _mm256_mul_ps(qv, cache8(keys, half, (t0 + b) * hd + i)));
            continue;
        }
        __m256 kv[8];
        for (int b = 0; b < KB; ++b) kv[b] = cache8(keys, half, (t0 + b) * hd + i);
        for (int j = 0; j < NQ; ++j) {
            const __m256 qv = _mm256_loadu_ps(q + j * hd + i);
            for (int b = 0; b < KB; ++b)
                acc[j * KB + b] = _mm256_add_ps(acc[j * KB + b], _mm256_mul_ps(qv, kv[b]));
        }
    }
    float sc[8];
    _mm256_storeu_ps(sc, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)));
    for (int j = 0; j < NQ; ++j)
        for (int b = 0; b < KB; ++b) scores[j * ss + t0 + b] = sc[j * KB + b];
}

/* prefetches of the rows attention reads next: ATT_AHEAD_L2 bytes ahead into the second
 * level, ATT_AHEAD_L1 into the first (0: none; a prefetch does not fault past the
 * cache's end) */
#ifndef ATT_AHEAD_L1
#define ATT_AHEAD_L1 4096
#endif
#ifndef ATT_AHEAD_L2
#define ATT_AHEAD_L2 32768
#endif
AVX2_INLINE void att_ahead(const char *at, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) {
        if (ATT_AHEAD_L2) _mm_prefetch(at + ATT_AHEAD_L2 + off, _MM_HINT_T1);
        if (ATT_AHEAD_L1) _mm_prefetch(at + ATT_AHEAD_L1 + off, _MM_HINT_T0);
    }
}

/* NQ heads' scores of n keys: KB at a time, then one at a time */
AVX2_INLINE void scores_heads(const float *q, const int NQ, const void *keys, const int half,
                              int64_t n, int64_t hd, float scale, float *scores, int64_t ss) {
    const int KB = ATT_PER_HEAD(NQ);
    const size_t rb = (size_t)hd * (half ? 2 : 4);
    int64_t t = 0;
    for (; t + KB <= n; t += KB) {
        att_ahead((const char *)keys + (size_t)t * rb, KB * rb);
        scores_tile(q, NQ, keys, half, t, KB, hd, scale, scores, ss);
    }
    for (; t < n; ++t) scores_tile(q, NQ, keys, half, t, 1, hd, scale, scores, ss);
}

/* one score with hd not a multiple of 8: the whole vectors, then the last elements into
 * their lanes */
AVX2_INLINE float score_one(const float *q, const void *keys, int half, int64_t t, int64_t hd) {
    const int64_t full = hd / 8 * 8;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < full; i += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + i), cache8(keys, half, t * hd + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int64_t i = full; i < hd; ++i) lanes[i & 7] += q[i] * cache1(keys, half, t * hd + i);
    return sum8(lanes);
}

AVX2 static void scores_avx2(const float *q, int nq, const void *keys, int half, int64_t n,
                             int64_t hd, float scale, float *scores, int64_t ss) {
    if (hd % 8) {
        for (int j = 0; j < nq; ++j)
            for (int64_t t = 0; t < n; ++t)
                scores[j * ss + t] = score_one(q + j * hd, keys, half, t, hd) * scale;
        return;
    }
    switch (nq * 2 + !!half) { /* the loops compiled for each (no branch on half in them) */
    case 2: scores_heads(q, 1, keys, 0, n, hd, scale, scores, ss); break;
    case 3: scores_heads(q, 1, keys, 1, n, hd, scale, scores, ss); break;
    case 4: scores_heads(q, 2, keys, 0, n, hd, scale, scores, ss); break;
    case 5: scores_heads(q, 2, keys, 1, n, hd, scale, scores, ss); break;
    case 6: scores_heads(q, 3, keys, 0, n, hd, scale, scores, ss); break;
    case 7: scores_heads(q, 3, keys, 1, n, hd, scale, scores, ss); break;
    case 8: scores_heads(q, 4, keys, 0, n, hd, scale, scores, ss); break;
    default: scores_heads(q, 4, keys, 1, n, hd, scale, scores, ss); break;
    }
}

/* columns i0 .. i0 + 8 NV - 1 of NQ heads (NQ * NV <= 8) */
AVX2_INLINE void mix_cols(float *out, const int NQ, const float *p, int64_t ps, const void *values,
                          int half, int64_t n, int64_t hd, int64_t i0, const int NV) {
    __m256 acc[8];
    for (int j = 0; j < NQ; ++j)
        for (int v = 0; v < NV; ++v) acc[j * NV + v] = _mm256_loadu_ps(out + j * hd + i0 + 8 * v);
    const size_t esize = half ? 2 : 4;
    for (int64_t t = 0; t < n; ++t) {
        /* this pass's columns of a row ahead */
        att_ahead((const char *)values + (size_t)(t * hd + i0) * esize, (size_t)(8 * NV) * esize);
        if (NQ == 1) { /* 8 vectors: each load taken by its product */
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int v = 0; v < NV; ++v)
                acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(pt, cache8(values, half, t * hd + i0 + 8 * v)));
            continue;
        }
        __m256 vv[8];
        for (int v = 0; v < NV; ++v) vv[v] = cache8(values, half, t * hd + i0 + 8 * v);
        for (int j = 0; j < NQ; ++j) {
            const __m256 pt = _mm256_set1_ps(p[j * ps + t]);
            for (int v = 0; v < NV; ++v)
                acc[j * NV + v] = _mm256_add_ps(acc[j * NV + v], _mm256_mul_ps(pt, vv[v]));
        }
    }
    for (int j = 0; j < NQ; ++j)
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + j * hd + i0 + 8 * v, acc[j * NV + v]);
}

/* NQ heads' whole vectors of columns: NV (8 / NQ) vectors a pass, then one; every pass
 * over MIX_T positions before the next MIX_T (their value rows stay in the first-level
 * cache for the passes, read from memory in order) */
#define MIX_T 32
AVX2_INLINE void mix_heads(float *out, const int NQ, const float *p, int64_t ps, const void *values,
                           const int half, int64_t n, int64_t hd) {
    const int NV = ATT_PER_HEAD(NQ);
    const int64_t full = hd / 8 * 8;
    const size_t esize = half ? 2 : 4;
    for (int64_t t0 = 0; t0 < n; t0 += MIX_T) {
        const int64_t nt = n - t0 < MIX_T ? n - t0 : MIX_T;
        const void *rows = (const char *)values + (size_t)(t0 * hd) * esize;
        int64_t i0 = 0;
        for (; i0 + 8 * NV <= full; i0 += 8 * NV) mix_cols(out, NQ, p + t0, ps, rows, half, nt, hd, i0, NV);
        for (; i0 < full; i0 += 8) mix_cols(out, NQ, p + t0, ps, rows, half, nt, hd, i0, 1);
    }
}

AVX2 static void mix_avx2(float *out, int nq, const float *p, int64_t ps, const void *values,
                          int half, int64_t n, int64_t hd) {
    switch (nq * 2 + !!half) { /* the loops compiled for each (no branch on half in them) */
    case 2: mix_heads(out, 1, p, ps, values, 0, n, hd); break;
    case 3: mix_heads(out, 1, p, ps, values, 1, n, hd); break;
    case 4: mix_heads(out, 2, p, ps, values, 0, n, hd); break;
    case 5: mix_heads(out, 2, p, ps, values, 1, n, hd); break;
    case 6: mix_heads(out, 3, p, ps, values, 0, n, hd); break;
    case 7: mix_heads(out, 3, p, ps, values, 1, n, hd); break;
    case 8: mix_heads(out, 4, p, ps, values, 0, n, hd); break;
    default: mix_heads(out, 4, p, ps, values, 1, n, hd); break;
    }
    const int64_t full = hd / 8 * 8;
    for (int j = 0; j < nq && full < hd; ++j) { /* the last hd mod 8 columns: their chains side by side */
        float tail[8], *o = out + j * hd;
        for (int64_t i = full; i < hd; ++i) tail[i - full] = o[i];
        for (int64_t t = 0; t < n; ++t)
            for (int64_t i = full; i < hd; ++i)
                tail[i - full] = tail[i - full] + p[j * ps + t] * cache1(values, half, t * hd + i);
        for (int64_t i = full; i < hd; ++i) o[i] = tail[i - full];
    }
}

const Isa ISA_AVX2 = {
    "avx2",
    {NULL, NULL, NULL, q8_rows_Q8_0, q8_rows_Q4_0, q8_rows_Q4_1, q8_rows_Q5_0, q8_rows_Q5_1,
     [T_IQ4_NL] = q8_rows_IQ4_NL},
    {NULL, NULL, NULL, q8_Q8_0, q8_Q4_0, q8_Q4_1, q8_Q5_0, q8_Q5_1, q8_Q2_K, q8_Q3_K, q8_Q4_K,
     q8_Q5_K, q8_Q6_K, q8_IQ4_NL, q8_IQ4_XS},
    {f_F32, f_F16, f_BF16, f_Q8_0, f_Q4_0, f_Q4_1, f_Q5_0, f_Q5_1, f_Q2_K, f_Q3_K, f_Q4_K, f_Q5_K,
     f_Q6_K, f_IQ4_NL, f_IQ4_XS},
    scores_avx2,
    mix_avx2,
    {[T_Q8_0] = x8_q8_0, [T_Q4_0] = x8_q4_0, [T_Q4_1] = x8_q4_1, [T_Q5_0] = x8_q5_0,
     [T_Q5_1] = x8_q5_1, [T_Q2_K] = x8_q2_k, [T_Q3_K] = x8_q3_k, [T_Q4_K] = x8_q4_k,
     [T_Q5_K] = x8_q5_k, [T_Q6_K] = x8_q6_k, [T_IQ4_NL] = x8_iq4_nl, [T_IQ4_XS] = x8_iq4_xs},
    {NULL}, /* no 512-bit vectors */
    .quantize = quantize_row_avx2,
    .exp32 = exp32_avx2,
    .tanh32 = tanh32_avx2,
};

#endif
