/* repack.c: the x8 layouts (repack.h). Each type moves a stored block of row i into
 * its group block (pack_block) and back (unpack_block); the two are inverse bit moves. */
#include "repack.h"

#include <string.h>

#include "quant.h"

_Static_assert(X8 * 4 == 32, "a word of every row fills 32 bytes");

int x8_supported(int t) {
    return t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q2_K ||
           t == T_Q3_K || t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || t == T_IQ4_NL || t == T_IQ4_XS;
}

int x8_block_bytes(int t) {
    switch (t) {
    case T_Q2_K: return 672;
    case T_Q3_K: return 912;
    case T_Q4_K: return 1184;
    case T_Q5_K: return 1440;
    case T_IQ4_XS: return 1104;
    default: return X8 * QTYPE_BLOCK_BYTES[t]; /* the others move bytes only */
    }
}

int64_t x8_group_bytes(int t, int64_t n_in) { return n_in / QTYPE_BLOCK_ELEMS[t] * x8_block_bytes(t); }

int64_t x8_bytes(int t, int64_t n_out, int64_t n_in) {
    return (n_out + X8 - 1) / X8 * x8_group_bytes(t, n_in);
}

/* byte b (0..3) of word w of row i, from a word area at `at` */
static inline int word_at(int at, int w, int i, int b) { return at + 32 * w + 4 * i + b; }

/* ---- the 32-element types: halves side by side, then the payload's words ---------------- */

static int legacy_halves(int t) { return t == T_Q4_1 || t == T_Q5_1 ? 2 : 1; }

/* Q5_0's and Q5_1's fifth bits (qh, the payload's first word): stored, bit e the fifth
 * bit of element e; in the group, element 4w + b's (w < 4) at bit w of byte b and element
 * 16 + 4w + b's at bit 4 + w, so that a word's fifth bits are a shift away (Q5_K's
 * way). pack: stored -> group; else group -> stored. */
static uint32_t q5_fifth_bits(uint32_t v, int pack) {
    uint32_t out = 0;
    for (int e = 0; e < 32; ++e) {
        const int at = 8 * (e & 3) + 4 * (e >> 4) + ((e >> 2) & 3);
        if (pack) out |= ((v >> e) & 1u) << at;
        else out |= ((v >> at) & 1u) << e;
    }
    return out;
}

static void legacy_pack(int t, const uint8_t *b, int i, uint8_t *G) {
    const int nh = legacy_halves(t), pb = QTYPE_BLOCK_BYTES[t] - 2 * nh;
    for (int f = 0; f < nh; ++f) memcpy(G + 16 * f + 2 * i, b + 2 * f, 2);
    for (int l = 0; l < pb; l += 4) memcpy(G + word_at(16 * nh, l / 4, i, 0), b + 2 * nh + l, 4);
    if (t == T_Q5_0 || t == T_Q5_1) {
        uint32_t qh;
        memcpy(&qh, b + 2 * nh, 4);
        qh = q5_fifth_bits(qh, 1);
        memcpy(G + word_at(16 * nh, 0, i, 0), &qh, 4);
    }
}

static void legacy_unpack(int t, const uint8_t *G, int i, uint8_t *b) {
    const int nh = legacy_halves(t), pb = QTYPE_BLOCK_BYTES[t] - 2 * nh;
    for (int f = 0; f < nh; ++f) memcpy(b + 2 * f, G + 16 * f + 2 * i, 2);
    for (int l = 0; l < pb; l += 4) memcpy(b + 2 * nh + l, G + word_at(16 * nh, l / 4, i, 0), 4);
    if (t == T_Q5_0 || t == T_Q5_1) {
        uint32_t qh;
        memcpy(&qh, b + 2 * nh, 4);
        qh = q5_fifth_bits(qh, 0);
        memcpy(b + 2 * nh, &qh, 4);
    }
}

/* ---- Q4_K, Q5_K -------------------------------------------------------------------------- */

#define K4_SCALES 32
#define K4_MINS 96
#define K4_HEADER 160
#define K5_HIGH 160
#define K5_NIBBLES 416

