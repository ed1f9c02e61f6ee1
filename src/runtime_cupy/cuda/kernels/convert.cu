// convert.cu: activations between the residual stream (float32) and an edge's dtype.
//
//   f32_to_f16(x, out, n), f16_to_f32(x, out, n): IEEE half, rounded to nearest even
//       (as NumPy's astype(float16)); out-of-range values become infinities.
//   f32_to_bf16(x, out, n), bf16_to_f32(x, out, n): bfloat16 bit patterns, rounded to
//       nearest even, NaN kept quiet (runtime_core.activations).
#include "common.cuh"

#define GRID_LOOP(n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

extern "C" __global__ void __launch_bounds__(1024) f32_to_f16(const float* __restrict__ x, u16* __restrict__ out, i64 n) {
    GRID_LOOP(n) out[i] = float_to_half(x[i]);
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
