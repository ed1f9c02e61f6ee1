/* dot_portable.c: the activation formats and the products in plain C, for any host
 * (dot.h has the arithmetic every instruction set computes). */
#include <math.h>

#include "dot.h"
#include "ieee32.h"
#include "repack.h"

const char *const QTYPE_NAMES[T_COUNT] = {
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
};
const int QTYPE_BLOCK_ELEMS[T_COUNT] = {1,  1,   1,   32,  32,  32,  32, 32,
                                        256, 256, 256, 256, 256, 32, 256};
const int QTYPE_BLOCK_BYTES[T_COUNT] = {4,  2,   2,   34,  18,  20,  22, 24,
                                        84, 110, 144, 176, 210, 18, 136};
const char *const FORMAT_NAMES[FMT_COUNT] = {"q8_0", "q8_1", "q8_K", "f32"};
const int QTYPE_FORMAT[T_COUNT] = {
    FMT_F32, FMT_F32, FMT_F32, FMT_Q8_0, FMT_Q8_0, FMT_Q8_1, FMT_Q8_0, FMT_Q8_1,
    FMT_Q8_K, FMT_Q8_K, FMT_Q8_K, FMT_Q8_K, FMT_Q8_K, FMT_Q8_0, FMT_Q8_K,
};

/* ---- decoding one chunk to integers --------------------------------------------------- */

/* The integer of each element of chunk c (the twins' Decoded.q): unsigned nibbles for
 * Q4_*, 5-bit for Q5_*, signed for Q8_0, Q3_K and Q6_K, the values their nibbles index
 * for IQ4_NL and IQ4_XS. */
static void chunk_ints(const uint8_t *row, int t, int64_t c, int q[32]) {
    const uint8_t *b = block_of(row, t, c);
    int s = (int)(c & 7), h = s >> 2, tt = s & 3;
    switch (t) {
    case T_Q8_0:
        for (int l = 0; l < 32; ++l) q[l] = (int8_t)b[2 + l];
        break;
    case T_Q4_0:
    case T_Q4_1: {
        const uint8_t *qs = b + (t == T_Q4_0 ? 2 : 4);
        for (int l = 0; l < 16; ++l) {
            q[l] = qs[l] & 15;
            q[l + 16] = qs[l] >> 4;
        }
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        int at = t == T_Q5_0 ? 2 : 4;
        uint32_t qh = load_u32(b + at);
        const uint8_t *qs = b + at + 4;
        for (int l = 0; l < 16; ++l) {
            q[l] = (qs[l] & 15) | (int)(((qh >> l) & 1u) << 4);
            q[l + 16] = (qs[l] >> 4) | (int)(((qh >> (l + 16)) & 1u) << 4);
        }
        break;
    }
    case T_Q2_K:
        for (int l = 0; l < 32; ++l) q[l] = (b[16 + 32 * h + l] >> (2 * tt)) & 3;
        break;
    case T_Q3_K:
        for (int l = 0; l < 32; ++l) {
            int low = (b[32 + 32 * h + l] >> (2 * tt)) & 3;
            int high = (b[l] >> s) & 1;
            q[l] = low - 4 * (1 - high);
        }
        break;
    case T_Q4_K:
        for (int l = 0; l < 32; ++l) q[l] = (b[16 + 32 * (s >> 1) + l] >> (4 * (s & 1))) & 15;
        break;
    case T_Q5_K:
        for (int l = 0; l < 32; ++l)
            q[l] = ((b[48 + 32 * (s >> 1) + l] >> (4 * (s & 1))) & 15) | (((b[16 + l] >> s) & 1) << 4);
        break;
    case T_Q6_K: {
        int j = tt >> 1, k = tt & 1;
        for (int l = 0; l < 32; ++l) {
            int low = (b[64 * h + 32 * k + l] >> (4 * j)) & 15;
            int high = (b[128 + 32 * h + l] >> (2 * tt)) & 3;
            q[l] = (low | (high << 4)) - 32;
        }
        break;
    }
    case T_IQ4_NL:
    case T_IQ4_XS: {
        const uint8_t *qs = t == T_IQ4_NL ? b + 2 : b + 8 + 16 * s;
        for (int l = 0; l < 16; ++l) {
            q[l] = IQ4_VALUES[qs[l] & 15];
            q[l + 16] = IQ4_VALUES[qs[l] >> 4];
        }
        break;
    }
    default:
        for (int l = 0; l < 32; ++l) q[l] = 0;
    }
}

