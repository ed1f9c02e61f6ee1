/* exp32.c: exp32 (exp32.h) for each instruction set: portable C one value at a time,
 * AVX2 on 4 doubles a vector, AVX-512 on 8; every lane the same operations in the same
 * order (no fused multiply-add: setup.py compiles with -ffp-contract=off). */
#include "exp32.h"

#include <math.h>
#include <string.h>

const double EXP32_TAYLOR[EXP32_TERMS] = {
    0x1.6124613a86d09p-33, 0x1.1eed8eff8d898p-29, 0x1.ae64567f544e4p-26, 0x1.27e4fb7789f5cp-22,
    0x1.71de3a556c734p-19, 0x1.a01a01a01a01ap-16, 0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10,
    0x1.1111111111111p-7,  0x1.5555555555555p-5,  0x1.5555555555555p-3,  0x1.0p-1,
    0x1.0p+0,              0x1.0p+0,
};

static float exp32_one(float x) {
    if (isnan(x)) return NAN;
    if (x < EXP32_LOW) return 0.0f;
    if (x > EXP32_HIGH) return INFINITY;
    const double xd = x;
    const double k = nearbyint(xd * EXP32_INV_LN2);
    double r = xd - k * EXP32_LN2_HI;
    r = r - k * EXP32_LN2_LO;
    double p = EXP32_TAYLOR[0];
    for (int i = 1; i < EXP32_TERMS; ++i) p = p * r + EXP32_TAYLOR[i];
    const uint64_t bits = (uint64_t)((int64_t)k + 1023) << 52; /* 2^k, a normal double */
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return (float)(p * scale);
}

/* one value at a time: about 6 ns a value on an AMD Zen 5 core where AVX2's takes 2 and
 * AVX-512's 1.1 (glibc's expf took 1.9) */
void exp32_portable(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = exp32_one(x[i]);
}

#if defined(__GNUC__) && defined(__x86_64__)

#include <immintrin.h>

#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2")))

/* exp32 of 4 values within the limits, as doubles */
AVX2_INLINE __m128 exp4_avx2(__m128 x) {
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d k = _mm256_round_pd(_mm256_mul_pd(xd, _mm256_set1_pd(EXP32_INV_LN2)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_sub_pd(xd, _mm256_mul_pd(k, _mm256_set1_pd(EXP32_LN2_HI)));
    r = _mm256_sub_pd(r, _mm256_mul_pd(k, _mm256_set1_pd(EXP32_LN2_LO)));
    __m256d p = _mm256_set1_pd(EXP32_TAYLOR[0]);
    for (int i = 1; i < EXP32_TERMS; ++i)
        p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(EXP32_TAYLOR[i]));
    const __m256i e = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k)), _mm256_set1_epi64x(1023)), 52);
    return _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(e)));
}

/* exp32 of 8 values: within the limits by exp4_avx2, beyond them 0, infinity or NaN */
AVX2_INLINE __m256 exp8_avx2(__m256 x) {
    const __m256 low = _mm256_set1_ps(EXP32_LOW), high = _mm256_set1_ps(EXP32_HIGH);
    const __m256 c = _mm256_max_ps(_mm256_min_ps(x, high), low); /* NaN -> high */
    __m256 y = _mm256_set_m128(exp4_avx2(_mm256_extractf128_ps(c, 1)),
                               exp4_avx2(_mm256_castps256_ps128(c)));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, low, _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, high, _CMP_GT_OQ));
    return _mm256_blendv_ps(y, _mm256_set1_ps(NAN), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

__attribute__((target("avx2"))) void exp32_avx2(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8_avx2(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, x + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(t, exp8_avx2(_mm256_loadu_ps(t)));
        memcpy(y + i, t, sizeof(float) * (size_t)(n - i));
    }
}

#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))

AVX512_INLINE __m256 exp8_avx512(__m256 x) {
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(xd, _mm512_set1_pd(EXP32_INV_LN2)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_sub_pd(xd, _mm512_mul_pd(k, _mm512_set1_pd(EXP32_LN2_HI)));
    r = _mm512_sub_pd(r, _mm512_mul_pd(k, _mm512_set1_pd(EXP32_LN2_LO)));
    __m512d p = _mm512_set1_pd(EXP32_TAYLOR[0]);
    for (int i = 1; i < EXP32_TERMS; ++i)
        p = _mm512_add_pd(_mm512_mul_pd(p, r), _mm512_set1_pd(EXP32_TAYLOR[i]));
    const __m512i e = _mm512_slli_epi64(
        _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(k)), _mm512_set1_epi64(1023)), 52);
    return _mm512_cvtpd_ps(_mm512_mul_pd(p, _mm512_castsi512_pd(e)));
}

/* exp32 of 16 values (exp8_avx2's limits, by masks) */
AVX512_INLINE __m512 exp16_avx512(__m512 x) {
    const __m512 low = _mm512_set1_ps(EXP32_LOW), high = _mm512_set1_ps(EXP32_HIGH);
    const __m512 c = _mm512_max_ps(_mm512_min_ps(x, high), low); /* NaN -> high */
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c), 1));
    __m512 y = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_castps256_ps512(exp8_avx512(_mm512_castps512_ps256(c)))),
        _mm256_castps_pd(exp8_avx512(hi)), 1));
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), _mm512_setzero_ps());
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, high, _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_ps(NAN));
}

__attribute__((target("avx512f"))) void exp32_avx512(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16_avx512(_mm512_loadu_ps(x + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(y + i, m, exp16_avx512(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

#endif
