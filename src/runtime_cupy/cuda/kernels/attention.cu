// attention.cu: grouped-query attention of query rows over the KV cache.
//
//   attention_<KV>(qkv, rows, k_cache, v_cache, state, n_heads, n_kv, hd_k, hd_v,
//                  cache_size, window, scale, softcap, out, oq, od, os)
//   Grid (rows, n_heads): rows in x, the one dimension that may exceed 65535 blocks;
//   ATT_WARPS warps per block. Query row r (position p = state[0] + r, Q already
//   rotated, in qkv) of head h attends to the cached keys and values of kv head
//   h / (n_heads / n_kv) at positions 0 .. p (causal for a prefill, one row for a decode
//   step), or p - window + 1 .. p when window > 0 (a sliding block). The cache is a
//   ring of cache_size slots per kv head, position j in slot j % cache_size (rope.cu).
//   Scores are s = dot(q, k) * scale, capped when softcap > 0 (gemma2:
//   s = tanhf(s * (1 / softcap)) * softcap, llama.cpp's three operations, as the CPU
//   worker's ops.c; 0: no cap, the scores as they are); softmax and the weighted sum of
//   V run in one pass ("online softmax": a running maximum, sum and weighted sum per
//   warp, merged across the warps at the end).
//   out: (rows, n_heads * hd_v) float32. When oq is not null (one decode row, hd_v a
//   multiple of 32), the head's outputs are also quantized to 8 bits in chunks of 32.
//   Head sizes up to 256; lane l holds dimensions l, l + 32, ...
#include "common.cuh"

#define ATT_WARPS 8
#define ATT_MAX_PER_LANE 8

__device__ __forceinline__ float load_kv(const float* p) { return *p; }
__device__ __forceinline__ float load_kv(const u16* p) { return half_to_float(*p); }

template <typename KV>
__device__ __forceinline__ void attention_body(const float* __restrict__ qkv, int rows,
                                               const KV* __restrict__ k_cache,
                                               const KV* __restrict__ v_cache,
                                               const int* __restrict__ state, int n_heads,
                                               int n_kv, int hd_k, int hd_v, int cache_size,
                                               int window, float scale, float softcap,
                                               float* __restrict__ out, i8* oq, float* od,
                                               float* os) {
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][32 * ATT_MAX_PER_LANE];
    __shared__ float s_out[32 * ATT_MAX_PER_LANE];
    int r = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int p = state[0] + r;  // the row's position
    int seen = window > 0 && p >= window ? p - window + 1 : 0;  // the first position it sees
    int kvh = h / (n_heads / n_kv);
    int stride = n_heads * hd_k + n_kv * hd_k + n_kv * hd_v;  // a row of qkv
    const float* q = qkv + (i64)r * stride + h * hd_k;
    float qv[ATT_MAX_PER_LANE], acc[ATT_MAX_PER_LANE];
    UNROLL for (int i = 0; i < ATT_MAX_PER_LANE; ++i) {
        int d = lane + 32 * i;
        qv[i] = d < hd_k ? q[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    const float inv_cap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
    const KV* kb = k_cache + (i64)kvh * cache_size * hd_k;
    const KV* vb = v_cache + (i64)kvh * cache_size * hd_v;
    for (int j = seen + warp; j <= p; j += ATT_WARPS) {
        int slot = j % cache_size;
        const KV* k = kb + (i64)slot * hd_k;
        float dot = 0.0f;
        UNROLL for (int i = 0; i < ATT_MAX_PER_LANE; ++i) {
            int d = lane + 32 * i;
            if (d < hd_k) dot = fmaf(qv[i], load_kv(k + d), dot);
        }
        float s = warp_sum(dot) * scale;
        if (softcap > 0.0f) s = tanhf(s * inv_cap) * softcap;
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
        const KV* v = vb + (i64)slot * hd_v;
        UNROLL for (int i = 0; i < ATT_MAX_PER_LANE; ++i) {
            int d = lane + 32 * i;
            if (d < hd_v) acc[i] = acc[i] * corr + p * load_kv(v + d);
        }
        m = m_new;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    UNROLL for (int i = 0; i < ATT_MAX_PER_LANE; ++i) s_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float big = NEG_INF;
    UNROLL for (int w = 0; w < ATT_WARPS; ++w) big = fmaxf(big, s_m[w]);
    float total = 0.0f;
    UNROLL for (int w = 0; w < ATT_WARPS; ++w) {
        total += s_l[w] == 0.0f ? 0.0f : s_l[w] * expf(s_m[w] - big);
    }
    float* o = out + (i64)r * n_heads * hd_v + h * hd_v;
    for (int d = threadIdx.x; d < hd_v; d += blockDim.x) {
        float sum = 0.0f;
        UNROLL for (int w = 0; w < ATT_WARPS; ++w) {
            if (s_l[w] != 0.0f) sum += s_acc[w][d] * expf(s_m[w] - big);
        }
        float v = sum / total;
        o[d] = v;
        s_out[d] = v;
    }
    if (oq == 0) return;
    __syncthreads();
    i64 first = ((i64)r * n_heads * hd_v + (i64)h * hd_v) / 32;
    for (int b = warp; b < hd_v / 32; b += ATT_WARPS) {
        warp_quantize_chunk(s_out[32 * b + lane], first + b, oq, od, os);
    }
}

#define ATTENTION(NAME, KV)                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attention_##NAME(            \
        const float* qkv, int rows, const KV* k_cache, const KV* v_cache, const int* state,   \
        int n_heads, int n_kv, int hd_k, int hd_v, int cache_size, int window, float scale,   \
        float softcap, float* out, i8* oq, float* od, float* os) {                             \
        attention_body<KV>(qkv, rows, k_cache, v_cache, state, n_heads, n_kv, hd_k, hd_v,     \
                           cache_size, window, scale, softcap, out, oq, od, os);               \
    }

ATTENTION(f32, float)
ATTENTION(f16, u16)