/* ---- dequantization ------------------------------------------------------------------ */

void dequant_chunk(const uint8_t *row, int t, int64_t c, float *v) {
    if (t == T_F32) {
        memcpy(v, row + 128 * c, 128);
        return;
    }
    if (t == T_F16 || t == T_BF16) {
        const uint8_t *p = row + 64 * c;
        for (int l = 0; l < 32; ++l) {
            uint16_t h;
            memcpy(&h, p + 2 * l, 2);
            v[l] = t == T_F16 ? f16_to_f32(h) : bf16_to_f32(h);
        }
        return;
    }
    int q[32];
    chunk_ints(row, t, c, q);
    const uint8_t *b = block_of(row, t, c);
    int s = (int)(c & 7);
    switch (t) {
    case T_Q8_0:
    case T_IQ4_NL: {
        float d = load_f16(b);
        for (int l = 0; l < 32; ++l) v[l] = (float)q[l] * d;
        break;
    }
    case T_IQ4_XS: {
        float dl = load_f16(b) * (float)iq4xs_scale(b, s);
        for (int l = 0; l < 32; ++l) v[l] = dl * (float)q[l];
        break;
    }
    case T_Q4_0:
    case T_Q5_0: {
        float d = load_f16(b), off = t == T_Q4_0 ? 8.0f : 16.0f;
        for (int l = 0; l < 32; ++l) v[l] = d * ((float)q[l] - off);
        break;
    }
    case T_Q4_1:
    case T_Q5_1: {
        float d = load_f16(b), m = load_f16(b + 2);
        for (int l = 0; l < 32; ++l) v[l] = d * (float)q[l] + m;
        break;
    }
    case T_Q2_K: {
        float d = load_f16(b + 80), dmin = load_f16(b + 82);
        for (int k = 0; k < 2; ++k) {
            int sc = b[2 * s + k] & 15, mn = b[2 * s + k] >> 4;
            float dl = d * (float)sc, ml = dmin * (float)mn;
            for (int l = 16 * k; l < 16 * k + 16; ++l) v[l] = dl * (float)q[l] - ml;
        }
        break;
    }
    case T_Q3_K:
    case T_Q6_K: {
        float d = load_f16(t == T_Q3_K ? b + 108 : b + 208);
        for (int k = 0; k < 2; ++k) {
            int sc = t == T_Q3_K ? k3_scale(b + 96, 2 * s + k) : (int8_t)b[192 + 2 * s + k];
            float dl = d * (float)sc;
            for (int l = 16 * k; l < 16 * k + 16; ++l) v[l] = dl * (float)q[l];
        }
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        float d = load_f16(b), dmin = load_f16(b + 2);
        int sc, mn;
        k4_scale_min(b + 4, s, &sc, &mn);
        float dl = d * (float)sc, ml = dmin * (float)mn;
        for (int l = 0; l < 32; ++l) v[l] = dl * (float)q[l] - ml;
        break;
    }
    default:
        for (int l = 0; l < 32; ++l) v[l] = NAN;
    }
}

/* ---- 8-bit activations ------------------------------------------------------------------ */

/* C's roundf for |v| < 2^31: to the nearest integer, halves away from zero */
static inline int32_t round_away(float v) {
    /* toward zero; past int32 (NaN, an infinity: a block whose scale's inverse
     * overflows, its largest magnitude below about 4e-37) x86's conversion gives
     * INT32_MIN, as the vector sets' does, here without C's undefined behaviour; the
     * step up or down wraps as theirs does */
    uint32_t i = (v > -2147483904.0f && v < 2147483648.0f) ? (uint32_t)(int32_t)v : 0x80000000u;
    float frac = v - (float)(int32_t)i; /* exact */
    if (frac >= 0.5f) i += 1u;
    else if (frac <= -0.5f) i -= 1u;
    return (int32_t)i;
}

/* llama.cpp's nearest_int: to the nearest integer, halves to even (|v| < 2^22) */
static inline int round_even(float v) {
    float t = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}

static inline float half_value(float v) { return f16_to_f32(f32_to_f16(v)); }

static inline int is_finite(float v) { return fabsf(v) <= 3.402823466e38f; }

float q8_half(float v) { return half_value(v); }

