// simt_device.h: the CUDA device API kernels call: indices, synchronization, atomics, intrinsics, half and bfloat16.
// Part of the SIMT emulator (simt.h includes it).
#pragma once

// ---- thread, block and grid indices --------------------------------------------------------
#define threadIdx (::simt::detail::g.cur->idx)
#define blockIdx (::simt::detail::g.block_idx)
#define blockDim (::simt::detail::g.block)
#define gridDim (::simt::detail::g.grid)
#define warpSize 32

// ---- the CUDA device API -------------------------------------------------------------------
#define __syncthreads() ::simt::detail::syncthreads(SIMT_HERE)
#define __syncwarp(...) ::simt::detail::SyncWarp{SIMT_HERE}(__VA_ARGS__)
#define __shfl_sync(...) ::simt::detail::shfl(::simt::detail::W_SHFL_IDX, SIMT_HERE, __VA_ARGS__)
#define __shfl_up_sync(...) ::simt::detail::shfl(::simt::detail::W_SHFL_UP, SIMT_HERE, __VA_ARGS__)
#define __shfl_down_sync(...) \
    ::simt::detail::shfl(::simt::detail::W_SHFL_DOWN, SIMT_HERE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::simt::detail::shfl(::simt::detail::W_SHFL_XOR, SIMT_HERE, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
    ((unsigned)::simt::detail::collective(::simt::detail::W_BALLOT, SIMT_HERE, (mask), (pred) != 0, 0, 32))
#define __any_sync(mask, pred) \
    ((int)::simt::detail::collective(::simt::detail::W_ANY, SIMT_HERE, (mask), (pred) != 0, 0, 32))
#define __all_sync(mask, pred) \
    ((int)::simt::detail::collective(::simt::detail::W_ALL, SIMT_HERE, (mask), (pred) != 0, 0, 32))
#define __reduce_add_sync(mask, v) ::simt::detail::reduce(::simt::detail::W_RED_ADD, SIMT_HERE, (mask), (v))
#define __reduce_min_sync(mask, v) ::simt::detail::reduce_minmax(true, SIMT_HERE, (mask), (v))
#define __reduce_max_sync(mask, v) ::simt::detail::reduce_minmax(false, SIMT_HERE, (mask), (v))
#define __trap() SIMT_FAIL("__trap() in %s at %s:%d", ::simt::detail::where(::simt::detail::g.cur).c_str(), __FILE__, __LINE__)
#undef assert
#define assert(e)                                                                           \
    ((e) ? (void)0                                                                          \
         : SIMT_FAIL("assertion %s failed in %s at %s:%d", #e,                              \
                     ::simt::detail::where(::simt::detail::g.cur).c_str(), __FILE__, __LINE__))

namespace simt {
namespace detail {

struct SyncWarp {
    Site site;
    void operator()(unsigned mask = 0xffffffffu) const { collective(W_SYNCWARP, site, mask, 0, 0, 32); }
};

template <class T>
inline T shfl(int kind, Site s, unsigned mask, T v, int arg, int width = 32) {
    return shuffle<T>(kind, s, mask, v, arg, width);
}

template <class T>
inline T reduce(int kind, Site s, unsigned mask, T v) {
    static_assert(sizeof(T) == 4 && std::is_integral<T>::value, "32-bit integers");
    return (T)(uint32_t)collective(kind, s, mask, (uint32_t)v, 0, 32);
}

template <class T>
inline T reduce_minmax(bool min, Site s, unsigned mask, T v) {
    static_assert(sizeof(T) == 4 && std::is_integral<T>::value, "32-bit integers");
    int kind = std::is_signed<T>::value ? (min ? W_RED_MIN_S : W_RED_MAX_S)
                                        : (min ? W_RED_MIN_U : W_RED_MAX_U);
    return (T)(uint32_t)collective(kind, s, mask, (uint32_t)v, 0, 32);
}

}  // namespace detail
}  // namespace simt

// The lanes of the caller's warp that have not exited (a GPU may report fewer).
inline unsigned __activemask() {
    using namespace simt::detail;
    unsigned base = g.cur->linear - g.cur->lane, m = 0;
    for (unsigned l = 0; l < 32 && base + l < g.n_threads; ++l) {
        if (g.threads[base + l].state != EXITED) m |= 1u << l;
    }
    return m;
}

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(unsigned) {}
inline long long clock64() {
    static long long t = 0;
    return t += 1;
}
template <class T>
inline T __ldg(const T* p) {
    return *p;
}

// ---- atomics (a block's threads never switch inside one: each is atomic) --------------------
template <class T>
inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = (T)(old + v);
    return old;
}
template <class T>
inline T atomicSub(T* p, T v) {
    T old = *p;
    *p = (T)(old - v);
    return old;
}
template <class T>
inline T atomicExch(T* p, T v) {
    T old = *p;
    *p = v;
    return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
    T old = *p;
    if (v < old) *p = v;
    return old;
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}
template <class T>
inline T atomicCAS(T* p, T compare, T v) {
    T old = *p;
    if (old == compare) *p = v;
    return old;
}
template <class T>
inline T atomicAnd(T* p, T v) {
    T old = *p;
    *p = old & v;
    return old;
}
template <class T>
inline T atomicOr(T* p, T v) {
    T old = *p;
    *p = old | v;
    return old;
}
template <class T>
inline T atomicXor(T* p, T v) {
    T old = *p;
    *p = old ^ v;
    return old;
}
inline unsigned atomicInc(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = old >= v ? 0u : old + 1u;
    return old;
}
inline unsigned atomicDec(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = (old == 0u || old > v) ? v : old - 1u;
    return old;
}

// ---- integer intrinsics --------------------------------------------------------------------
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
    return c;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---- float intrinsics (correctly rounded on the host, as the _rn forms are on a GPU) ----------
inline float __int_as_float(int x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}
inline int __float_as_int(float f) {
    int x;
    memcpy(&x, &f, 4);
    return x;
}
inline float __uint_as_float(unsigned x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned x;
    memcpy(&x, &f, 4);
    return x;
}
inline double __longlong_as_double(long long x) {
    double d;
    memcpy(&d, &x, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long x;
    memcpy(&x, &d, 8);
    return x;
}
inline float __fadd_rn(float a, float b) {
    volatile float r = a + b;
    return r;
}
inline float __fsub_rn(float a, float b) {
    volatile float r = a - b;
    return r;
}
inline float __fmul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }
inline float __sinf(float a) { return sinf(a); }
inline float __cosf(float a) { return cosf(a); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __saturatef(float a) { return a < 0.0f ? 0.0f : (a > 1.0f ? 1.0f : (a == a ? a : 0.0f)); }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline int __float2int_rn(float a) { return (int)nearbyintf(a); }
inline int __float2int_rz(float a) { return (int)a; }

// ---- half and bfloat16 ---------------------------------------------------------------------
struct __half {
    unsigned short __x;
};
struct __nv_bfloat16 {
    unsigned short __x;
};

// float -> IEEE half, rounded to nearest even; a NaN becomes the GPU's 0x7fff.
inline unsigned short simt_float_to_half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;
    if (a >= 0x47800000u) return (unsigned short)(sign | 0x7c00u);  // >= 65536: infinity
    if (a < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), by a float addition
        volatile float magic = 0.5f;  // 2^-1: its ulp is 2^-24, the subnormal half step
        float m;
        memcpy(&m, &a, 4);
        volatile float s = m + magic;
        uint32_t b;
        float sv = s;
        memcpy(&b, &sv, 4);
        return (unsigned short)(sign | (b - 0x3f000000u));
    }
    uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd;  // exponent bias 127 -> 15, round half to even
    return (unsigned short)(sign | (a >> 13));
}
inline float simt_half_bits_to_float(unsigned short h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0x1fu) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;
    } else {
        float f = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
inline float __half2float(__half h) { return simt_half_bits_to_float(h.__x); }
inline __half __float2half(float f) { return __half{simt_float_to_half_bits(f)}; }
inline __half __float2half_rn(float f) { return __half{simt_float_to_half_bits(f)}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
inline __half __hadd(__half a, __half b) {
    return __float2half((float)((double)__half2float(a) + (double)__half2float(b)));
}
inline __half __hsub(__half a, __half b) {
    return __float2half((float)((double)__half2float(a) - (double)__half2float(b)));
}
inline __half __hmul(__half a, __half b) { return __float2half(__half2float(a) * __half2float(b)); }

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.__x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fffu};
    return __nv_bfloat16{(unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
