/* quantize_avx2.c: the 8-bit activations (dot.h's formats) with AVX2, 8 values a vector:
 * the same bits as dot_portable.c's quantize_row, value for value. Each step is one
 * IEEE operation on each lane that the portable code makes on each value: the largest
 * magnitude (a maximum, exact in any order), the product by the block's inverse scale,
 * the rounding (C's roundf as truncation, the exact remainder and its comparison with
 * one half; llama.cpp's nearest_int as the same addition of 1.5 * 2^23 and the same
 * bits of the sum), integer sums; a block's scales are the portable code's scalar
 * operations. A block holding a NaN or an infinity takes the portable path's result
 * (d = NaN, q = 0). */
#include <string.h>

#include "dot.h"

#ifdef GPP_HAVE_AVX2

#include <immintrin.h>

#define QA __attribute__((target("avx2,f16c")))
#define QA_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

/* the largest of 8 floats (exact) */
QA_INLINE float hmax(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* the exact sum of 8 int32 */
QA_INLINE int hsum(__m256i v) {
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    return _mm_cvtsi128_si32(a);
}

/* The largest magnitude of n (a multiple of 8) values, or -1 when one of them is a NaN
 * or an infinity (dot_portable.c's is_finite: |v| <= FLT_MAX, false for a NaN) */
QA_INLINE float block_amax(const float *v, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.402823466e38f);
    __m256 m = _mm256_setzero_ps();
    int finite = 1;
    for (int l = 0; l < n; l += 8) {
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + l));
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ)) == 0xFF;
        m = _mm256_max_ps(m, a);
    }
    return finite ? hmax(m) : -1.0f;
}

/* the low bytes of 8 int32 at out: the portable code's (int8_t) conversion, whatever the
 * value (a block whose scale's inverse overflows, its largest magnitude below about
 * 4e-37, makes products no byte holds, alike on every set) */
QA_INLINE void store8(int8_t *out, __m256i i) {
    __m256i b = _mm256_and_si256(i, _mm256_set1_epi32(0xFF));
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(w, w));
}

/* C's roundf of 8 products p (|p| < 2^31): truncated, then one up or down where the
 * exact remainder is at least one half */
QA_INLINE __m256i round_away8(__m256 p) {
    __m256i i = _mm256_cvttps_epi32(p);
    __m256 frac = _mm256_sub_ps(p, _mm256_cvtepi32_ps(i));
    __m256i up = _mm256_castps_si256(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ));
    __m256i down = _mm256_castps_si256(_mm256_cmp_ps(frac, _mm256_set1_ps(-0.5f), _CMP_LE_OQ));
    return _mm256_add_epi32(_mm256_sub_epi32(i, up), down);
}

/* llama.cpp's nearest_int of 8 products (|p| < 2^22), at most 127 */
QA_INLINE __m256i round_even8(__m256 p) {
    __m256i t = _mm256_castps_si256(_mm256_add_ps(p, _mm256_set1_ps(12582912.0f)));
    __m256i i = _mm256_sub_epi32(_mm256_and_si256(t, _mm256_set1_epi32(0x007fffff)),
                                 _mm256_set1_epi32(0x00400000));
    return _mm256_min_epi32(i, _mm256_set1_epi32(127));
}

QA void quantize_row_avx2(int fmt, const float *x, int64_t n, int8_t *q, float *d, float *s,
                          int32_t *g) {
    if (fmt == FMT_Q8_K) {
        for (int64_t b = 0; b < n / 256; ++b) {
            const float *v = x + 256 * b;
            float amax = block_amax(v, 256);
            if (amax <= 0.0f) { /* a NaN or an infinity, or all zeros */
                quantize_row(fmt, v, 256, q + 256 * b, d + b, s, g + 16 * b);
                continue;
            }
            int first = 0; /* the first value of the largest magnitude, as the portable loop */
            while (v[first] != amax && v[first] != -amax) ++first;
            float iscale = -127.0f / v[first];
            const __m256 is = _mm256_set1_ps(iscale);
            for (int k = 0; k < 16; ++k) {
                const float *w = v + 16 * k;
                __m256i a = round_even8(_mm256_mul_ps(is, _mm256_loadu_ps(w)));
                __m256i c = round_even8(_mm256_mul_ps(is, _mm256_loadu_ps(w + 8)));
                store8(q + 256 * b + 16 * k, a);
                store8(q + 256 * b + 16 * k + 8, c);
                g[16 * b + k] = hsum(_mm256_add_epi32(a, c));
            }
            d[b] = 1.0f / iscale;
        }
        return;
    }
    for (int64_t c = 0; c < n / 32; ++c) {
        const float *v = x + 32 * c;
        float amax = block_amax(v, 32);
        if (amax < 0.0f) { /* a NaN or an infinity */
            quantize_row(fmt, v, 32, q + 32 * c, d + c, s ? s + c : NULL, g + c);
            continue;
        }
        float dc = amax / 127.0f;
        float id = dc != 0.0f ? 1.0f / dc : 0.0f;
        const __m256 iv = _mm256_set1_ps(id);
        __m256i sum = _mm256_setzero_si256();
        for (int l = 0; l < 32; l += 8) {
            __m256i i = round_away8(_mm256_mul_ps(_mm256_loadu_ps(v + l), iv));
            store8(q + 32 * c + l, i);
            sum = _mm256_add_epi32(sum, i);
        }
        int total = hsum(sum);
        d[c] = q8_half(dc);
        if (fmt == FMT_Q8_1) s[c] = q8_half((float)total * dc);
        g[c] = total;
    }
}

#endif
