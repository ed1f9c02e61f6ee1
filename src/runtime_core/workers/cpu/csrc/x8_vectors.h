/* x8_vectors.h: the vector operations of one width (XN names, VI and VF, loads,
 * prefetches, the running sums' start and finish). A part of x8_kernels.h, which includes
 * it once per vector width under its X8_TARGET and X8_WIDTH (so no include guard): see
 * there for the layout, the exact sums and the order of the float terms. */
#ifndef X8_WIDTH
#error "x8_vectors.h is included by x8_kernels.h"
#endif

/* ---- the vector operations of one width --------------------------------------------------- */

#if X8_WIDTH == 256
#define XN(name) x8_##name
#define XL 8
#define VI __m256i
#define VF __m256
#define v_and _mm256_and_si256
#define v_or _mm256_or_si256
#define v_xor _mm256_xor_si256
#define v_srli16 _mm256_srli_epi16
#define v_slli16 _mm256_slli_epi16
#define v_add32 _mm256_add_epi32
#define v_sub32 _mm256_sub_epi32
#define v_mullo32 _mm256_mullo_epi32
#define v_madd16 _mm256_madd_epi16
#define v_maddubs _mm256_maddubs_epi16
#define v_add16 _mm256_add_epi16
#define v_slli32 _mm256_slli_epi32
#define v_srli32 _mm256_srli_epi32
#define v_set1_16 _mm256_set1_epi16
#define v_packs32 _mm256_packs_epi32
#define v_lane32(v, i) _mm256_permutevar8x32_epi32((v), _mm256_set1_epi32(i)) /* lane i, every lane */
#define v_set1_8 _mm256_set1_epi8
#define v_set1_32 _mm256_set1_epi32
#define v_zero _mm256_setzero_si256
#define f_mul _mm256_mul_ps
#define f_add _mm256_add_ps
#define f_sub _mm256_sub_ps
#define f_cvt _mm256_cvtepi32_ps
#define f_set1 _mm256_set1_ps
#define f_zero _mm256_setzero_ps
#define f_store _mm256_storeu_ps

