// norm.cu: RMS norm, SwiGLU, activation quantization and residual add.
//
//   rmsnorm_rows(x, w, out, n, eps): one block per row of (rows, n):
//       out = (x * s) * w, s = 1 / sqrt(sum(x^2) / n + eps) (the sum in float32, s in
//       double precision then rounded, as the reference does for one row).
//   rmsnorm_q8(x, w, out, n, eps, xq, xd, xs): the same for one row (one block), then
//       the normed row quantized to 8 bits in chunks of 32 when xq is not null.
//   swiglu_rows(h, out, n_ffn, rows): h = (rows, 2 n_ffn), gate | up;
//       out = gate / (1 + exp(-gate)) * up.
//   swiglu_q8(h, out, n_ffn, xq, xd, xs): one row, one warp per chunk of 32 outputs,
//       written as float32 and quantized (xq may be null).
//   quantize_q8(x, n_chunks, xq, xd, xs): a row of 32 * n_chunks floats, one warp per chunk.
//   add_inplace(x, y, n): x += y.
#include "common.cuh"

__device__ __forceinline__ float rms_scale(float ss, int n, float eps) {
    return (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ out, int n, float eps) {
    __shared__ float scratch[32];
    const float* xr = x + (i64)blockIdx.x * n;
    float* o = out + (i64)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    float s = rms_scale(block_sum(ss, scratch), n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = (xr[i] * s) * w[i];
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_q8(const float* __restrict__ x, const float* __restrict__ w,
                                      float* __restrict__ out, int n, float eps, i8* xq,
                                      float* xd, float* xs) {
    __shared__ float scratch[32];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(x[i], x[i], ss);
    float s = rms_scale(block_sum(ss, scratch), n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = (x[i] * s) * w[i];
    if (xq == 0) return;
    __syncthreads();  // out is read back by other threads of the block
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int blk = warp; blk < n / 32; blk += n_warps) {
        warp_quantize_chunk(out[32 * blk + lane], blk, xq, xd, xs);
    }
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

extern "C" __global__ void __launch_bounds__(1024) swiglu_rows(const float* __restrict__ h, float* __restrict__ out,
                                       int n_ffn, int rows) {
    i64 total = (i64)rows * n_ffn;
    i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        i64 r = i / n_ffn, j = i % n_ffn;
        const float* hr = h + r * 2 * n_ffn;
        out[i] = silu_mul(hr[j], hr[n_ffn + j]);
    }
}

extern "C" __global__ void __launch_bounds__(1024) swiglu_q8(const float* __restrict__ h, float* __restrict__ out,
                                     int n_ffn, i8* xq, float* xd, float* xs) {
    int lane = threadIdx.x & 31;
    i64 blk = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (blk >= n_ffn / 32) return;
    i64 j = 32 * blk + lane;
    float v = silu_mul(h[j], h[n_ffn + j]);
    out[j] = v;
    if (xq != 0) warp_quantize_chunk(v, blk, xq, xd, xs);
}

extern "C" __global__ void __launch_bounds__(1024) quantize_q8(const float* __restrict__ x, int n_chunks, i8* xq,
                                       float* xd, float* xs) {
    int lane = threadIdx.x & 31;
    i64 blk = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (blk >= n_chunks) return;
    warp_quantize_chunk(x[32 * blk + lane], blk, xq, xd, xs);
}

extern "C" __global__ void __launch_bounds__(1024) add_inplace(float* __restrict__ x, const float* __restrict__ y,
                                       i64 n) {
    i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) x[i] += y[i];
}
