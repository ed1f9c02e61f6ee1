// norm.cu: RMS norms, gated activations, activation quantization and element-wise steps.
//
//   rmsnorm_rows(x, w, out, n, eps): one block per row of (rows, n):
//       out = (x * s) * w, s = 1 / sqrt(sum(x^2) / n + eps) (the sum in float32, s in
//       double precision then rounded, as the reference does for one row).
//   rmsnorm_add_rows(o, w, x, n, eps): the same of o, added: x = x + (o * s) * w
//       (gemma2's and gemma3's post-norms: a block's output normed into the residual
//       stream).
//   rmsnorm_q8(x, w, out, n, eps, xq, xd, xs): one block of 1024 threads per row (grid
//       (rows,)): rmsnorm_rows' arithmetic, then the normed row quantized to 8 bits in
//       chunks of 32 when xq is not null (row r's at xq + r n, xd and xs + r n / 32).
//   head_rmsnorm(qkv, rows, bias, q_norm, k_norm, n_heads, n_kv, hd_k, hd_v, eps): the Q|K|V
//       rows of a step plus their bias (when not null), then each Q head and K head normed
//       as rmsnorm_rows does a row, times q_norm or k_norm (hd_k,) (qwen3's and gemma3's
//       per-head norms). Grid (rows, n_heads + 2 n_kv), one warp per head (a V head: its
//       bias only).
//   swiglu_rows(h, out, n_ffn, rows), geglu_rows(...): h = (rows, 2 n_ffn), gate | up;
//       out = act(gate) * up, act SiLU (gate / (1 + exp(-gate))) or GELU's tanh form
//       (gate * (0.5 * (1 + tanh(((gate^2 * 0.044715 + 1) * gate) * sqrt(2 / pi))))),
//       each rounded in the reference's order.
//   swiglu_q8(h, out, n_ffn, xq, xd, xs), geglu_q8(...): grid (blocks, rows), row
//       blockIdx.y; one warp per chunk of 32 outputs, written as float32 and quantized
//       (xq may be null).
//   quantize_q8(x, n_chunks, xq, xd, xs): 32 * n_chunks floats (rows of whole chunks,
//       stacked), one warp per chunk.
//   add_inplace(x, y, n): x += y.
//   scale_inplace(x, factor, n): x *= factor (gemma2's and gemma3's embedding scale).
//   softcap(x, inv_cap, cap, n): x = tanh(x * inv_cap) * cap (gemma2's and gemma3's logit
//       soft cap; gemma2's cap on the attention scores is attention.cu's).
#include "common.cuh"

__device__ __forceinline__ float rms_scale(float ss, int n, float eps) {
    return (float)(1.0 / sqrt((double)ss / (double)n + (double)eps));
}

