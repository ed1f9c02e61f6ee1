/* ieee32.c: exp32 and tanh32 (ieee32.h) for each instruction set: portable C, AVX2 on 4
 * doubles a vector, AVX-512 on 8; every lane the same operations in the same order (no
 * fused multiply-add: setup.py compiles with -ffp-contract=off). */
#include "ieee32.h"

#include <math.h>
#include <string.h>

const double EXP32_TAYLOR[EXP32_TERMS] = {
    0x1.6124613a86d09p-33, 0x1.1eed8eff8d898p-29, 0x1.ae64567f544e4p-26, 0x1.27e4fb7789f5cp-22,
    0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16, 0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10,
    0x1.1111111111111p-7,  0x1.5555555555555p-5,  0x1.5555555555555p-3,  0x1.0p-1,
    0x1.0p+0,              0x1.0p+0,
};

/* The operations of exp32 (ieee32.h) on CH values within the limits side by side, one
 * value per lane of each vector type: their 13 Horner steps are chains of dependent
 * products and sums, so several chains in turn keep the multipliers busy (one chain a
 * value ran at about a third of the rate). */
#define EXP32_CORE(CH, VD, cvt_in, mul, add, sub, set1, rint, pow2, cvt_out, x, y)            \
    do {                                                                                   \
        VD xd_[CH], k_[CH], r_[CH], p_[CH];                                                \
        for (int c_ = 0; c_ < CH; ++c_) {                                                  \
            xd_[c_] = cvt_in(x[c_]);                                                       \
            k_[c_] = rint(mul(xd_[c_], set1(EXP32_INV_LN2)));                              \
            r_[c_] = sub(xd_[c_], mul(k_[c_], set1(EXP32_LN2_HI)));                        \
            r_[c_] = sub(r_[c_], mul(k_[c_], set1(EXP32_LN2_LO)));                         \
            p_[c_] = set1(EXP32_TAYLOR[0]);                                                \
        }                                                                                  \
        for (int i_ = 1; i_ < EXP32_TERMS; ++i_)                                           \
            for (int c_ = 0; c_ < CH; ++c_)                                                \
                p_[c_] = add(mul(p_[c_], r_[c_]), set1(EXP32_TAYLOR[i_]));                 \
        for (int c_ = 0; c_ < CH; ++c_) y[c_] = cvt_out(mul(p_[c_], pow2(k_[c_])));        \
    } while (0)

/* tanh32's operations (ieee32.h) on CH values a = min(|x|, TANH32_HIGH) side by side, as
 * EXP32_CORE's */
#define TANH32_CORE(CH, VD, cvt_in, mul, add, sub, div, set1, rint, pow2, cvt_out, a, y)     \
    do {                                                                                   \
        VD t_[CH], k_[CH], r_[CH], m_[CH];                                                 \
        for (int c_ = 0; c_ < CH; ++c_) {                                                  \
            t_[c_] = mul(set1(2.0), cvt_in(a[c_]));                                        \
            k_[c_] = rint(mul(t_[c_], set1(EXP32_INV_LN2)));                               \
            r_[c_] = sub(t_[c_], mul(k_[c_], set1(EXP32_LN2_HI)));                         \
            r_[c_] = sub(r_[c_], mul(k_[c_], set1(EXP32_LN2_LO)));                         \
            m_[c_] = set1(EXP32_TAYLOR[0]);                                                \
        }                                                                                  \
        for (int i_ = 1; i_ < TANH32_TERMS; ++i_)                                          \
            for (int c_ = 0; c_ < CH; ++c_)                                                \
                m_[c_] = add(mul(m_[c_], r_[c_]), set1(EXP32_TAYLOR[i_]));                 \
        for (int c_ = 0; c_ < CH; ++c_) {                                                  \
            const VD s_ = pow2(k_[c_]); /* 2^k */                                          \
            m_[c_] = mul(m_[c_], r_[c_]);                                                  \
            m_[c_] = add(mul(m_[c_], s_), sub(s_, set1(1.0)));                             \
            y[c_] = cvt_out(div(m_[c_], add(m_[c_], set1(2.0))));                          \
        }                                                                                  \
    } while (0)

/* ---- portable: 8 values side by side ---------------------------------------------------- */

/* exp32 beyond the limits (NaN, 0, infinity), or e within them */
static inline float exp32_limits(float v, float e) {
    if (isnan(v)) return NAN;
    if (v < EXP32_LOW) return 0.0f;
    if (v > EXP32_HIGH) return INFINITY;
    return e;
}

/* EXP32_CORE's operations on 8 values within the limits, in plain C that compilers
 * vectorize with the baseline's instructions: rint(a) as (a + 1.5 2^52) - 1.5 2^52
 * (the sum rounded to an integer, ties to even, exactly rint for |a| < 2^51), whose low
 * bits are the integer, so that 2^k needs no conversion from double */