void quantize_row(int fmt, const float *x, int64_t n, int8_t *q, float *d, float *s, int32_t *g) {
    if (fmt == FMT_Q8_K) {
        for (int64_t b = 0; b < n / 256; ++b) {
            const float *v = x + 256 * b;
            int8_t *qb = q + 256 * b;
            float amax = 0.0f, max = 0.0f;
            int bad = 0;
            for (int l = 0; l < 256; ++l) {
                float a = fabsf(v[l]);
                if (!is_finite(v[l])) bad = 1;
                else if (a > amax) {
                    amax = a;
                    max = v[l];
                }
            }
            if (bad || amax == 0.0f) {
                memset(qb, 0, 256);
                d[b] = bad ? NAN : 0.0f;
                for (int k = 0; k < 16; ++k) g[16 * b + k] = 0;
                continue;
            }
            float iscale = -127.0f / max;
            for (int k = 0; k < 16; ++k) {
                int sum = 0;
                for (int l = 16 * k; l < 16 * k + 16; ++l) {
                    int qi = round_even(iscale * v[l]);
                    qi = qi < 127 ? qi : 127;
                    qb[l] = (int8_t)qi;
                    sum += qi;
                }
                g[16 * b + k] = sum;
            }
            d[b] = 1.0f / iscale;
        }
        return;
    }
    for (int64_t c = 0; c < n / 32; ++c) {
        const float *v = x + 32 * c;
        int8_t *qc = q + 32 * c;
        float amax = 0.0f;
        int bad = 0;
        for (int l = 0; l < 32; ++l) {
            if (!is_finite(v[l])) bad = 1;
            else if (fabsf(v[l]) > amax) amax = fabsf(v[l]);
        }
        if (bad) {
            memset(qc, 0, 32);
            d[c] = NAN;
            if (fmt == FMT_Q8_1) s[c] = NAN;
            g[c] = 0;
            continue;
        }
        float dc = amax / 127.0f;
        float id = dc != 0.0f ? 1.0f / dc : 0.0f;
        uint32_t sum = 0; /* wraps, as the vector sets' sums (only past int32 above) */
        for (int l = 0; l < 32; ++l) {
            int32_t qi = round_away(v[l] * id);
            qc[l] = (int8_t)(uint8_t)(uint32_t)qi;
            sum += (uint32_t)qi;
        }
        d[c] = half_value(dc);
        if (fmt == FMT_Q8_1) s[c] = half_value((float)(int32_t)sum * dc);
        g[c] = (int32_t)sum;
    }
}

/* ---- 8-bit products -------------------------------------------------------------------- */

static int dot32(const int q[32], const int8_t *x) {
    int sum = 0;
    for (int l = 0; l < 32; ++l) sum += q[l] * x[l];
    return sum;
}

/* The float term of 32-element block c (legacy types) against one activation row. */
static float legacy_term(const uint8_t *row, int t, int64_t c, const int8_t *xq, float xd,
                         float xs, int32_t xg) {
    int q[32];
    chunk_ints(row, t, c, q);
    const uint8_t *b = block_of(row, t, c);
    int sumi = dot32(q, xq);
    if (t == T_Q4_0) sumi -= 8 * xg;
    else if (t == T_Q5_0) sumi -= 16 * xg;
    float fac = load_f16(b) * xd;
    if (t == T_Q4_1 || t == T_Q5_1) return fac * (float)sumi + load_f16(b + 2) * xs;
    return fac * (float)sumi;
}