/* the stored 12 bytes of 8 (scale, min) pairs of 6 bits: k4_scale_min inverted */
static void k4_pack_scales(const int sc[8], const int mn[8], uint8_t out[12]) {
    for (int j = 0; j < 4; ++j) {
        out[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        out[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        out[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
}

static void k4_pack(int t, const uint8_t *b, int i, uint8_t *G) {
    memcpy(G + 2 * i, b, 2);
    memcpy(G + 16 + 2 * i, b + 2, 2);
    for (int s = 0; s < 8; ++s) {
        int sc, mn;
        k4_scale_min(b + 4, s, &sc, &mn);
        G[K4_SCALES + 8 * s + i] = (uint8_t)sc;
        G[K4_MINS + 16 * (s >> 1) + 2 * i + (s & 1)] = (uint8_t)mn;
    }
    const int qs = t == T_Q4_K ? 16 : 48, at = t == T_Q4_K ? K4_HEADER : K5_NIBBLES;
    for (int p = 0; p < 4; ++p)
        for (int w = 0; w < 8; ++w)
            memcpy(G + at + 256 * p + word_at(0, w, i, 0), b + qs + 32 * p + 4 * w, 4);
    if (t == T_Q5_K) /* bit s of stored qh[l]: the fifth bit of element l of sub-block s */
        for (int s = 0; s < 8; ++s)
            for (int l = 0; l < 32; ++l) {
                uint8_t *h = G + K5_HIGH + 32 * s + 4 * i + (l & 3);
                *h = (uint8_t)(*h | (((b[16 + l] >> s) & 1) << (l >> 2)));
            }
}

static void k4_unpack(int t, const uint8_t *G, int i, uint8_t *b) {
    memcpy(b, G + 2 * i, 2);
    memcpy(b + 2, G + 16 + 2 * i, 2);
    int sc[8], mn[8];
    for (int s = 0; s < 8; ++s) {
        sc[s] = G[K4_SCALES + 8 * s + i];
        mn[s] = G[K4_MINS + 16 * (s >> 1) + 2 * i + (s & 1)];
    }
    k4_pack_scales(sc, mn, b + 4);
    const int qs = t == T_Q4_K ? 16 : 48, at = t == T_Q4_K ? K4_HEADER : K5_NIBBLES;
    for (int p = 0; p < 4; ++p)
        for (int w = 0; w < 8; ++w)
            memcpy(b + qs + 32 * p + 4 * w, G + at + 256 * p + word_at(0, w, i, 0), 4);
    if (t == T_Q5_K) {
        memset(b + 16, 0, 32);
        for (int s = 0; s < 8; ++s)
            for (int l = 0; l < 32; ++l) {
                int bit = (G[K5_HIGH + 32 * s + 4 * i + (l & 3)] >> (l >> 2)) & 1;
                b[16 + l] = (uint8_t)(b[16 + l] | (bit << s));
            }
    }
}

/* ---- IQ4_XS ----------------------------------------------------------------------------------- */

#define XS_SCALES 16
#define XS_NIBBLES 80

static void iq4xs_pack(const uint8_t *b, int i, uint8_t *G) {
    memcpy(G + 2 * i, b, 2);
    for (int s = 0; s < 8; ++s) {
        G[XS_SCALES + 8 * s + i] = (uint8_t)(int8_t)iq4xs_scale(b, s);
        for (int w = 0; w < 4; ++w) memcpy(G + word_at(XS_NIBBLES + 128 * s, w, i, 0), b + 8 + 16 * s + 4 * w, 4);
    }
}

static void iq4xs_unpack(const uint8_t *G, int i, uint8_t *b) {
    memcpy(b, G + 2 * i, 2);
    memset(b + 2, 0, 6);
    for (int s = 0; s < 8; ++s) {
        const int ls = (int8_t)G[XS_SCALES + 8 * s + i] + 32; /* 0 .. 63 */
        b[4 + (s >> 1)] = (uint8_t)(b[4 + (s >> 1)] | ((ls & 15) << (4 * (s & 1))));
        const int h = (b[2] | (b[3] << 8)) | ((ls >> 4) << (2 * s));
        b[2] = (uint8_t)(h & 255);
        b[3] = (uint8_t)(h >> 8);
        for (int w = 0; w < 4; ++w) memcpy(b + 8 + 16 * s + 4 * w, G + word_at(XS_NIBBLES + 128 * s, w, i, 0), 4);
    }
}

/* ---- Q6_K ------------------------------------------------------------------------------------- */

#define K6_SCALES 16
#define K6_LOW 144
#define K6_HIGH 1168

/* where element l of sub-block s keeps its low 4 bits (byte, shift) and high 2 bits,
 * stored (chunk_ints' reading) and in the group */
static void k6_stored(int s, int l, int *lo_byte, int *lo_shift, int *hi_byte, int *hi_shift) {
    int h = s >> 2, tt = s & 3;
    *lo_byte = 64 * h + 32 * (tt & 1) + l;
    *lo_shift = 4 * (tt >> 1);
    *hi_byte = 128 + 32 * h + l;
    *hi_shift = 2 * tt;
}

static void k6_group(int s, int l, int i, int *lo_byte, int *lo_shift, int *hi_byte,
                     int *hi_shift) {
    int p = s >> 1, e = s & 1, w = l >> 2, b = l & 3;
    *lo_byte = K6_LOW + 256 * p + word_at(0, w, i, b);
    *lo_shift = 4 * e;
    *hi_byte = K6_HIGH + 128 * p + word_at(0, w >> 1, i, b);
    *hi_shift = 2 * (2 * (w & 1) + e);
}

static void k6_pack(const uint8_t *b, int i, uint8_t *G) {
    memcpy(G + 2 * i, b + 208, 2);
    for (int j = 0; j < 16; ++j) G[K6_SCALES + 8 * j + i] = b[192 + j];
    for (int s = 0; s < 8; ++s)
        for (int l = 0; l < 32; ++l) {
            int sl, ss, sh, shs, gl, gs, gh, ghs;
            k6_stored(s, l, &sl, &ss, &sh, &shs);
            k6_group(s, l, i, &gl, &gs, &gh, &ghs);
            G[gl] = (uint8_t)(G[gl] | (((b[sl] >> ss) & 15) << gs));
            G[gh] = (uint8_t)(G[gh] | (((b[sh] >> shs) & 3) << ghs));
        }
}

static void k6_unpack(const uint8_t *G, int i, uint8_t *b) {
    memset(b, 0, 192);
    for (int s = 0; s < 8; ++s)
        for (int l = 0; l < 32; ++l) {
            int sl, ss, sh, shs, gl, gs, gh, ghs;
            k6_stored(s, l, &sl, &ss, &sh, &shs);
            k6_group(s, l, i, &gl, &gs, &gh, &ghs);
            b[sl] = (uint8_t)(b[sl] | (((G[gl] >> gs) & 15) << ss));
            b[sh] = (uint8_t)(b[sh] | (((G[gh] >> ghs) & 3) << shs));
        }
    for (int j = 0; j < 16; ++j) b[192 + j] = G[K6_SCALES + 8 * j + i];
    memcpy(b + 208, G + 2 * i, 2);
}

/* ---- Q3_K, Q2_K ------------------------------------------------------------------------------- */

/* The 2-bit fields of a super-block (Q3_K's low bits, Q2_K's quants): element l of
 * sub-block s, stored, at bits 2 (s & 3) of qs[32 (s >> 2) + l] (the offset into qs it
 * returns in *stored); in the group, at the same bits of byte l & 3 of row i's lane of
 * word l / 4 of the area at + 256 (s >> 2) (the offset it returns). */
static int k_low2_at(int s, int l, int at, int i, int *stored) {
    *stored = 32 * (s >> 2) + l;
    return at + 256 * (s >> 2) + word_at(0, l >> 2, i, l & 3);
}

static void k_low2_pack(const uint8_t *qs, int at, int i, uint8_t *G) {
    for (int s = 0, o; s < 8; ++s)
        for (int l = 0; l < 32; ++l) {
            const int g = k_low2_at(s, l, at, i, &o), shift = 2 * (s & 3);
            G[g] = (uint8_t)(G[g] | (((qs[o] >> shift) & 3) << shift));
        }
}

static void k_low2_unpack(const uint8_t *G, int at, int i, uint8_t *qs) {
    memset(qs, 0, 64);
    for (int s = 0, o; s < 8; ++s)
        for (int l = 0; l < 32; ++l) {
            const int g = k_low2_at(s, l, at, i, &o), shift = 2 * (s & 3);
            qs[o] = (uint8_t)(qs[o] | (((G[g] >> shift) & 3) << shift));
        }
}

#define K3_SCALES 16
#define K3_LOW 144
#define K3_HIGH 656

/* Element l of sub-block s: stored, its low 2 bits at bits 2 (s & 3) of qs[32 (s >> 2) +
 * l] (b + 32) and its high bit at bit s of hmask[l] (b); in the group, the low 2 bits at
 * bits 2 (s & 3) of word l / 4 of the area K3_LOW + 256 (s >> 2), the high bit at bit s
 * of word l / 4 of K3_HIGH. The scales as Q6_K's (int8, group j of row i at K3_SCALES +
 * 8 j + i), the factor as every type's (row i's half at 2 i). */
static void k3_pack(const uint8_t *b, int i, uint8_t *G) {
    memcpy(G + 2 * i, b + 108, 2);
    for (int j = 0; j < 16; ++j) G[K3_SCALES + 8 * j + i] = (uint8_t)(int8_t)k3_scale(b + 96, j);
    k_low2_pack(b + 32, K3_LOW, i, G);
    for (int s = 0; s < 8; ++s)
        for (int l = 0; l < 32; ++l) {
            uint8_t *gh = G + K3_HIGH + word_at(0, l >> 2, i, l & 3);
            *gh = (uint8_t)(*gh | (((b[l] >> s) & 1) << s));
        }
}

static void k3_unpack(const uint8_t *G, int i, uint8_t *b) {
    memset(b, 0, 108);
    for (int j = 0; j < 16; ++j) { /* k3_scale inverted */
        const int v = (int8_t)G[K3_SCALES + 8 * j + i] + 32; /* 0 .. 63 */
        b[96 + (j & 7)] = (uint8_t)(b[96 + (j & 7)] | ((v & 15) << (4 * (j >> 3))));
        b[104 + (j & 3)] = (uint8_t)(b[104 + (j & 3)] | ((v >> 4) << (2 * (j >> 2))));
    }
    k_low2_unpack(G, K3_LOW, i, b + 32);
    for (int s = 0; s < 8; ++s)
        for (int l = 0; l < 32; ++l)
            b[l] = (uint8_t)(b[l] | (((G[K3_HIGH + word_at(0, l >> 2, i, l & 3)] >> s) & 1) << s));
    memcpy(b + 108, G + 2 * i, 2);
}

#define K2_SCALES 32
#define K2_LOW 160

/* Element l of sub-block s: stored, its 2 bits at bits 2 (s & 3) of qs[32 (s >> 2) + l]
 * (b + 16), in the group as Q3_K's low bits (K2_LOW + 256 (s >> 2), word l / 4); the
 * scale and min byte of 16-element group j as stored (scale low nibble, min high) at
 * K2_SCALES + 8 j + i; d at 2 i, dmin at 16 + 2 i. */
static void k2_pack(const uint8_t *b, int i, uint8_t *G) {
    memcpy(G + 2 * i, b + 80, 2);
    memcpy(G + 16 + 2 * i, b + 82, 2);
    for (int j = 0; j < 16; ++j) G[K2_SCALES + 8 * j + i] = b[j];
    k_low2_pack(b + 16, K2_LOW, i, G);
}

static void k2_unpack(const uint8_t *G, int i, uint8_t *b) {
    memset(b, 0, 84);
    memcpy(b + 80, G + 2 * i, 2);
    memcpy(b + 82, G + 16 + 2 * i, 2);
    for (int j = 0; j < 16; ++j) b[j] = G[K2_SCALES + 8 * j + i];
    k_low2_unpack(G, K2_LOW, i, b + 16);
}

/* ---- whole matrices ----------------------------------------------------------------------- */

void x8_pack(int t, const uint8_t *rows, int64_t n_out, int64_t row_bytes, int64_t g0, int64_t g1,
             uint8_t *out) {
    const int bb = QTYPE_BLOCK_BYTES[t], gb = x8_block_bytes(t);
    const int64_t nb = row_bytes / bb;
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t c = 0; c < nb; ++c) {
            uint8_t *G = out + (g * nb + c) * gb;
            memset(G, 0, (size_t)gb); /* a padding row: zero factors, zero quants */
            for (int i = 0; i < X8 && g * X8 + i < n_out; ++i) {
                const uint8_t *b = rows + (g * X8 + i) * row_bytes + c * bb;
                if (t == T_Q4_K || t == T_Q5_K) k4_pack(t, b, i, G);
                else if (t == T_Q6_K) k6_pack(b, i, G);
                else if (t == T_Q3_K) k3_pack(b, i, G);
                else if (t == T_Q2_K) k2_pack(b, i, G);
                else if (t == T_IQ4_XS) iq4xs_pack(b, i, G);
                else legacy_pack(t, b, i, G);
            }
        }
}

void x8_unpack_row(int t, const uint8_t *group, int i, int64_t n_in, uint8_t *row) {
    const int bb = QTYPE_BLOCK_BYTES[t], gb = x8_block_bytes(t);
    const int64_t nb = n_in / QTYPE_BLOCK_ELEMS[t];
    for (int64_t c = 0; c < nb; ++c) {
        const uint8_t *G = group + c * gb;
        uint8_t *b = row + c * bb;
        if (t == T_Q4_K || t == T_Q5_K) k4_unpack(t, G, i, b);
        else if (t == T_Q6_K) k6_unpack(G, i, b);
        else if (t == T_Q3_K) k3_unpack(G, i, b);
        else if (t == T_Q2_K) k2_unpack(G, i, b);
        else if (t == T_IQ4_XS) iq4xs_unpack(G, i, b);
        else legacy_unpack(t, G, i, b);
    }
}