/* `bytes` bytes at p of the group (gs: ignored) */
X8_INL VI XN(ld)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_loadu_si256((const __m256i *)p);
}
/* 16 bytes per group at p, widened: the 8 halves as floats; bytes to int16 */
X8_INL VF XN(ld_halves)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
X8_INL VI XN(ld_u8_i16)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}
/* 8 bytes per group at p as int32 lanes, unsigned or signed */
X8_INL VI XN(ld_u8_i32)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
X8_INL VI XN(ld_i8_i32)(const uint8_t *p, int64_t gs) {
    (void)gs;
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* |q| and x given q's sign (x where q > 0, -x where q < 0, 0 where q = 0) */
#define v_abs8 _mm256_abs_epi8
#define v_sign8 _mm256_sign_epi8
#if X8_VNNI
#ifdef X8_DOT256 /* the VEX encoding (AVX-VNNI: dot_avxvnni.c) */
#define v_dot4 X8_DOT256
#else /* AVX-512 VL's EVEX encoding */
#define v_dot4 _mm256_dpbusd_epi32
#endif
#else
X8_INL VI v_dot4(VI acc, VI u, VI x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
#endif

#elif X8_WIDTH == 512
#define XN(name) x16_##name
#define XL 16
#define VI __m512i
#define VF __m512
#define v_and _mm512_and_si512
#define v_or _mm512_or_si512
#define v_xor _mm512_xor_si512
#define v_srli16 _mm512_srli_epi16
#define v_slli16 _mm512_slli_epi16
#define v_add32 _mm512_add_epi32
#define v_sub32 _mm512_sub_epi32
#define v_mullo32 _mm512_mullo_epi32
#define v_madd16 _mm512_madd_epi16
#define v_maddubs _mm512_maddubs_epi16
#define v_add16 _mm512_add_epi16
#define v_slli32 _mm512_slli_epi32
#define v_srli32 _mm512_srli_epi32
#define v_set1_16 _mm512_set1_epi16
#define v_packs32 _mm512_packs_epi32
#define v_lane32(v, i) _mm512_permutexvar_epi32(_mm512_set1_epi32(i), (v)) /* lane i, every lane */
#define v_set1_8 _mm512_set1_epi8
#define v_set1_32 _mm512_set1_epi32
#define v_zero _mm512_setzero_si512
#if X8_VNNI
#define v_dot4 _mm512_dpbusd_epi32
#else /* AVX-512 BW without VNNI: AVX2's three instructions, on 512-bit vectors */
X8_INL VI XN(dot4)(VI acc, VI u, VI x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
}
#define v_dot4 XN(dot4)
#endif
#define v_abs8 _mm512_abs_epi8
X8_INL VI XN(sign8)(VI x, VI q) { /* q = 0 gives x, not 0: its |q| is 0 */
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);
}
#define v_sign8 XN(sign8)
#define f_mul _mm512_mul_ps
#define f_add _mm512_add_ps
#define f_sub _mm512_sub_ps
#define f_cvt _mm512_cvtepi32_ps
#define f_set1 _mm512_set1_ps
#define f_zero _mm512_setzero_ps
#define f_store _mm512_storeu_ps

X8_INL VI XN(ld)(const uint8_t *p, int64_t gs) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + gs)), 1);
}
X8_INL __m256i XN(ld16x2)(const uint8_t *p, int64_t gs) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                   _mm_loadu_si128((const __m128i *)(p + gs)), 1);
}
X8_INL VF XN(ld_halves)(const uint8_t *p, int64_t gs) { return _mm512_cvtph_ps(XN(ld16x2)(p, gs)); }
X8_INL VI XN(ld_u8_i16)(const uint8_t *p, int64_t gs) { return _mm512_cvtepu8_epi16(XN(ld16x2)(p, gs)); }
X8_INL __m128i XN(ld8x2)(const uint8_t *p, int64_t gs) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + gs)));
}
X8_INL VI XN(ld_u8_i32)(const uint8_t *p, int64_t gs) { return _mm512_cvtepu8_epi32(XN(ld8x2)(p, gs)); }
X8_INL VI XN(ld_i8_i32)(const uint8_t *p, int64_t gs) { return _mm512_cvtepi8_epi32(XN(ld8x2)(p, gs)); }
#else
#error "X8_WIDTH is 256 or 512"
#endif

/* IQ4_NL's 16 values (quant.h) in every 128-bit lane, and a byte shuffle by them */
X8_INL VI XN(iq4_table)(void) {
    const __m128i t = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
#if X8_WIDTH == 256
    return _mm256_broadcastsi128_si256(t);
#else
    return _mm512_broadcast_i32x4(t);
#endif
}
#if X8_WIDTH == 256
#define v_shuf8 _mm256_shuffle_epi8
#else
#define v_shuf8 _mm512_shuffle_epi8
#endif

/* 4 activation bytes at p, broadcast to every lane */
X8_INL VI XN(bcast)(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v_set1_32(v);
}

/* acc plus the products of u with the 4 activation bytes at p broadcast to every lane
 * (bcast). With AVX-512's VNNI (X8_EMBED) one vpdpbusd whose memory operand is the
 * broadcast (EVEX's {1to8}, {1to16}; AT&T syntax, which setup.py's builds take), where GCC
 * 12 emits a vpbroadcastd before each vpdpbusd: on AMD Zen 4, the avx512-zen4 set (whose 1
 * and 2 rows of Q4_0, Q4_1, IQ4_NL and Q6_K take it, where avx512's pair kernels have no
 * broadcasts), in cache (1024 x 4096, 1 thread, the two builds in one process in turn, 15
 * rounds' median), ms: 1 row Q4_0 0.0644 -> 0.0617, IQ4_NL 0.0734 -> 0.0667, Q5_K 0.0873 ->
 * 0.0811; 2 rows Q4_0 0.0993 -> 0.0905, Q6_K 0.1299 -> 0.1167, Q5_K 0.1116 -> 0.1020; 3
 * rows Q8_0 0.1372 -> 0.1243, Q5_K 0.1291 -> 0.1141; 16 rows (the tiles) Q4_0 0.503 ->
 * 0.479, Q4_K 0.486 -> 0.466; 14336 x 4096 from memory, 2 rows Q4_0 1.371 -> 1.246 ms, 1
 * row within 2 %. Elsewhere v_dot4 of bcast. */