static void exp8_portable(const float in[8], float out[8]) {
    const double shift = 0x1.8p52;
    double t[8], k[8], r[8], p[8];
    for (int c = 0; c < 8; ++c) {
        const double xd = in[c];
        t[c] = xd * EXP32_INV_LN2 + shift;
        k[c] = t[c] - shift;
        r[c] = xd - k[c] * EXP32_LN2_HI;
        r[c] = r[c] - k[c] * EXP32_LN2_LO;
        p[c] = EXP32_TAYLOR[0];
    }
    for (int i = 1; i < EXP32_TERMS; ++i)
        for (int c = 0; c < 8; ++c) p[c] = p[c] * r[c] + EXP32_TAYLOR[i];
    for (int c = 0; c < 8; ++c) {
        uint64_t bits;
        memcpy(&bits, &t[c], sizeof bits);
        bits = (bits + 1023) << 52; /* 2^k: k + 1023 in the exponent's 11 bits */
        double scale;
        memcpy(&scale, &bits, sizeof scale);
        out[c] = (float)(p[c] * scale);
    }
}

void exp32_portable(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        const int m = n - i < 8 ? (int)(n - i) : 8;
        float in[8] = {0}, out[8];
        for (int c = 0; c < m; ++c) {
            const float v = x[i + c];
            in[c] = v < EXP32_LOW ? EXP32_LOW : v > EXP32_HIGH ? EXP32_HIGH : v == v ? v : 0.0f;
        }
        exp8_portable(in, out);
        for (int c = 0; c < m; ++c) y[i + c] = exp32_limits(x[i + c], out[c]);
    }
}

static float tanh32_one(float x) {
    if (isnan(x)) return NAN;
    const double t = 2.0 * (double)fminf(fabsf(x), TANH32_HIGH);
    const double k = nearbyint(t * EXP32_INV_LN2);
    double r = t - k * EXP32_LN2_HI;
    r = r - k * EXP32_LN2_LO;
    double m = EXP32_TAYLOR[0];
    for (int i = 1; i < TANH32_TERMS; ++i) m = m * r + EXP32_TAYLOR[i];
    m = m * r;
    const uint64_t bits = (uint64_t)((int64_t)k + 1023) << 52; /* 2^k, k <= 29 */
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    m = m * scale + (scale - 1.0);
    return copysignf((float)(m / (m + 2.0)), x);
}

/* one value at a time: about 8.3 ns a value on an AMD Zen 5 core where AVX2's 4 chains
 * take 1.6 and AVX-512's 0.85 (glibc's tanhf, in the soft cap, took 14.6) */
void tanh32_portable(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = tanh32_one(x[i]);
}

#if defined(__GNUC__) && defined(__x86_64__)

#include <immintrin.h>

#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))

AVX2_INLINE __m256d a_rint(__m256d v) {
    return _mm256_round_pd(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
AVX2_INLINE __m256d a_pow2(__m256d k) {
    return _mm256_castsi256_pd(_mm256_slli_epi64(
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k)), _mm256_set1_epi64x(1023)), 52));
}

/* exp32 of 16 values: 4 chains of 4 doubles within the limits, beyond them 0, infinity
 * or NaN by masks */
AVX2_INLINE void exp16_avx2(const float *x, float *y) {
    const __m256 low = _mm256_set1_ps(EXP32_LOW), high = _mm256_set1_ps(EXP32_HIGH);
    __m256 v[2], c[2];
    __m128 in[4], out[4];
    for (int h = 0; h < 2; ++h) {
        v[h] = _mm256_loadu_ps(x + 8 * h);
        c[h] = _mm256_max_ps(_mm256_min_ps(v[h], high), low); /* NaN -> high */
        in[2 * h] = _mm256_castps256_ps128(c[h]);
        in[2 * h + 1] = _mm256_extractf128_ps(c[h], 1);
    }
    EXP32_CORE(4, __m256d, _mm256_cvtps_pd, _mm256_mul_pd, _mm256_add_pd, _mm256_sub_pd,
               _mm256_set1_pd, a_rint, a_pow2, _mm256_cvtpd_ps, in, out);
    for (int h = 0; h < 2; ++h) {
        __m256 e = _mm256_set_m128(out[2 * h + 1], out[2 * h]);
        e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(v[h], low, _CMP_LT_OQ));
        e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(v[h], high, _CMP_GT_OQ));
        _mm256_storeu_ps(y + 8 * h, _mm256_blendv_ps(e, _mm256_set1_ps(NAN), _mm256_cmp_ps(v[h], v[h], _CMP_UNORD_Q)));
    }
}

/* about 1.2 ns a value on an AMD Zen 5 core */
__attribute__((target("avx2"))) void exp32_avx2(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) exp16_avx2(x + i, y + i);
    if (i < n) {
        float t[16] = {0};
        memcpy(t, x + i, sizeof(float) * (size_t)(n - i));
        exp16_avx2(t, t);
        memcpy(y + i, t, sizeof(float) * (size_t)(n - i));
    }
}

/* tanh32 of 16 values: 4 chains of 4 doubles on |x| clamped, x's sign restored, NaN for
 * NaN */
