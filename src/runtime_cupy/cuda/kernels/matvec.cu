// matvec.cu: y = W x for activation rows, fused with dequantization.
//
// Grid (ceil(n_rows / MV_WARPS), rows): activation row blockIdx.y is x (or xq, xd, xs)
// offset by that many rows of 32 * n_chunks elements, its outputs y offset by that many
// rows of n_rows; every activation row takes the same arithmetic whatever the launch's
// rows (a run's bits do not depend on its batch).
//
// W stays in its GGUF block layout: row r is `row_bytes` bytes at W + r * row_bytes,
// `n_chunks` chunks of 32 elements. One warp computes one output row: lane l takes
// chunks l, l + 32, ...; the lanes' partial sums are added by a butterfly (warp_sum).
//
//   matvec_q8_<T>: the activation row quantized to 8 bits (quantize_q8 / rmsnorm_q8:
//       xq int8[32 * n_chunks], xd[n_chunks] scales, xs[n_chunks] = xd * sum(xq)); each
//       chunk is an integer dot product (dp4a) and one float expression (quant.cuh).
//   matvec_f_<T>: the activation row in float32; each chunk is dequantized in
//       registers and multiplied in float32.
//
// Epilogue: y[r] = (accumulate ? y[r] : 0) + dot + (bias ? bias[r] : 0); accumulate adds
// into the residual stream in place (each row has one writer, so no atomics).
#include "quant.cuh"

#define MV_WARPS 4

template <class T>
__device__ __forceinline__ void matvec_q8_body(const u8* __restrict__ w, i64 row_bytes,
                                               int n_chunks, int n_rows,
                                               const i8* __restrict__ xq,
                                               const float* __restrict__ xd,
                                               const float* __restrict__ xs, float* y,
                                               const float* __restrict__ bias, int accumulate) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    i64 at = blockIdx.y;  // the activation row
    xq += at * 32 * n_chunks;
    xd += at * n_chunks;
    xs += at * n_chunks;
    y += at * n_rows;
    const u8* r = w + (i64)row * row_bytes;
    float acc = 0.0f;
#pragma unroll 4
    for (int c = lane; c < n_chunks; c += 32) {
        const I4* xp = (const I4*)(xq + 32 * c);
        I4 a = xp[0], b = xp[1];
        int x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        acc += T::dot_q8(r, c, x, xd[c], xs[c]);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        if (bias) acc += bias[row];
        y[row] = accumulate ? y[row] + acc : acc;
    }
}

template <class T>
__device__ __forceinline__ void matvec_f_body(const u8* __restrict__ w, i64 row_bytes, int n_chunks,
                                              int n_rows, const float* __restrict__ x, float* y,
                                              const float* __restrict__ bias, int accumulate) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    i64 at = blockIdx.y;  // the activation row
    x += at * 32 * n_chunks;
    y += at * n_rows;
    const u8* r = w + (i64)row * row_bytes;
    float acc = 0.0f;
#pragma unroll 2
    for (int c = lane; c < n_chunks; c += 32) {
        float v[32];
        T::dequant(r, c, v);
        const F4* xp = (const F4*)(x + 32 * c);
        UNROLL for (int i = 0; i < 8; ++i) {
            F4 xv = xp[i];
            acc = fmaf(v[4 * i], xv.x, acc);
            acc = fmaf(v[4 * i + 1], xv.y, acc);
            acc = fmaf(v[4 * i + 2], xv.z, acc);
            acc = fmaf(v[4 * i + 3], xv.w, acc);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        if (bias) acc += bias[row];
        y[row] = accumulate ? y[row] + acc : acc;
    }
}

#define MATVEC_Q8(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) matvec_q8_##NAME(           \
        const u8* w, i64 row_bytes, int n_chunks, int n_rows, const i8* xq, const float* xd, \
        const float* xs, float* y, const float* bias, int accumulate) {                     \
        matvec_q8_body<T>(w, row_bytes, n_chunks, n_rows, xq, xd, xs, y, bias, accumulate); \
    }

#define MATVEC_F(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) matvec_f_##NAME(          \
        const u8* w, i64 row_bytes, int n_chunks, int n_rows, const float* x, float* y,    \
        const float* bias, int accumulate) {                                               \
        matvec_f_body<T>(w, row_bytes, n_chunks, n_rows, x, y, bias, accumulate);          \
    }

MATVEC_Q8(Q8_0, TypeQ8_0)
MATVEC_Q8(Q4_0, TypeQ4_0)
MATVEC_Q8(Q4_1, TypeQ4_1)
MATVEC_Q8(Q5_0, TypeQ5_0)
MATVEC_Q8(Q5_1, TypeQ5_1)
MATVEC_Q8(Q2_K, TypeQ2_K)
MATVEC_Q8(Q3_K, TypeQ3_K)
MATVEC_Q8(Q4_K, TypeQ4_K)
MATVEC_Q8(Q5_K, TypeQ5_K)
MATVEC_Q8(Q6_K, TypeQ6_K)
MATVEC_Q8(IQ4_NL, TypeIQ4_NL)
MATVEC_Q8(IQ4_XS, TypeIQ4_XS)

MATVEC_F(F32, TypeF32)
MATVEC_F(F16, TypeF16)
MATVEC_F(BF16, TypeBF16)
MATVEC_F(Q8_0, TypeQ8_0)
MATVEC_F(Q4_0, TypeQ4_0)
MATVEC_F(Q4_1, TypeQ4_1)
MATVEC_F(Q5_0, TypeQ5_0)
MATVEC_F(Q5_1, TypeQ5_1)
MATVEC_F(Q2_K, TypeQ2_K)
MATVEC_F(Q3_K, TypeQ3_K)
MATVEC_F(Q4_K, TypeQ4_K)
MATVEC_F(Q5_K, TypeQ5_K)
MATVEC_F(Q6_K, TypeQ6_K)
MATVEC_F(IQ4_NL, TypeIQ4_NL)
MATVEC_F(IQ4_XS, TypeIQ4_XS)
