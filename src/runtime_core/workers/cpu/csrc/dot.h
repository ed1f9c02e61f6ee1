/* dot.h: one weight row times up to XT activation rows, per weight type and per
 * instruction set; the 8-bit activation formats.
 *
 * Activations are quantized as llama.cpp's CPU path quantizes them for the weight
 * type (ggml's vec_dot_type), from float32 rows of n values:
 *   q8_0 (for Q8_0, Q4_0, Q5_0, IQ4_NL): per block of 32, d = max|x| / 127, q = roundf(x / d)
 *        computed as x * (1 / d), d kept as a half; g = sum(q) per block.
 *   q8_1 (for Q4_1, Q5_1): q8_0, and s = d * sum(q) kept as a half.
 *   q8_K (for the K-quants and IQ4_XS): per block of 256, m the first value of the largest
 *        magnitude, q = min(127, round-half-even(x * (-127 / m))), d = 1 / (-127 / m)
 *        (float); g = sum(q) per 16.
 * d and s are stored as floats (a half's value where the format keeps a half). A block
 * holding a NaN or an infinity gets d = NaN and q = 0.
 *
 * Products. Each block of a weight row (32 elements; 256 for the K-quants and IQ4_XS) gives an
 * exact integer sum of weight integers times activation integers (with the type's
 * offsets, scales and mins applied as integers) and one float term, llama.cpp's:
 *   Q8_0, Q4_0, Q5_0, IQ4_NL  (dw * d) * sumi      Q4_1, Q5_1  (dw * d) * sumi + mw * s
 *   Q2_K, Q4_K, Q5_K  (d * dw) * isum - (d * dmin) * imin
 *   Q3_K, Q6_K, IQ4_XS  (d * dw) * isum
 * (IQ4_NL's and IQ4_XS's weight integers are the values their nibbles index, IQ4_XS's
 * isum the sum of each 32-element sub-block's integer sum times its signed scale.)
 * Terms are added into 8 running sums (term i into sum i mod 8), which are added
 * pairwise at the end: ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)). Float
 * products (float weights, or the "f32" mode's exactly dequantized weights, times
 * float32 activations) add w * x (rounded, no fused multiply-add) the same way, per
 * element. Every instruction set computes these same roundings in this same order, so
 * results are identical on every host, whatever its vector width or thread count.
 */
#ifndef GPP_DOT_H
#define GPP_DOT_H

#include <stdint.h>

#include "quant.h"

#define XT 4 /* activation rows per call */

enum act_format { FMT_Q8_0, FMT_Q8_1, FMT_Q8_K, FMT_F32, FMT_COUNT };

extern const char *const FORMAT_NAMES[FMT_COUNT];
/* the activation format of each weight type (FMT_F32 for the float types) */
extern const int QTYPE_FORMAT[T_COUNT];

/* Row j of 8-bit activations: q + j qs, d + j n / 32, s + j n / 32, g + j n / 16; each
 * format uses the start of the row's d, s, g (n / 256 values of d, n / 16 of g for
 * q8_K; n / 32 of each for q8_0 and q8_1). qs >= n: rows of q may be padded (a row
 * stride a whole number of 4 KiB made prefill's tiles, which read a block of every row
 * in turn, 20 % slower: most likely reads waiting on stores 4 KiB away). */
typedef struct {
    const int8_t *q;
    const float *d;
    const float *s;
    const int32_t *g;
    const float *f; /* (rows, n) float activations */
    int64_t n;
    int64_t qs;
} XRows;

/* out[k] = row w (n_chunks chunks of 32 of its type) . activation row j0 + k, k < nj <= XT */
typedef void (*dot_fn)(const uint8_t *w, int64_t n_chunks, const XRows *x, int64_t j0, int nj,
                       float *out);

/* out[i] = row i of w (rows of row_bytes, i < nw <= WT) . activation row j: the same
 * bits as nw calls of the type's dot_fn (a decode step's products, several weight rows
 * sharing the activation's loads); NULL where an instruction set has none */
#define WT 4
typedef void (*rows_fn)(const uint8_t *w, int64_t row_bytes, int nw, int64_t n_chunks,
                        const XRows *x, int64_t j, float *out);

/* out[k][i] = row i of an x8 group (repack.h: 8 rows of n_chunks chunks) . activation
 * row j0 + k, k < nj <= X8_TILE: the same bits as the type's dot_fn on each stored row;
 * NULL where an instruction set has none (the rows are then unpacked and each taken
 * by dot_fn). A group's blocks are decoded once for the nj rows. */