/* The float term of super-block sb (K-quants) against one activation row. */
static float kquant_term(const uint8_t *row, int t, int64_t sb, const int8_t *xq, float xd,
                         const int32_t *xg) {
    const uint8_t *b = row + sb * QTYPE_BLOCK_BYTES[t];
    int isum = 0, imin = 0;
    float dw, dmin = 0.0f;
    for (int s = 0; s < 8; ++s) {
        int q[32];
        chunk_ints(row, t, 8 * sb + s, q);
        const int8_t *x = xq + 32 * s;
        int part[2] = {0, 0};
        for (int l = 0; l < 32; ++l) part[l >> 4] += q[l] * x[l];
        switch (t) {
        case T_Q2_K:
            for (int k = 0; k < 2; ++k) {
                isum += (b[2 * s + k] & 15) * part[k];
                imin += (b[2 * s + k] >> 4) * xg[2 * s + k];
            }
            break;
        case T_Q3_K:
            for (int k = 0; k < 2; ++k) isum += k3_scale(b + 96, 2 * s + k) * part[k];
            break;
        case T_Q6_K:
            for (int k = 0; k < 2; ++k) isum += (int8_t)b[192 + 2 * s + k] * part[k];
            break;
        case T_IQ4_XS:
            isum += iq4xs_scale(b, s) * (part[0] + part[1]);
            break;
        default: { /* Q4_K, Q5_K */
            int sc, mn;
            k4_scale_min(b + 4, s, &sc, &mn);
            isum += sc * (part[0] + part[1]);
            imin += mn * (xg[2 * s] + xg[2 * s + 1]);
        }
        }
    }
    switch (t) {
    case T_Q2_K: dw = load_f16(b + 80); dmin = load_f16(b + 82); break;
    case T_Q3_K: dw = load_f16(b + 108); break;
    case T_Q6_K: dw = load_f16(b + 208); break;
    case T_IQ4_XS: dw = load_f16(b); break;
    default: dw = load_f16(b); dmin = load_f16(b + 2);
    }
    float term = (xd * dw) * (float)isum;
    if (t == T_Q2_K || t == T_Q4_K || t == T_Q5_K) term = term - (xd * dmin) * (float)imin;
    return term;
}

static void dot_q8_portable(int t, const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,
                            int nj, float *out) {
    int kq = QTYPE_FORMAT[t] == FMT_Q8_K;
    for (int k = 0; k < nj; ++k) {
        int64_t j = j0 + k;
        const int8_t *xq = x->q + j * x->qs;
        float acc[8] = {0};
        if (kq) {
            const float *xd = x->d + j * nc;
            const int32_t *xg = x->g + j * 2 * nc;
            for (int64_t sb = 0; sb < nc / 8; ++sb)
                acc[sb & 7] += kquant_term(w, t, sb, xq + 256 * sb, xd[sb], xg + 16 * sb);
        } else {
            const float *xd = x->d + j * nc, *xs = x->s ? x->s + j * nc : NULL;
            const int32_t *xg = x->g + j * 2 * nc;
            for (int64_t c = 0; c < nc; ++c)
                acc[c & 7] += legacy_term(w, t, c, xq + 32 * c, xd[c], xs ? xs[c] : 0.0f, xg[c]);
        }
        out[k] = sum8(acc);
    }
}

/* ---- x8 groups (repack.h) ------------------------------------------------------------- */

/* Q4_0 and Q4_1, 8 rows of a group: row i's block c read where the group keeps it (its
 * halves among the block's 8 headers, its nibbles in lane i of the words), then
 * legacy_term's arithmetic and dot_q8_portable's running sums, so each row's bits are
 * the stored row's. (The other types' groups are unpacked row by row, ops.c.) */
static void x8_legacy(int t, const uint8_t *grp, int64_t nc, const XRows *x, int64_t j0, int nj,
                      float (*out)[8]) {
    const int gb = x8_block_bytes(t), words = t == T_Q4_1 ? 32 : 16;
    for (int k = 0; k < nj; ++k) {
        const int64_t j = j0 + k;
        const int8_t *xq = x->q + j * x->qs;
        const float *xd = x->d + j * nc, *xs = t == T_Q4_1 ? x->s + j * nc : NULL;
        const int32_t *xg = x->g + j * 2 * nc;
        for (int i = 0; i < X8; ++i) {
            float acc[8] = {0};
            for (int64_t c = 0; c < nc; ++c) {
                const uint8_t *b = grp + c * gb;
                const int8_t *xc = xq + 32 * c;
                int sumi = 0;
                for (int l = 0; l < 16; ++l) {
                    const int v = b[words + 32 * (l >> 2) + 4 * i + (l & 3)];
                    sumi += (v & 15) * xc[l] + (v >> 4) * xc[l + 16];
                }
                if (t == T_Q4_0) sumi -= 8 * xg[c];
                float fac = load_f16(b + 2 * i) * xd[c];
                if (t == T_Q4_1) acc[c & 7] += fac * (float)sumi + load_f16(b + 16 + 2 * i) * xs[c];
                else acc[c & 7] += fac * (float)sumi;
            }
            out[k][i] = sum8(acc);
        }
    }
}

static void x8_Q4_0(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                    int nj, float (*out)[8]) {
    (void)gs;
    x8_legacy(T_Q4_0, grp, nc, x, j0, nj, out);
}

