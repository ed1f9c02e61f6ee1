// dequant.cu: rows of a GGUF matrix to float32, exactly as the gguf package's
// dequantize rounds them. Used for the embedding lookup (rows picked by token id) and
// for the prefill (a tile of consecutive rows, then a cuBLAS matrix product).
//
//   dequant_rows_<T>(w, row_bytes, n_chunks, ids, row0, n_rows, out):
//       out[i, :] = row (ids ? ids[i] : row0 + i) of w, for i < n_rows;
//       out is (n_rows, 32 * n_chunks) float32. One thread per chunk of 32 elements.
#include "quant.cuh"

template <class T>
__device__ __forceinline__ void dequant_rows_body(const u8* __restrict__ w, i64 row_bytes,
                                                  int n_chunks, const int* __restrict__ ids,
                                                  int row0, int n_rows, float* __restrict__ out) {
    i64 total = (i64)n_rows * n_chunks;
    i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        int r = (int)(i / n_chunks), c = (int)(i % n_chunks);
        i64 src = ids ? (i64)ids[r] : (i64)row0 + r;
        float v[32];
        T::dequant(w + src * row_bytes, c, v);
        F4* o = (F4*)(out + (i64)r * n_chunks * 32 + 32 * c);
        UNROLL for (int k = 0; k < 8; ++k) {
            F4 f;
            f.x = v[4 * k];
            f.y = v[4 * k + 1];
            f.z = v[4 * k + 2];
            f.w = v[4 * k + 3];
            o[k] = f;
        }
    }
}

#define DEQUANT_ROWS(NAME, T)                                                               \
    extern "C" __global__ void __launch_bounds__(1024) dequant_rows_##NAME(const u8* w, i64 row_bytes, int n_chunks, \
                                                   const int* ids, int row0, int n_rows,      \
                                                   float* out) {                              \
        dequant_rows_body<T>(w, row_bytes, n_chunks, ids, row0, n_rows, out);                 \
    }

DEQUANT_ROWS(F32, TypeF32)
DEQUANT_ROWS(F16, TypeF16)
DEQUANT_ROWS(BF16, TypeBF16)
DEQUANT_ROWS(Q8_0, TypeQ8_0)
DEQUANT_ROWS(Q4_0, TypeQ4_0)
DEQUANT_ROWS(Q4_1, TypeQ4_1)
DEQUANT_ROWS(Q5_0, TypeQ5_0)
DEQUANT_ROWS(Q5_1, TypeQ5_1)
DEQUANT_ROWS(Q2_K, TypeQ2_K)
DEQUANT_ROWS(Q3_K, TypeQ3_K)
DEQUANT_ROWS(Q4_K, TypeQ4_K)
DEQUANT_ROWS(Q5_K, TypeQ5_K)
DEQUANT_ROWS(Q6_K, TypeQ6_K)
DEQUANT_ROWS(IQ4_NL, TypeIQ4_NL)
DEQUANT_ROWS(IQ4_XS, TypeIQ4_XS)
