/* ieee32.h: exp and tanh of float32 values from IEEE additions, multiplications,
 * divisions and rint alone, the same bits on every machine: runtime_core/ieee_math.py's
 * exp32 and tanh32, bit for bit.
 *
 * The C library's expf is not: glibc picks an implementation by the processor (its FMA
 * variant on hosts with FMA, another without), and the two differ on some inputs (2 of
 * the 2.24 billion float32 values from -110 to 90 with glibc 2.36, e.g. 0x1.04845ep+5);
 * another C library rounds others otherwise. The SwiGLU's and attention's exponentials
 * took it, so two hosts of one chain could compute other bits.
 *
 * exp32(x), x a float32 (exactly a double): NaN for NaN, 0 below -104 (exp(-104) is
 * below half the least float32), infinity above 89 (exp(89) is above the largest);
 * between, in double: k = rint(x / ln2) (x times 1 / ln2, ties to even), r = x - k ln2_hi
 * - k ln2_lo (ln2 in two parts, ln2_hi of 32 significant bits: k ln2_hi is exact), p =
 * exp(r)'s Taylor series to r^13 in Horner's order (one product, then one sum, per
 * coefficient: no fused multiply-add), times 2^k (exact: 2^k and the product are normal
 * doubles for |k| <= 150), rounded once to float32 (nearest, ties to even). ieee_math.py
 * derives the constants from decimal; these are those doubles. Every set's exp32 gave
 * ieee_math.exp32_numpy's bits on all 2^32 float32 when written (a scan, not kept);
 * tests/runtime_core/workers/cpu/test_cpu_exp32.py checks every 4099th and the limits.
 *
 * tanh32(x), x a float32: the correctly rounded float32 of tanh(x) on every input (the C
 * library's tanhf is not: glibc 2.36's rounds 118.7 million float32 otherwise, 2.8 %, 45
 * % of those uniform on -1 .. 1, 730 thousand of them by two units, e.g. 0x1.f72258p-7;
 * another C library or version rounds others otherwise; the logits' and attention's soft
 * caps and the GELU table took it). NaN for NaN; otherwise, in
 * double, a = min(|x|, TANH32_HIGH) (tanh rounds to 1 from 9.0109), t = 2a, k and r of t as
 * exp32's (k <= 29), q = the Taylor series of expm1(r) / r to r^12 in Horner's order
 * (EXP32_TAYLOR's first 13 coefficients), m = q r (expm1(r), no cancellation near 0),
 * m = m 2^k + (2^k - 1) (expm1(t); 2^k - 1 exact), y = m / (m + 2), rounded once to
 * float32, the sign of x restored (-0 stays -0). The double is within 3.1 units of its
 * last place (the most seen on 200000 random inputs, against decimal);
 * benchmarks/tanh32_scan.py checks every float32: each set's bits are ieee_math's, and
 * where the double is within 256 units of a float32 rounding midpoint (130 inputs) the
 * float32 is decimal's correctly rounded one.
 *
 * Each instruction set's exp32 and tanh32 (dot.h: Isa.exp32, Isa.tanh32) compute these
 * operations lane by lane: the same bits. */
#ifndef GPP_IEEE32_H
#define GPP_IEEE32_H

#include <stdint.h>

#define EXP32_LOW -104.0f
#define EXP32_HIGH 89.0f
#define EXP32_INV_LN2 0x1.71547652b82fep+0
#define EXP32_LN2_HI 0x1.62e42feep-1
#define EXP32_LN2_LO 0x1.a39ef35793c76p-33
#define EXP32_TERMS 14
/* 1 / n!, n = 13 .. 0 */
extern const double EXP32_TAYLOR[EXP32_TERMS];

/* y[i] = exp32(x[i]), i < n; y may be x */
void exp32_portable(const float *x, float *y, int64_t n);
#if defined(__GNUC__) && defined(__x86_64__)
void exp32_avx2(const float *x, float *y, int64_t n);
void exp32_avx512(const float *x, float *y, int64_t n);
#endif

#define TANH32_HIGH 10.0f
#define TANH32_TERMS 13 /* EXP32_TAYLOR[0 .. 12]: 1 / n!, n = 13 .. 1 */

/* y[i] = tanh32(x[i]), i < n; y may be x */
void tanh32_portable(const float *x, float *y, int64_t n);
#if defined(__GNUC__) && defined(__x86_64__)
void tanh32_avx2(const float *x, float *y, int64_t n);
void tanh32_avx512(const float *x, float *y, int64_t n);
#endif

#endif
