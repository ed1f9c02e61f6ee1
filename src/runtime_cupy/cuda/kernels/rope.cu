// rope.cu: the Q|K|V rows of a step after their matrix product: add the biases (qwen2),
// rotate Q and K (rotary position embedding), scale Q, and store K and V in the KV cache.
//
//   rope_kv_<KV>(qkv, rows, bias, rot, state, n_heads, n_kv, hd_k, hd_v, n_rot, neox,
//                q_scale, k_cache, v_cache, cache_size, temps)
//   qkv: (rows, q_dim + k_dim + v_dim) float32; Q is rotated (and multiplied by q_scale)
//       in place, K and V are written to the cache only. Row r is at position
//       state[0] + r.
//   bias: (q_dim + k_dim + v_dim,) or null.
//   rot: (positions, n_rot / 2) pairs (cos, sin) of every position's angles (the block's
//       own rope base), computed on the host exactly as the reference computes them
//       (runtime_core.workers.rotary.rope_rotations).
//   A head's rotary pair j < n_rot / 2 is (2j, 2j + 1) ("normal", llama) or
//       (j, j + n_rot / 2) (neox, qwen2); dimensions n_rot .. hd_k - 1 pass unchanged.
//       (a, b) -> (a cos - b sin, a sin + b cos), each product rounded (no fused
//       multiply-add), as NumPy's complex64 product rounds.
//   q_scale: 1, or the query scale where llama.cpp multiplies the rotated queries
//       (gemma2, gemma3, phi3), each element rounded once.
//   temps: null, or each position's factor on the rotated (and scaled) queries
//       (mistral3's temperature), each element rounded once.
//   k_cache, v_cache: this layer's (n_kv, cache_size, hd) in KV (float or half bits), a
//       ring: position p in slot p % cache_size (a block's whole context, or a sliding
//       block's window).
//   Grid: one block per row.
#include "common.cuh"

__device__ __forceinline__ void store_kv(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_kv(u16* p, float v) { *p = float_to_half(v); }

template <typename KV>
__device__ __forceinline__ void rope_kv_body(float* __restrict__ qkv, int rows,
                                             const float* __restrict__ bias,
                                             const float* __restrict__ rot,
                                             const int* __restrict__ state, int n_heads,
                                             int n_kv, int hd_k, int hd_v, int n_rot, int neox,
                                             float q_scale, KV* __restrict__ k_cache,
                                             KV* __restrict__ v_cache, int cache_size,
                                             const float* __restrict__ temps) {
    int r = blockIdx.x;
    if (r >= rows) return;
    int pos = state[0] + r, slot = pos % cache_size;
    int q_dim = n_heads * hd_k, k_dim = n_kv * hd_k, v_dim = n_kv * hd_v;
    float* x = qkv + (i64)r * (q_dim + k_dim + v_dim);
    int half_k = hd_k / 2, half_rot = n_rot / 2;
    int n_pairs = (n_heads + n_kv) * half_k;
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int head = p / half_k, j = p % half_k;
        int a, b;
        if (j < half_rot && neox) {
            a = j;
            b = j + half_rot;
        } else {
            a = 2 * j;  // a normal pair, or one of the pass-through dimensions
            b = 2 * j + 1;
        }
        int ia = head * hd_k + a, ib = head * hd_k + b;
        float va = x[ia], vb = x[ib];
        if (bias) {
            va += bias[ia];
            vb += bias[ib];
        }
        if (j < half_rot) {
            float c = rot[2 * ((i64)pos * half_rot + j)], s = rot[2 * ((i64)pos * half_rot + j) + 1];
            float ra = sub_rn(mul_rn(va, c), mul_rn(vb, s));
            float rb = add_rn(mul_rn(va, s), mul_rn(vb, c));
            va = ra;
            vb = rb;
        }
        if (head < n_heads) {
            va = va * q_scale;
            vb = vb * q_scale;
            if (temps) {
                float t = temps[pos];
                va = va * t;
                vb = vb * t;
            }
            x[ia] = va;
            x[ib] = vb;
        } else {
            KV* k = k_cache + ((i64)(head - n_heads) * cache_size + slot) * hd_k;
            store_kv(k + a, va);
            store_kv(k + b, vb);
        }
    }
    for (int i = threadIdx.x; i < v_dim; i += blockDim.x) {
        int at = q_dim + k_dim + i;
        float v = x[at];
        if (bias) v += bias[at];
        int head = i / hd_v, d = i % hd_v;
        store_kv(v_cache + ((i64)head * cache_size + slot) * hd_v + d, v);
    }
}

#define ROPE_KV(NAME, KV)                                                                      \
    extern "C" __global__ void __launch_bounds__(1024) rope_kv_##NAME(                        \
        float* qkv, int rows, const float* bias, const float* rot, const int* state,          \
        int n_heads, int n_kv, int hd_k, int hd_v, int n_rot, int neox, float q_scale,        \
        KV* k_cache, KV* v_cache, int cache_size, const float* temps) {                        \
        rope_kv_body<KV>(qkv, rows, bias, rot, state, n_heads, n_kv, hd_k, hd_v, n_rot, neox,  \
                         q_scale, k_cache, v_cache, cache_size, temps);                        \
    }

ROPE_KV(f32, float)
ROPE_KV(f16, u16)