#if X8_VNNI && !defined(X8_DOT256)
#define X8_EMBED 1
#else
#define X8_EMBED 0
#endif
typedef int32_t __attribute__((may_alias)) X8_I32A; /* p's 4 bytes, read as one */
X8_INL VI XN(dot4_at)(VI acc, VI u, const int8_t *p) {
#if X8_EMBED && X8_WIDTH == 256
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const X8_I32A *)p));
    return acc;
#elif X8_EMBED
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const X8_I32A *)p));
    return acc;
#else
    return v_dot4(acc, u, XN(bcast)(p));
#endif
}

/* AVX2's own (256-bit vectors without VNNI): the running sums kept word by word */
#define X8_AVX2 (!X8_VNNI && X8_WIDTH == 256)
/* Without VNNI (AVX2, AVX-512 BW): vpmaddubsw's pairs of several words added in 16 bits,
 * then one vpmaddwd (by ones, or by the scale), where VNNI takes one vpdpbusd a word:
 * Q4_0, Q4_1 (q4_isum), Q4_K, Q5_K (k_isum) and Q6_K's tile (k6_isum) */
#define X8_PAIRS16 (!X8_VNNI)

#ifndef X8_KEEP /* v stays in a register here: no reordering of its sums across this point */
#define X8_KEEP(v) __asm__("" : "+x"(v))
#endif
/* AVX2's v_dot4 is three instructions that GCC would regroup: its running sums are kept
 * word by word (VNNI's accumulate in the instruction) */
#if !X8_AVX2
#define X8_KEEP_DOT(v) ((void)0)
#else
#define X8_KEEP_DOT(v) X8_KEEP(v)
#endif

/* `bytes` bytes at p into the first-level cache (prefetch) or the second (prefetch2) */
X8_INL void XN(prefetch)(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}
X8_INL void XN(prefetch2)(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}
/* Prefetch `bytes` `distance` bytes ahead of offset `at` of the group (pair) being read,
 * into the first-level cache (l1) or the second, in the order this pass reads memory:
 * past a group's end, the next group a pass takes: for two groups at once, the pair after
 * this one (not the second group, which is being read already: short rows then went
 * unprefetched) */
X8_INL void XN(ahead_by)(const uint8_t *grp, int64_t gs, int64_t at, int bytes, int64_t distance, const int l1) {
    int64_t o = at + distance;
    if (XL == 16 && o >= gs) o += gs;
    for (int half = 0; half < XL / 8; ++half) {
        if (l1) XN(prefetch)(grp + half * gs + o, bytes);
        else XN(prefetch2)(grp + half * gs + o, bytes);
    }
}
/* the products' prefetch: X8_AHEAD(bytes) ahead into the second level (repack.h) */
X8_INL void XN(ahead)(const uint8_t *grp, int64_t gs, int64_t at, int bytes) {
    XN(ahead_by)(grp, gs, at, bytes, X8_AHEAD(bytes), 0);
}

/* out[k][i] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), lane by lane */
X8_INL void XN(finish)(VF acc[X8_XT][8], int nj, float (*out)[XL]) {
    for (int k = 0; k < nj; ++k) {
        VF *a = acc[k];
        f_store(out[k], f_add(f_add(f_add(a[0], a[1]), f_add(a[2], a[3])),
                              f_add(f_add(a[4], a[5]), f_add(a[6], a[7]))));
    }
}

X8_INL void XN(zero)(VF acc[X8_XT][8], int nj) {
    for (int k = 0; k < nj; ++k)
        for (int i = 0; i < 8; ++i) acc[k][i] = f_zero();
}