static void x8_Q4_1(const uint8_t *grp, int64_t gs, int64_t nc, const XRows *x, int64_t j0,
                    int nj, float (*out)[8]) {
    (void)gs;
    x8_legacy(T_Q4_1, grp, nc, x, j0, nj, out);
}

/* ---- float products -------------------------------------------------------------------- */

static void dot_f_portable(int t, const uint8_t *w, int64_t nc, const XRows *x, int64_t j0,
                           int nj, float *out) {
    float acc[XT][8];
    memset(acc, 0, sizeof acc);
    float v[32];
    for (int64_t c = 0; c < nc; ++c) {
        dequant_chunk(w, t, c, v);
        for (int k = 0; k < nj; ++k) {
            const float *xf = x->f + (j0 + k) * x->n + 32 * c;
            for (int l = 0; l < 32; ++l) {
                float p = v[l] * xf[l];
                acc[k][l & 7] += p;
            }
        }
    }
    for (int k = 0; k < nj; ++k) out[k] = sum8(acc[k]);
}

#define Q8_DOT(T)                                                                              \
    static void q8_##T(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0, int nj,      \
                       float *out) {                                                           \
        dot_q8_portable(T_##T, w, nc, x, j0, nj, out);                                         \
    }
#define F_DOT(T)                                                                               \
    static void f_##T(const uint8_t *w, int64_t nc, const XRows *x, int64_t j0, int nj,       \
                      float *out) {                                                            \
        dot_f_portable(T_##T, w, nc, x, j0, nj, out);                                          \
    }
#define BOTH_DOTS(T) Q8_DOT(T) F_DOT(T)

F_DOT(F32)
F_DOT(F16)
F_DOT(BF16)
BOTH_DOTS(Q8_0)
BOTH_DOTS(Q4_0)
BOTH_DOTS(Q4_1)
BOTH_DOTS(Q5_0)
BOTH_DOTS(Q5_1)
BOTH_DOTS(Q2_K)
BOTH_DOTS(Q3_K)
BOTH_DOTS(Q4_K)
BOTH_DOTS(Q5_K)
BOTH_DOTS(Q6_K)
BOTH_DOTS(IQ4_NL)
BOTH_DOTS(IQ4_XS)

/* ---- attention's vectors ---------------------------------------------------------------- */

static inline float cache_value(const void *rows, int half, int64_t at) {
    return half ? f16_to_f32(((const uint16_t *)rows)[at]) : ((const float *)rows)[at];
}

static void scores_portable(const float *q, int nq, const void *keys, int half, int64_t n,
                            int64_t hd, float scale, float *scores, int64_t ss) {
    for (int j = 0; j < nq; ++j)
        for (int64_t t = 0; t < n; ++t) {
            float acc[8] = {0};
            for (int64_t i = 0; i < hd; ++i) {
                float p = q[j * hd + i] * cache_value(keys, half, t * hd + i);
                acc[i & 7] += p;
            }
            scores[j * ss + t] = sum8(acc) * scale;
        }
}

static void mix_portable(float *out, int nq, const float *p, int64_t ps, const void *values,
                         int half, int64_t n, int64_t hd) {
    for (int j = 0; j < nq; ++j)
        for (int64_t t = 0; t < n; ++t)
            for (int64_t i = 0; i < hd; ++i)
                out[j * hd + i] = out[j * hd + i] + p[j * ps + t] * cache_value(values, half, t * hd + i);
}

const Isa ISA_PORTABLE = {
    "portable",
    {NULL},
    {NULL, NULL, NULL, q8_Q8_0, q8_Q4_0, q8_Q4_1, q8_Q5_0, q8_Q5_1, q8_Q2_K, q8_Q3_K, q8_Q4_K,
     q8_Q5_K, q8_Q6_K, q8_IQ4_NL, q8_IQ4_XS},
    {f_F32, f_F16, f_BF16, f_Q8_0, f_Q4_0, f_Q4_1, f_Q5_0, f_Q5_1, f_Q2_K, f_Q3_K, f_Q4_K, f_Q5_K,
     f_Q6_K, f_IQ4_NL, f_IQ4_XS},
    scores_portable,
    mix_portable,
    {[T_Q4_0] = x8_Q4_0, [T_Q4_1] = x8_Q4_1},
    {NULL},
    .quantize = quantize_row,
    .exp32 = exp32_portable,
    .tanh32 = tanh32_portable,
};
