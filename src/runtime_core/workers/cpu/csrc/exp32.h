/* exp32.h: exp of float32 values from IEEE additions, multiplications and rint alone, the
 * same bits on every machine: runtime_core/ieee_math.py's exp32, bit for bit.
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
 * Each instruction set's exp32 (dot.h: Isa.exp32) computes these operations lane by lane:
 * the same bits. */
#ifndef GPP_EXP32_H
#define GPP_EXP32_H

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

#endif
