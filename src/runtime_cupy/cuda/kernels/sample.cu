// sample.cu: the greedy token on the device, so that only its id comes back.
//
//   argmax_partial(x, n, pmax, pidx, pbad): block b scans x[i] for i = b * blockDim.x +
//       t, stepping by gridDim.x * blockDim.x; writes its largest value, the first index
//       holding it, and how many entries were not finite (NaN or infinite).
//   argmax_final(pmax, pidx, pbad, n_parts, out): one block; out[0] = the first index of
//       the largest entry of x (NumPy's argmax when every entry is finite), out[1] = the
//       number of entries that were not finite.
//   Non-finite entries never win; a step whose logits hold any is refused by the host,
//   as the reference sampler refuses it.
#include "common.cuh"

__device__ __forceinline__ void better(float v, int i, float* best, int* at) {
    if (v > *best || (v == *best && i < *at)) {
        *best = v;
        *at = i;
    }
}

__device__ __forceinline__ void block_argmax(float* best, int* at, int* bad) {
    __shared__ float s_best[32];
    __shared__ int s_at[32], s_bad[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    UNROLL for (int m = 16; m > 0; m >>= 1) {
        float ob = __shfl_xor_sync(FULL_MASK, *best, m);
        int oa = __shfl_xor_sync(FULL_MASK, *at, m);
        *bad += __shfl_xor_sync(FULL_MASK, *bad, m);
        better(ob, oa, best, at);
    }
    if (lane == 0) {
        s_best[warp] = *best;
        s_at[warp] = *at;
        s_bad[warp] = *bad;
    }
    __syncthreads();
    if (warp == 0) {
        int n_warps = blockDim.x >> 5;
        *best = lane < n_warps ? s_best[lane] : NEG_INF;
        *at = lane < n_warps ? s_at[lane] : 0x7fffffff;
        *bad = lane < n_warps ? s_bad[lane] : 0;
        UNROLL for (int m = 16; m > 0; m >>= 1) {
            float ob = __shfl_xor_sync(FULL_MASK, *best, m);
            int oa = __shfl_xor_sync(FULL_MASK, *at, m);
            *bad += __shfl_xor_sync(FULL_MASK, *bad, m);
            better(ob, oa, best, at);
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) argmax_partial(const float* __restrict__ x, int n, float* pmax,
                                          int* pidx, int* pbad) {
    float best = NEG_INF;
    int at = 0x7fffffff, bad = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = x[i];
        if (fabsf(v) <= 3.402823466e38f) {
            better(v, i, &best, &at);
        } else {
            bad += 1;  // NaN fails the comparison too
        }
    }
    block_argmax(&best, &at, &bad);
    if (threadIdx.x == 0) {
        pmax[blockIdx.x] = best;
        pidx[blockIdx.x] = at;
        pbad[blockIdx.x] = bad;
    }
}

extern "C" __global__ void __launch_bounds__(1024) argmax_final(const float* __restrict__ pmax,
                                        const int* __restrict__ pidx,
                                        const int* __restrict__ pbad, int n_parts, int* out) {
    float best = NEG_INF;
    int at = 0x7fffffff, bad = 0;
    for (int i = threadIdx.x; i < n_parts; i += blockDim.x) {
        better(pmax[i], pidx[i], &best, &at);
        bad += pbad[i];
    }
    block_argmax(&best, &at, &bad);
    if (threadIdx.x == 0) {
        out[0] = at;
        out[1] = bad;
    }
}