AVX2_INLINE void tanh16_avx2(const float *x, float *y) {
    const __m256 sign = _mm256_set1_ps(-0.0f), high = _mm256_set1_ps(TANH32_HIGH);
    __m256 v[2];
    __m128 in[4], out[4];
    for (int h = 0; h < 2; ++h) {
        v[h] = _mm256_loadu_ps(x + 8 * h);
        const __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign, v[h]), high); /* NaN -> high */
        in[2 * h] = _mm256_castps256_ps128(a);
        in[2 * h + 1] = _mm256_extractf128_ps(a, 1);
    }
    TANH32_CORE(4, __m256d, _mm256_cvtps_pd, _mm256_mul_pd, _mm256_add_pd, _mm256_sub_pd,
                _mm256_div_pd, _mm256_set1_pd, a_rint, a_pow2, _mm256_cvtpd_ps, in, out);
    for (int h = 0; h < 2; ++h) {
        __m256 e = _mm256_or_ps(_mm256_set_m128(out[2 * h + 1], out[2 * h]), _mm256_and_ps(sign, v[h]));
        e = _mm256_blendv_ps(e, _mm256_set1_ps(NAN), _mm256_cmp_ps(v[h], v[h], _CMP_UNORD_Q));
        _mm256_storeu_ps(y + 8 * h, e);
    }
}

__attribute__((target("avx2"))) void tanh32_avx2(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) tanh16_avx2(x + i, y + i);
    if (i < n) {
        float t[16] = {0};
        memcpy(t, x + i, sizeof(float) * (size_t)(n - i));
        tanh16_avx2(t, t);
        memcpy(y + i, t, sizeof(float) * (size_t)(n - i));
    }
}

#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))

AVX512_INLINE __m512d z_rint(__m512d v) {
    return _mm512_roundscale_pd(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
AVX512_INLINE __m512d z_pow2(__m512d k) {
    return _mm512_castsi512_pd(_mm512_slli_epi64(
        _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(k)), _mm512_set1_epi64(1023)), 52));
}

/* exp32 of 32 values (n of them loaded and stored, n <= 32): 4 chains of 8 doubles */
AVX512_INLINE void exp32x_avx512(const float *x, float *y, int n) {
    const __m512 low = _mm512_set1_ps(EXP32_LOW), high = _mm512_set1_ps(EXP32_HIGH);
    __m512 v[2];
    __m256 in[4], out[4];
    __mmask16 m[2];
    for (int h = 0; h < 2; ++h) {
        const int left = n - 16 * h;
        m[h] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        v[h] = _mm512_maskz_loadu_ps(m[h], x + 16 * h);
        const __m512 c = _mm512_max_ps(_mm512_min_ps(v[h], high), low); /* NaN -> high */
        in[2 * h] = _mm512_castps512_ps256(c);
        in[2 * h + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1));
    }
    EXP32_CORE(4, __m512d, _mm512_cvtps_pd, _mm512_mul_pd, _mm512_add_pd, _mm512_sub_pd,
               _mm512_set1_pd, z_rint, z_pow2, _mm512_cvtpd_ps, in, out);
    for (int h = 0; h < 2; ++h) {
        __m512 e = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_castps256_ps512(out[2 * h])), _mm256_castps_pd(out[2 * h + 1]), 1));
        e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(v[h], low, _CMP_LT_OQ), _mm512_setzero_ps());
        e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(v[h], high, _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
        e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(v[h], v[h], _CMP_UNORD_Q), _mm512_set1_ps(NAN));
        _mm512_mask_storeu_ps(y + 16 * h, m[h], e);
    }
}

__attribute__((target("avx512f"))) void exp32_avx512(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) exp32x_avx512(x + i, y + i, n - i < 32 ? (int)(n - i) : 32);
}

/* tanh32 of 32 values (n of them loaded and stored, n <= 32): 4 chains of 8 doubles */
AVX512_INLINE void tanh32x_avx512(const float *x, float *y, int n) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 v[2];
    __m256 in[4], out[4];
    __mmask16 m[2];
    for (int h = 0; h < 2; ++h) {
        const int left = n - 16 * h;
        m[h] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        v[h] = _mm512_maskz_loadu_ps(m[h], x + 16 * h);
        const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(v[h]))),
                                       _mm512_set1_ps(TANH32_HIGH)); /* NaN -> high */
        in[2 * h] = _mm512_castps512_ps256(a);
        in[2 * h + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    }
    TANH32_CORE(4, __m512d, _mm512_cvtps_pd, _mm512_mul_pd, _mm512_add_pd, _mm512_sub_pd,
                _mm512_div_pd, _mm512_set1_pd, z_rint, z_pow2, _mm512_cvtpd_ps, in, out);
    for (int h = 0; h < 2; ++h) {
        __m512 e = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_castps256_ps512(out[2 * h])), _mm256_castps_pd(out[2 * h + 1]), 1));
        e = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(e),
                                                _mm512_and_si512(sign, _mm512_castps_si512(v[h]))));
        e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(v[h], v[h], _CMP_UNORD_Q), _mm512_set1_ps(NAN));
        _mm512_mask_storeu_ps(y + 16 * h, m[h], e);
    }
}

__attribute__((target("avx512f"))) void tanh32_avx512(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) tanh32x_avx512(x + i, y + i, n - i < 32 ? (int)(n - i) : 32);
}

#endif
