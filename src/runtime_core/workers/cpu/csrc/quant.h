/* quant.h: the GGUF weight types the CPU kernels read, their block geometry, and the
 * scalar helpers every instruction set shares (half-precision conversion, the
 * K-quants' packed scales).
 *
 * A row of a matrix is read in chunks of 32 elements: one block of the 32-element
 * types, one eighth of a K-quant super-block, 32 values of a float type. The byte
 * layouts are those of runtime_cupy/cuda/kernels/quant.cuh (the comment at its top); the
 * NumPy twins in tests/support/twins.py decode the same bytes.
 */
#ifndef GPP_QUANT_H
#define GPP_QUANT_H

#include <stdint.h>
#include <string.h>

#define CHUNK 32

enum qtype {
    T_F32, T_F16, T_BF16,
    T_Q8_0, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1,
    T_Q2_K, T_Q3_K, T_Q4_K, T_Q5_K, T_Q6_K,
    T_IQ4_NL, T_IQ4_XS,
    T_COUNT
};

/* names in code order (the Python side passes names) */
extern const char *const QTYPE_NAMES[T_COUNT];
/* elements and bytes per block */
extern const int QTYPE_BLOCK_ELEMS[T_COUNT];
extern const int QTYPE_BLOCK_BYTES[T_COUNT];

static inline int qtype_is_float(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }

/* Bytes of the chunks c .. of a row: chunk c of a K-quant lies in super-block c / 8. */
static inline const uint8_t *block_of(const uint8_t *row, int t, int64_t c) {
    int be = QTYPE_BLOCK_ELEMS[t], bb = QTYPE_BLOCK_BYTES[t];
    if (be == 1) return row + c * CHUNK * bb;
    return row + (c * CHUNK / be) * bb;
}

/* IEEE half to float, exact. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    float f;
    if (exp == 0) {
        f = (float)mant * 5.9604644775390625e-08f; /* mant * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline float load_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* float to IEEE half, rounding to nearest even (as NumPy's astype(float16)):
 * out of range gives infinity, NaN stays NaN, made quiet (as F16C's vcvtps2ph; NumPy keeps
 * a signaling NaN's payload). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or NaN */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
    if (ax >= 0x477ff000u) /* rounds to 65520 or more: infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* below the smallest normal half: a subnormal (or zero) */
        if (ax < 0x33000000u) return (uint16_t)sign; /* below half the smallest subnormal */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14 .. 24 */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q += 1u;
        return (uint16_t)(sign | q);
    }
    uint32_t q = (ax >> 13) - (112u << 10), rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q += 1u;
    return (uint16_t)(sign | q);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 6-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K super-block. */
static inline void k4_scale_min(const uint8_t *sc, int s, int *scale, int *min) {
    if (s < 4) {
        *scale = sc[s] & 63;
        *min = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
        *min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

/* The signed 6-bit scale of group j (0..15) of a Q3_K super-block. */
static inline int k3_scale(const uint8_t *sc, int j) {
    int low = (sc[j & 7] >> (4 * (j >> 3))) & 15;
    int high = (sc[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

/* IQ4_NL's and IQ4_XS's 16 values (llama.cpp's kvalues_iq4nl): a nibble indexes it */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* The signed 6-bit scale of sub-block s (0..7) of an IQ4_XS super-block b: the low 4
 * bits in scales_l (bytes 4-7, low nibble first), the high 2 in scales_h (bytes 2-3),
 * less 32. */
static inline int iq4xs_scale(const uint8_t *b, int s) {
    int low = (b[4 + (s >> 1)] >> (4 * (s & 1))) & 15;
    int high = ((b[2] | (b[3] << 8)) >> (2 * s)) & 3;
    return (low | (high << 4)) - 32;
}

#endif