// Row blockIdx.x of x, normed: into out, or added to out (accumulate).
__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ x, const float* __restrict__ w,
                                            float* __restrict__ out, int n, float eps,
                                            bool accumulate) {
    __shared__ float scratch[32];
    const float* xr = x + (i64)blockIdx.x * n;
    float* o = out + (i64)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    float s = rms_scale(block_sum(ss, scratch), n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = (xr[i] * s) * w[i];
        o[i] = accumulate ? o[i] + v : v;
    }
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ out, int n, float eps) {
    rmsnorm_row(x, w, out, n, eps, false);
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_add_rows(const float* __restrict__ o,
                                                                   const float* __restrict__ w,
                                                                   float* __restrict__ x, int n,
                                                                   float eps) {
    rmsnorm_row(o, w, x, n, eps, true);
}

extern "C" __global__ void __launch_bounds__(32) head_rmsnorm(float* __restrict__ qkv, int rows,
                                                             const float* __restrict__ bias,
                                                             const float* __restrict__ q_norm,
                                                             const float* __restrict__ k_norm,
                                                             int n_heads, int n_kv, int hd_k,
                                                             int hd_v, float eps) {
    int r = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    if (r >= rows) return;
    int qk_heads = n_heads + n_kv;
    bool is_v = h >= qk_heads;
    int start = is_v ? qk_heads * hd_k + (h - qk_heads) * hd_v : h * hd_k;
    int len = is_v ? hd_v : hd_k;
    float* x = qkv + (i64)r * (qk_heads * hd_k + n_kv * hd_v) + start;
    float ss = 0.0f;
    for (int d = lane; d < len; d += 32) {
        float v = bias ? x[d] + bias[start + d] : x[d];
        x[d] = v;  // each lane reads and writes its own dimensions only
        ss = fmaf(v, v, ss);
    }
    if (is_v) return;  // the whole warp: h is the block's
    float s = rms_scale(warp_sum(ss), len, eps);
    const float* w = h < n_heads ? q_norm : k_norm;
    for (int d = lane; d < len; d += 32) x[d] = (x[d] * s) * w[d];
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_q8(const float* __restrict__ x, const float* __restrict__ w,
                                      float* __restrict__ out, int n, float eps, i8* xq,
                                      float* xd, float* xs) {
    __shared__ float scratch[32];
    i64 at = blockIdx.x;  // the row
    x += at * n;
    out += at * n;
    if (xq != 0) {
        xq += at * n;
        xd += at * (n / 32);
        xs += at * (n / 32);
    }
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

// The gated activations: act(gate) * up, rounded in the reference worker's order.
struct Silu {
    __device__ __forceinline__ static float gated(float g, float u) { return g / (1.0f + expf(-g)) * u; }
};
struct GeluTanh {
    __device__ __forceinline__ static float gated(float g, float u) {
        float inner = ((g * g) * 0.044715f + 1.0f) * g * 0.7978845608028654f;
        return g * ((tanhf(inner) + 1.0f) * 0.5f) * u;
    }
};

template <class Act>
__device__ __forceinline__ void gated_rows(const float* __restrict__ h, float* __restrict__ out,
                                           int n_ffn, int rows) {
    i64 total = (i64)rows * n_ffn;
    i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        i64 r = i / n_ffn, j = i % n_ffn;
        const float* hr = h + r * 2 * n_ffn;
        out[i] = Act::gated(hr[j], hr[n_ffn + j]);
    }
}

template <class Act>
__device__ __forceinline__ void gated_q8(const float* __restrict__ h, float* __restrict__ out,
                                         int n_ffn, i8* xq, float* xd, float* xs) {
    int lane = threadIdx.x & 31;
    i64 blk = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (blk >= n_ffn / 32) return;
    i64 at = blockIdx.y;  // the row
    h += at * 2 * n_ffn;
    out += at * n_ffn;
    if (xq != 0) {
        xq += at * n_ffn;
        xd += at * (n_ffn / 32);
        xs += at * (n_ffn / 32);
    }
    i64 j = 32 * blk + lane;
    float v = Act::gated(h[j], h[n_ffn + j]);
    out[j] = v;
    if (xq != 0) warp_quantize_chunk(v, blk, xq, xd, xs);
}

#define GATED(NAME, ACT)                                                                     \
    extern "C" __global__ void __launch_bounds__(1024) NAME##_rows(                         \
        const float* __restrict__ h, float* __restrict__ out, int n_ffn, int rows) {         \
        gated_rows<ACT>(h, out, n_ffn, rows);                                                \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(1024) NAME##_q8(                           \
        const float* __restrict__ h, float* __restrict__ out, int n_ffn, i8* xq, float* xd, \
        float* xs) {                                                                         \
        gated_q8<ACT>(h, out, n_ffn, xq, xd, xs);                                            \
    }

GATED(swiglu, Silu)
GATED(geglu, GeluTanh)

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

extern "C" __global__ void __launch_bounds__(1024) scale_inplace(float* __restrict__ x, float factor,
                                                                i64 n) {
    i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) x[i] = x[i] * factor;
}

extern "C" __global__ void __launch_bounds__(1024) softcap(float* __restrict__ x, float inv_cap,
                                                          float cap, i64 n) {
    i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        x[i] = tanhf(x[i] * inv_cap) * cap;
    }
}
