// convert.cu: activations between the residual stream (float32) and an edge's dtype.
//
//   f32_to_f16(x, out, n, overflowed), f16_to_f32(x, out, n): IEEE half, rounded to
//       nearest even (as NumPy's astype(float16)); out-of-range values become
//       infinities, and f32_to_f16 adds to *overflowed (a u32 the caller clears) one for
//       each finite value that became one (an edge refuses them: the backend reads it).
//   f32_to_bf16(x, out, n), bf16_to_f32(x, out, n): bfloat16 bit patterns, rounded to
//       nearest even, NaN kept quiet (runtime_core.activations).
#include "common.cuh"

#define GRID_LOOP(n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

extern "C" __global__ void __launch_bounds__(1024) f32_to_f16(const float* __restrict__ x, u16* __restrict__ out, i64 n,
                                                                     u32* __restrict__ overflowed) {
    GRID_LOOP(n) {
        float v = x[i];
        u16 h = float_to_half(v);
        out[i] = h;
        // an infinite half (exponent all ones, no mantissa) from a finite float
        if ((h & 0x7fffu) == 0x7c00u && (float_to_bits(v) & 0x7fffffffu) < 0x7f800000u)
            atomicAdd(overflowed, 1u);
    }
}

extern "C" __global__ void __launch_bounds__(1024) f16_to_f32(const u16* __restrict__ x, float* __restrict__ out, i64 n) {
    GRID_LOOP(n) out[i] = half_to_float(x[i]);
}

extern "C" __global__ void __launch_bounds__(1024) f32_to_bf16(const float* __restrict__ x, u16* __restrict__ out,
                                       i64 n) {
    GRID_LOOP(n) out[i] = float_to_bf16(x[i]);
}

extern "C" __global__ void __launch_bounds__(1024) bf16_to_f32(const u16* __restrict__ x, float* __restrict__ out,
                                       i64 n) {
    GRID_LOOP(n) out[i] = bf16_to_float(x[i]);
}