#define X8_XT 4 /* measured: 8 spills registers (Q4_K, Q8_0 prefill 30 % slower) */
/* an x8_fn / x16_fn takes up to X8_TILE rows (a prefill's tile): X8_XT at a time, or,
 * where a type's decoding costs (Q5_K, Q6_K), each block decoded once for all nj rows */
#define X8_TILE 32
typedef void (*x8_fn)(const uint8_t *group, int64_t gstride, int64_t n_chunks, const XRows *x,
                      int64_t j0, int nj, float (*out)[8]);
/* out[k][i] = row i of two consecutive x8 groups (the first at group, the second
 * gstride bytes on; rows 8 .. 15 the second's) . activation row j0 + k: the x8_fn's
 * bits on each group, 16 rows in one vector (NULL where a set has none) */
typedef void (*x16_fn)(const uint8_t *group, int64_t gstride, int64_t n_chunks, const XRows *x,
                       int64_t j0, int nj, float (*out)[16]);

/* query heads an Isa's scores and mix take at once */
#define ATT_HEADS 4

typedef struct {
    const char *name;
    rows_fn q8_rows[T_COUNT];
    dot_fn q8[T_COUNT]; /* NULL for the float types */
    dot_fn f[T_COUNT];  /* float activations */
    /* attention over n positions of a KV cache (rows of hd floats, or halves when
     * half) for nq <= ATT_HEADS query heads side by side (the heads sharing a KV head:
     * each key and value row read once for them all), head j's vectors hd floats after
     * head j - 1's: scores[j * ss + t] = (q_j . keys[t], added as the float products
     * are) * scale; out_j[i] = out_j[i] + p[j * ps + t] * values[t][i], t = 0, 1, .. in
     * order. Each head's bits are those of that head alone. */
    void (*scores)(const float *q, int nq, const void *keys, int half, int64_t n, int64_t hd,
                   float scale, float *scores, int64_t ss);
    void (*mix)(float *out, int nq, const float *p, int64_t ps, const void *values, int half,
                int64_t n, int64_t hd);
    x8_fn q8_x8[T_COUNT];   /* 8-bit activations times x8 groups */
    x16_fn q8_x16[T_COUNT]; /* ... times two x8 groups at once */
    /* the products of exactly r + 1 activation rows (r < X8_XT: a decode step's, of
     * one run or a few) where another kernel than q8_x16 or q8_x8 measured faster
     * there (NULL: those); any set's kernel of the type, all giving the same bits */
    x8_fn q8_x8_rows[T_COUNT][X8_XT];
    /* rows of float activations in an 8-bit format (above): quantize_row's bits */
    void (*quantize)(int fmt, const float *x, int64_t n, int8_t *q, float *d, float *s,
                     int32_t *g);
    /* y[i] = exp32(x[i]), tanh32(x[i]) (ieee32.h: the same bits on every set) */
    void (*exp32)(const float *x, float *y, int64_t n);
    void (*tanh32)(const float *x, float *y, int64_t n);
} Isa;

/* The instruction sets, portable first; the module offers those the processor runs
 * (module.c: isa_named) and uses the best unless a caller names another. */
extern const Isa ISA_PORTABLE;
#if defined(__GNUC__) && defined(__x86_64__)
#define GPP_HAVE_AVX2 1
extern const Isa ISA_AVX2;
#define GPP_HAVE_AVX512 1
const Isa *isa_avx512(void); /* AVX2's, with VNNI x8 products */
const Isa *isa_avx512_zen4(void); /* AVX-512's, a decode step's kernels AMD Zen 4's */
const Isa *isa_avx512_intel(void); /* AVX-512's, every product on its own kernels */
const Isa *isa_avx512bw(void); /* AVX2's, with 512-bit x16 products, without VNNI */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define GPP_HAVE_AVXVNNI 1 /* a compiler that knows AVX-VNNI's target */
const Isa *isa_avxvnni(void); /* AVX2's, with AVX-VNNI's 256-bit x8 products */
#endif
#endif

/* shared by every instruction set */
void dequant_chunk(const uint8_t *row, int t, int64_t c, float *v);
void quantize_row(int fmt, const float *x, int64_t n, int8_t *q, float *d, float *s, int32_t *g);
/* v rounded to a half (nearest even) and back: a block's scale as the formats keep it */
float q8_half(float v);
#ifdef GPP_HAVE_AVX2
void quantize_row_avx2(int fmt, const float *x, int64_t n, int8_t *q, float *d, float *s,
                       int32_t *g);
#endif

static inline float sum8(const float a[8]) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#endif
