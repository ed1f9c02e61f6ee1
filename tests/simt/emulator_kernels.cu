// Kernels for the SIMT emulator's own tests (tests/simt/test_emulator.py): each exercises
// one rule of CUDA's execution model, or breaks it on purpose.
#define FULL 0xffffffffu

// ---- warp collectives: every lane writes what it got ------------------------------------------
extern "C" __global__ void shuffles(const int* v, int* out, int kind, int arg, int width) {
    int t = threadIdx.x, x = v[t];
    int r = 0;
    if (kind == 0) r = __shfl_sync(FULL, x, arg, width);
    if (kind == 1) r = __shfl_up_sync(FULL, x, (unsigned)arg, width);
    if (kind == 2) r = __shfl_down_sync(FULL, x, (unsigned)arg, width);
    if (kind == 3) r = __shfl_xor_sync(FULL, x, arg, width);
    out[t] = r;
}

extern "C" __global__ void votes(const int* v, unsigned* out) {
    int t = threadIdx.x, lane = t & 31;
    unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;  // two groups of 16 lanes
    out[5 * t] = __ballot_sync(FULL, v[t] > 0);
    out[5 * t + 1] = __any_sync(half, v[t] > 0);
    out[5 * t + 2] = __all_sync(half, v[t] > 0);
    out[5 * t + 3] = (unsigned)__reduce_add_sync(FULL, v[t]);
    out[5 * t + 4] = (unsigned)__reduce_max_sync(half, v[t]);
    __syncwarp();
}

extern "C" __global__ void shuffle_doubles(const double* v, double* out) {
    out[threadIdx.x] = __shfl_down_sync(FULL, v[threadIdx.x], 3);
}

// ---- a block's sum: warp sums, then warp 0 adds the warps' partial sums --------------------------
__device__ __forceinline__ float warp_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(FULL, v, m);
    return v;
}

extern "C" __global__ void __launch_bounds__(256) block_sum(const float* x, float* out, int n,
                                                            int with_barrier) {
    __shared__ float part[8];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) v += x[(long long)blockIdx.x * n + i];
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    if (with_barrier) __syncthreads();  // uniform: every thread takes the same branch
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) out[blockIdx.x] = v;
    }
}

// ---- broken on purpose -------------------------------------------------------------------------
extern "C" __global__ void barrier_in_branch(int* out) {
    if (threadIdx.x < 32) {
        __syncthreads();
        out[threadIdx.x] = 1;
    }
    __syncthreads();
}

extern "C" __global__ void early_exit_then_barrier(int* out, int n) {
    __shared__ int seen[64];
    if ((int)threadIdx.x >= n) return;  // exited threads do not hold the barrier up
    seen[threadIdx.x] = (int)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = seen[n - 1 - threadIdx.x];
}

extern "C" __global__ void shuffle_outside_mask(const int* v, int* out) {
    // lanes 0..15 shuffle among themselves, but xor 16 reads lanes 16..31
    if ((threadIdx.x & 31) < 16) out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, v[threadIdx.x], 16);
}

extern "C" __global__ void caller_outside_mask(const int* v, int* out) {
    out[threadIdx.x] = __shfl_sync(0x0000ffffu, v[threadIdx.x], 0);
}

extern "C" __global__ void mask_names_an_exited_lane(const int* v, int* out) {
    if ((threadIdx.x & 31) == 31) return;
    out[threadIdx.x] = __shfl_xor_sync(FULL, v[threadIdx.x], 1);
}

extern "C" __global__ void divergent_shuffles(const int* v, int* out) {
    int x = v[threadIdx.x];
    if (threadIdx.x & 1) {
        x = __shfl_xor_sync(FULL, x, 1);
    } else {
        x = __shfl_xor_sync(FULL, x, 2);
    }
    out[threadIdx.x] = x;
}

extern "C" __global__ void shuffle_against_barrier(int* out) {
    if (threadIdx.x == 0) {
        out[0] = __shfl_sync(FULL, 1, 0);
    } else {
        __syncthreads();
    }
}

extern "C" __global__ void partial_warp_full_mask(int* out) {
    out[threadIdx.x] = __shfl_xor_sync(FULL, (int)threadIdx.x, 1);  // a block of 48 threads
}

extern "C" __global__ void shared_overflow(int* out, int n) {
    __shared__ int s[32];
    s[threadIdx.x] = (int)threadIdx.x;  // n threads: past the end when n > 32
    __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % n];
}

extern "C" __global__ void too_much_shared(float* out) {
    __shared__ float big[8192];  // 32 KiB: with 24 KiB of dynamic shared memory, too much
    extern __shared__ float dyn[];
    big[threadIdx.x] = 1.0f;
    dyn[threadIdx.x] = 2.0f;
    out[threadIdx.x] = big[threadIdx.x] + dyn[threadIdx.x];
}

extern "C" __global__ void trapped(int* out) {
    if (threadIdx.x == 5) __trap();
    out[threadIdx.x] = 1;
}

// ---- shared memory, dynamic and static --------------------------------------------------------
extern __shared__ float file_scope_dynamic[];

extern "C" __global__ void reverse_in_dynamic_shared(const float* x, float* out, int n) {
    extern __shared__ float buf[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[blockIdx.x * n + i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        out[blockIdx.x * n + i] = file_scope_dynamic[n - 1 - i];  // the same memory
    }
}

extern "C" __global__ void unwritten_shared(float* out) {
    __shared__ float never[4];
    out[threadIdx.x] = never[threadIdx.x & 3];
}

// ---- atomics, integer and half-precision intrinsics -------------------------------------------
extern "C" __global__ void tickets(int* counter, int* order) {
    int t = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    order[t] = atomicAdd(counter, 1);  // the order in which threads ran
}

extern "C" __global__ void atomics(float* fsum, unsigned* umax, int* imin, unsigned long long* cas) {
    int t = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    atomicAdd(fsum, 0.5f);
    atomicMax(umax, (unsigned)t);
    atomicMin(imin, -t);
    unsigned long long old = *cas, seen;
    do {
        seen = old;
        old = atomicCAS(cas, seen, seen + (unsigned long long)t);
    } while (old != seen);
}

extern "C" __global__ void intrinsics(const int* a, const int* b, int* dots, const float* f,
                                      unsigned short* halves, float* back, unsigned short* bf,
                                      long long n) {
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        dots[i] = __dp4a(a[i], b[i], (int)i);
        __half h = __float2half_rn(f[i]);
        halves[i] = __half_as_ushort(h);
        back[i] = __half2float(h);
        bf[i] = __float2bfloat16_rn(f[i]).__x;
    }
}

extern "C" __global__ void indices(unsigned* out) {
    unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned at = 4 * (b * blockDim.x * blockDim.y * blockDim.z + t);
    out[at] = threadIdx.x + 16 * threadIdx.y + 256 * threadIdx.z;
    out[at + 1] = blockIdx.x + 16 * blockIdx.y + 256 * blockIdx.z;
    out[at + 2] = blockDim.x + 16 * blockDim.y + 256 * blockDim.z;
    out[at + 3] = gridDim.x + 16 * gridDim.y + 256 * gridDim.z;
}

extern "C" __global__ void scalars(signed char c, unsigned short s, long long l, double d, float* out) {
    out[0] = (float)c;
    out[1] = (float)s;
    out[2] = (float)l;
    out[3] = (float)d;
}
