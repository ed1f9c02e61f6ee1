// simt.h: a SIMT emulator for CUDA C++ kernels on an x86-64 CPU (tests only).
//
// This file: the qualifiers and built-in types; then its parts, in order: simt_state.h
// (threads, warps, the block, errors), simt_fiber.h (stacks and switching), simt_sync.h
// (barriers and warp collectives), simt_block.h (shared memory, the scheduler),
// simt_device.h (the device API kernels call) and simt_launch.h (simt_launch).
//
// The loader (loader.py) compiles a .cu file with g++ and this header force-included
// (-include simt.h), after rewriting each __shared__ declaration into a call of
// shared_var / dynamic_shared below (rewrite.py), and launches its __global__ functions
// through simt_launch. Every CUDA thread of a block is a fiber with a stack of its own;
// a block's fibers run one at a time on the calling OS thread and switch only where
// CUDA threads wait for each other:
//
//   __syncthreads()   releases when every live (not exited) thread of the block waits
//                     at it; threads waiting at different call sites, or at a different
//                     count of barriers passed, are an error (a barrier in a branch).
//   warp collectives  __shfl_sync / _up / _down / _xor, __ballot_sync, __any_sync,
//                     __all_sync, __syncwarp, __reduce_{add,min,max}_sync: release when
//                     every lane of the mask has arrived at the same call with the same
//                     mask. A caller outside its mask, a mask naming a lane that has
//                     exited or that the block does not have, lanes of one mask at
//                     different calls, and a shuffle reading a lane outside the mask
//                     are errors (CUDA leaves them undefined), not numbers.
//   deadlock          no thread can run while some have not exited: an error that
//                     lists what each waiting thread waits for.
//
// Which thread runs next is the launch's thread order: forward (lowest index first),
// reverse, or a seeded random permutation per scheduling round; blocks run in the same
// order. A kernel whose result depends on the order has a race (a missing barrier).
// Shared memory is allocated per block (fresh, every byte 0xff: a float read before it
// is written is a NaN); writes past an array's end are reported at the end of the block
// (canaries), and under -fsanitize=address every access outside it is reported by ASan.
//
// Fibers switch with a few instructions of our own (simt_fiber_switch below), not
// ucontext: glibc's swapcontext makes two system calls per switch (~600 ns measured
// here, against a few ns), and a model's decode step switches tens of millions of times.
//
// Not emulated: memory ordering between threads other than at barriers (fibers switch
// only at the points above, so a data race shows as an order-dependent result, not as a
// torn value), the 32-bit float flush-to-zero of -ftz=true, fast-math intrinsics' error
// (__expf is expf), register and occupancy limits, streams (a launch runs to completion).
#pragma once

#if !defined(__x86_64__)
#error "simt.h switches fibers with x86-64 code"
#endif

#include <assert.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SIMT_ASAN 1
#else
#define SIMT_ASAN 0
#endif

#define SIMT_EMULATOR 1
#ifndef __CUDACC__
#define __CUDACC__ 1  // device code compiles; __CUDA_ARCH__ stays undefined (host paths)
#endif

// ---- qualifiers --------------------------------------------------------------------------
#ifdef SIMT_DISCOVER  // the loader's first pass (g++ -E): kernels and their launch bounds
#define __global__ SIMT_GLOBAL_KERNEL
#define __launch_bounds__(...) SIMT_LAUNCH_BOUNDS(__VA_ARGS__)
#else
#define __global__
#define __launch_bounds__(...)
#endif
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
// The loader rewrites every __shared__ declaration; one it missed fails to compile here.
#define __shared__ SIMT_SHARED_DECLARATION_NOT_REWRITTEN

// ---- built-in types ------------------------------------------------------------------------
struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

#include "simt_state.h"
#include "simt_fiber.h"
#include "simt_sync.h"
#include "simt_block.h"
#include "simt_device.h"
#include "simt_launch.h"
