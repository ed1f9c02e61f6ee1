// common.cuh: small helpers shared by every kernel file.
//
// No CUDA header is included anywhere, so that NVRTC (CuPy's RawModule) and nvcc
// compile exactly the same text. Half-precision conversions and the 4-way int8 dot
// product are written as inline PTX on the device. The functions marked HD also
// compile for the host (nvcc's host pass, no GPU needed), so that the block decoders
// of quant.cuh can be run and checked on a CPU (tests/runtime_cupy/cuda/test_kernels_host.py).
#pragma once

#ifdef __CUDACC__
#define HD __host__ __device__ __forceinline__
#else
#define HD inline
#endif

#ifdef __CUDA_ARCH__
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;
typedef long long i64;

// 16-byte vectors (CUDA's own int4 / float4 come from headers NVRTC may not have).
struct alignas(16) I4 {
    int x, y, z, w;
};
struct alignas(16) F4 {
    float x, y, z, w;
};
struct alignas(16) U4 {
    u32 x, y, z, w;
};

// ---- half and bfloat16 --------------------------------------------------------------

HD float half_to_float(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    // IEEE binary16 -> binary32, exact (subnormals, infinities and NaNs included).
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1fu;
    u32 man = h & 0x3ffu;
    u32 bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do {
            man <<= 1;
            ++e;
        } while ((man & 0x400u) == 0);
        bits = sign | ((u32)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
#endif
}

HD float bits_to_float(u32 bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
#endif
}

HD u32 float_to_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    u32 b;
    __builtin_memcpy(&b, &f, 4);
    return b;
#endif
}

#define NEG_INF bits_to_float(0xff800000u)

HD float bf16_to_float(u16 b) { return bits_to_float(((u32)b) << 16); }

// float -> bf16 bits, rounded to nearest even; a NaN stays a quiet NaN (as ggml does).
HD u16 float_to_bf16(float f) {
    u32 bits = float_to_bits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (u16)((bits >> 16) | 0x40u);
    return (u16)((bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16);
}


// ---- products that the compiler must not fuse -------------------------------------
// Dequantization rounds like the gguf package's NumPy code (a product, then a sum,
// each rounded), so these never become one fused multiply-add.

HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    volatile float r = a * b;
    return r;
#endif
}

HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    volatile float r = a + b;
    return r;
#endif
}

HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    volatile float r = a - b;
    return r;
#endif
}

// float -> IEEE half bits, rounded to nearest even (as NumPy's astype(float16)); a NaN
// becomes 0x7fff, the GPU's canonical NaN (NumPy keeps some of the payload).
HD u16 float_to_half(float f) {
#ifdef __CUDA_ARCH__
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    u32 x = float_to_bits(f);
    u32 sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;
    if (a >= 0x47800000u) return (u16)(sign | 0x7c00u);  // 65536 and up: infinity
    if (a < 0x38800000u) {
        // below 2^-14: a subnormal half or zero. Adding 0.5 (whose float ulp is 2^-24,
        // the subnormal half's step) rounds to nearest even; the low bits are the half.
        float s = add_rn(bits_to_float(a), 0.5f);
        return (u16)(sign | (float_to_bits(s) - 0x3f000000u));
    }
    // rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even;
    // a carry into the exponent is right, up to infinity (65520 and up)
    a += 0xc8000fffu + ((a >> 13) & 1u);
    return (u16)(sign | (a >> 13));
#endif
}

// ---- integer dot product of 4 packed signed bytes -----------------------------------

HD int dot4(int a, int b, int c) {
#ifdef __CUDA_ARCH__
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#else
    for (int i = 0; i < 4; ++i) {
        c += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    }
    return c;
#endif
}

// ---- alignment ------------------------------------------------------------------------
// A GPU faults on a load of 2, 4, 8 or 16 bytes from an address not aligned to its size.
// Built for the host with GGUF_CHECK_ALIGN (the CPU test harness of quant.cuh, which
// defines check_aligned to stop on a misaligned address), every multi-byte load of a
// block calls check_aligned(address, size, what).
#if defined(GGUF_CHECK_ALIGN) && !defined(__CUDA_ARCH__)
void check_aligned(const void* p, unsigned n, const char* what);
#define CHECK_ALIGNED(p, n, what) check_aligned((const void*)(p), (n), (what))
#else
#define CHECK_ALIGNED(p, n, what) ((void)0)
#endif

// ---- unaligned little-endian loads ---------------------------------------------------
// GGUF blocks of 18, 22, 34, 110 and 210 bytes are only 2-byte aligned in a row.

HD u32 load_u16(const u8* p) {
    CHECK_ALIGNED(p, 2, "load_u16");
    return *(const u16*)p;
}

HD u32 load_u32_a2(const u8* p) {
    CHECK_ALIGNED(p, 2, "load_u32_a2");
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}

HD u32 load_u32_a4(const u8* p) {
    CHECK_ALIGNED(p, 4, "load_u32_a4");
    return *(const u32*)p;
}

// ---- warp and block reductions (device only) -------------------------------------------
#ifdef __CUDACC__
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(FULL_MASK, v, m);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, m));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int n_warps = blockDim.x >> 5;
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Quantize one chunk of 32 floats, one per lane of a warp, to 8 bits (llama.cpp's q8_1
// idea): d = max|v| / 127, q = round(v / d) (halves away from zero), s = d * sum(q).
// A chunk holding a NaN or an infinity gets d = NaN and q = 0, so that it poisons
// every product it enters instead of vanishing in the rounding.
// Chunk `blk` of (xq, xd, xs). twins.quantize_q8 is the NumPy twin.
__device__ __forceinline__ void warp_quantize_chunk(float v, i64 blk, i8* xq, float* xd,
                                                    float* xs) {
    int lane = threadIdx.x & 31;
    float amax = warp_max(fabsf(v));
    bool bad = __any_sync(FULL_MASK, !(fabsf(v) <= 3.402823466e38f));
    float d = bad ? bits_to_float(0x7fc00000u) : amax / 127.0f;
    int q = (bad || amax == 0.0f) ? 0 : (int)roundf(v / d);
    int sum = warp_sum_int(q);
    xq[32 * blk + lane] = (i8)q;
    if (lane == 0) {
        xd[blk] = d;
        xs[blk] = d * (float)sum;
    }
}
#endif
