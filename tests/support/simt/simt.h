// simt.h: a SIMT emulator for CUDA C++ kernels on an x86-64 CPU (tests only).
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

namespace simt {
namespace detail {

struct Site {
    const char* file;
    int line;
};
#define SIMT_HERE (::simt::detail::Site{__FILE__, __LINE__})

inline bool same_site(Site a, Site b) {
    return a.line == b.line && (a.file == b.file || strcmp(a.file, b.file) == 0);
}

enum Wait : int {
    W_NONE,
    W_BARRIER,
    W_SHFL_IDX,
    W_SHFL_UP,
    W_SHFL_DOWN,
    W_SHFL_XOR,
    W_BALLOT,
    W_ANY,
    W_ALL,
    W_SYNCWARP,
    W_RED_ADD,
    W_RED_MIN_S,
    W_RED_MAX_S,
    W_RED_MIN_U,
    W_RED_MAX_U,
};

inline const char* wait_name(int w) {
    static const char* names[] = {
        "nothing",          "__syncthreads",    "__shfl_sync",      "__shfl_up_sync",
        "__shfl_down_sync", "__shfl_xor_sync",  "__ballot_sync",    "__any_sync",
        "__all_sync",       "__syncwarp",       "__reduce_add_sync", "__reduce_min_sync",
        "__reduce_max_sync", "__reduce_min_sync", "__reduce_max_sync"};
    return names[w];
}

enum State : int { READY, BLOCKED, EXITED };

struct Thread {
    void* sp;  // saved stack pointer while switched out
    char* stack;  // lowest usable address of its stack
    uint3 idx;
    unsigned linear, lane;
    int state;
    int wait;  // Wait, while BLOCKED
    Site site;
    unsigned mask;
    int arg, width;
    uint64_t in, out;  // a collective's operand and result
    unsigned long long barriers;  // __syncthreads passed
    void* fake_stack;  // ASan's, across switches
};

// A warp collective some lanes of a warp have arrived at (lanes of other masks may
// wait at other calls at the same time).
struct Pending {
    int kind;
    Site site;
    unsigned mask, arrived;
};

struct Warp {
    unsigned exited, at_barrier;  // lanes
    int n_pending;
    Pending pending[32];
};

struct SharedArray {
    char* base;  // the allocation
    char* data;  // what the kernel sees
    size_t bytes;
    const char* name;
};

constexpr unsigned char CANARY_BYTE = 0xc3;  // around each shared array (no ASan)
constexpr size_t SHARED_LIMIT = 48 * 1024;  // per block, without cudaFuncSetAttribute
#ifndef SIMT_STACK_BYTES
#define SIMT_STACK_BYTES (SIMT_ASAN ? 512 * 1024 : 64 * 1024)
#endif
constexpr size_t STACK_BYTES = SIMT_STACK_BYTES;

struct Emulator {
    // the launch
    void (*invoke)(void**) = nullptr;
    void** args = nullptr;
    dim3 grid, block;
    uint3 block_idx;
    int order = 0;  // 0 forward, 1 reverse, 2 random
    uint64_t rng = 0;
    size_t dynamic_bytes = 0;
    // the block
    std::vector<Thread> threads;
    std::vector<Warp> warps;
    std::vector<unsigned> perm;  // the current round's order of threads
    unsigned round_at = 0;  // the next position of `perm` to look at
    unsigned n_threads = 0, live = 0, at_barrier = 0;
    Site barrier_site{"", 0};
    unsigned long long barrier_count = 0;
    std::vector<SharedArray> shared;  // by slot (shared_var), plus the dynamic array
    SharedArray dynamic{nullptr, nullptr, 0, "extern __shared__"};
    size_t shared_bytes = 0, arena_used = 0;
    Thread* cur = nullptr;
    // fibers
    void* sched_sp = nullptr;
    char* stacks = nullptr;
    size_t n_stacks = 0;
    bool stacks_dirty = false;  // a failed launch abandoned fibers mid-way
    const void* sched_stack_bottom = nullptr;
    size_t sched_stack_size = 0;
    // outcome
    bool failed = false;
    std::string error;
    int slots = 0;  // shared_var slots handed out
};

static Emulator g;  // one per module (each .so is one translation unit)
static std::mutex g_lock;  // one launch at a time in a module

}  // namespace detail
}  // namespace simt

// ---- fiber switch (x86-64 System V) ------------------------------------------------------
// simt_fiber_switch(save, load): pushes the callee-saved registers on the current stack,
// stores the stack pointer in *save, continues on the stack `load` (popping its
// registers and returning to where it switched out). A new fiber's stack is laid out as
// if it had switched out just before simt_fiber_entry.
extern "C" void simt_fiber_switch(void** save, void* load) __attribute__((visibility("hidden")));
extern "C" void simt_fiber_entry() __attribute__((visibility("hidden")));
extern "C" void simt_fiber_main() __attribute__((visibility("hidden"), noreturn, used));
__asm__(
    ".text\n"
    ".globl simt_fiber_switch\n"
    ".hidden simt_fiber_switch\n"
    ".type simt_fiber_switch,@function\n"
    ".p2align 4\n"
    "simt_fiber_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size simt_fiber_switch,.-simt_fiber_switch\n"
    ".globl simt_fiber_entry\n"
    ".hidden simt_fiber_entry\n"
    ".type simt_fiber_entry,@function\n"
    ".p2align 4\n"
    "simt_fiber_entry:\n"
    "    xorl %ebp, %ebp\n"
    "    call simt_fiber_main\n"
    "    ud2\n"
    ".size simt_fiber_entry,.-simt_fiber_entry\n");

namespace simt {
namespace detail {

// ---- errors ------------------------------------------------------------------------------
__attribute__((format(printf, 1, 2))) inline std::string format(const char* fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

inline std::string where(const Thread* t) {
    return format("thread (%u,%u,%u) of block (%u,%u,%u)", t->idx.x, t->idx.y, t->idx.z,
                  g.block_idx.x, g.block_idx.y, g.block_idx.z);
}

[[noreturn]] inline void leave_for_good();

// Record the launch's error; from a fiber, leave it for good (the launch stops).
inline void fail_msg(const std::string& msg) {
    if (!g.failed) {
        g.failed = true;
        g.error = msg;
    }
    if (g.cur != nullptr) leave_for_good();
}

#define SIMT_FAIL(...) ::simt::detail::fail_msg(::simt::detail::format(__VA_ARGS__))

// ---- fibers --------------------------------------------------------------------------------
inline void asan_start_switch(void** fake_save, const void* bottom, size_t size) {
#if SIMT_ASAN
    __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
    (void)fake_save, (void)bottom, (void)size;
#endif
}

inline void asan_finish_switch(void* fake, const void** bottom_old, size_t* size_old) {
#if SIMT_ASAN
    __sanitizer_finish_switch_fiber(fake, bottom_old, size_old);
#else
    (void)fake, (void)bottom_old, (void)size_old;
#endif
}

// The next thread of the current scheduling round that can run, if any.
inline Thread* next_ready() {
    while (g.round_at < g.n_threads) {
        Thread* t = &g.threads[g.perm[g.round_at++]];
        if (t->state == READY) return t;
    }
    return nullptr;
}

// Leave the running fiber for the next ready one of the round, or for the scheduler (end
// of the round, or a failure). `dying`: the fiber will not run again.
inline void switch_away(bool dying) {
    Thread* me = g.cur;
    Thread* next = g.failed ? nullptr : next_ready();
    void* dead = nullptr;
    void** save = dying ? &dead : &me->sp;
    void** fake = dying ? nullptr : &me->fake_stack;
    if (next != nullptr) {
        g.cur = next;
        asan_start_switch(fake, next->stack, STACK_BYTES);
        simt_fiber_switch(save, next->sp);
    } else {
        g.cur = nullptr;
        asan_start_switch(fake, g.sched_stack_bottom, g.sched_stack_size);
        simt_fiber_switch(save, g.sched_sp);
    }
    asan_finish_switch(me->fake_stack, nullptr, nullptr);  // resumed by another fiber
}

// Wait (the thread is BLOCKED): returns when a release made it READY and a round ran it.
inline void yield_to_scheduler() { switch_away(false); }

[[noreturn]] inline void leave_for_good() {
    switch_away(true);
    __builtin_unreachable();
}

inline size_t page_size() {
    static const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return page;
}

inline char* stack_of(size_t i) {
    size_t page = page_size();
    return g.stacks + i * (STACK_BYTES + page) + page;
}

inline void ensure_stacks(size_t n) {
    if (n <= g.n_stacks) return;
    size_t page = page_size();
    size_t each = STACK_BYTES + page;  // a guard page below each stack
    if (g.stacks != nullptr) {
        // ASan keeps a region's poison past munmap: the next mapping there (a model
        // file, say) would inherit our fibers' frames
        for (size_t i = 0; i < g.n_stacks; ++i) {
#if SIMT_ASAN
            ASAN_UNPOISON_MEMORY_REGION(stack_of(i), STACK_BYTES);
#endif
        }
        munmap(g.stacks, g.n_stacks * each);
    }
    void* p = mmap(nullptr, n * each, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        g.stacks = nullptr;
        g.n_stacks = 0;
        return;
    }
    g.stacks = (char*)p;
    g.n_stacks = n;
    for (size_t i = 0; i < n; ++i) mprotect(g.stacks + i * each, page, PROT_NONE);
}


// Lay out a new fiber's stack so that switching to it enters simt_fiber_entry.
inline void start_fiber(Thread* t) {
#if SIMT_ASAN
    // A fiber that returned from the kernel left poisoned only the frames it exits
    // through (near the top); after a failed launch, abandoned frames anywhere.
    size_t dirty = g.stacks_dirty ? STACK_BYTES : 16 * 1024;
    ASAN_UNPOISON_MEMORY_REGION(t->stack + STACK_BYTES - dirty, dirty);
#endif
    // stack tops at different offsets within a page, so that fibers' frames do not all
    // compete for the same cache sets
    uintptr_t color = (uintptr_t)((t->linear * 7u) % 61u) * 64u;
    uintptr_t top = ((uintptr_t)(t->stack + STACK_BYTES) & ~(uintptr_t)15) - 64 - color;
    void** sp = (void**)(top - 8);  // at simt_fiber_entry, rsp = sp + 56 = 16-aligned
    for (int i = 0; i < 6; ++i) sp[i] = nullptr;  // r15, r14, r13, r12, rbx, rbp
    sp[6] = (void*)&simt_fiber_entry;
    t->sp = sp;
    t->fake_stack = nullptr;
}

}  // namespace detail
}  // namespace simt

// ---- thread, block and grid indices --------------------------------------------------------
#define threadIdx (::simt::detail::g.cur->idx)
#define blockIdx (::simt::detail::g.block_idx)
#define blockDim (::simt::detail::g.block)
#define gridDim (::simt::detail::g.grid)
#define warpSize 32

namespace simt {
namespace detail {

// ---- __syncthreads -------------------------------------------------------------------------
inline void release_barrier() {
    for (Warp& w : g.warps) w.at_barrier = 0;
    for (unsigned i = 0; i < g.n_threads; ++i) {
        Thread& t = g.threads[i];
        if (t.state == BLOCKED && t.wait == W_BARRIER) {
            t.state = READY;
            t.wait = W_NONE;
            t.barriers += 1;
        }
    }
    g.at_barrier = 0;
}

inline void syncthreads(Site s) {
    Thread* me = g.cur;
    Warp& w = g.warps[me->linear >> 5];
    for (int i = 0; i < w.n_pending; ++i) {
        const Pending& p = w.pending[i];
        if ((p.mask >> me->lane) & 1u) {
            SIMT_FAIL("%s waits at __syncthreads (%s:%d) while lanes 0x%08x of its warp wait for it "
                      "at %s (%s:%d, mask 0x%08x), so neither can go on",
                      where(me).c_str(), s.file, s.line, p.arrived, wait_name(p.kind), p.site.file,
                      p.site.line, p.mask);
        }
    }
    if (g.at_barrier > 0) {
        if (!same_site(g.barrier_site, s)) {
            SIMT_FAIL("divergent __syncthreads: %s waits at %s:%d while %u thread(s) wait at %s:%d",
                      where(me).c_str(), s.file, s.line, g.at_barrier, g.barrier_site.file,
                      g.barrier_site.line);
        }
        if (me->barriers != g.barrier_count) {
            SIMT_FAIL("divergent __syncthreads at %s:%d: %s has passed %llu barriers, the threads "
                      "waiting there %llu",
                      s.file, s.line, where(me).c_str(), me->barriers, g.barrier_count);
        }
    } else {
        g.barrier_site = s;
        g.barrier_count = me->barriers;
    }
    g.at_barrier += 1;
    if (g.at_barrier == g.live) {
        release_barrier();
        me->barriers += 1;
        return;
    }
    me->state = BLOCKED;
    me->wait = W_BARRIER;
    me->site = s;
    me->mask = 0;
    w.at_barrier |= 1u << me->lane;
    yield_to_scheduler();
}

// ---- warp collectives ----------------------------------------------------------------------
inline unsigned warp_lanes(unsigned base) {
    unsigned n = g.n_threads - base;
    return n >= 32 ? 0xffffffffu : ((1u << n) - 1u);
}

inline uint64_t result_of(int kind, unsigned lane, unsigned mask, unsigned base, int arg, int width) {
    Thread* ts = &g.threads[base];
    Thread* me = &ts[lane];
    switch (kind) {
        case W_SHFL_IDX:
        case W_SHFL_UP:
        case W_SHFL_DOWN:
        case W_SHFL_XOR: {
            // PTX shfl.sync with CUDA's clamp values: segmask = 32 - width
            int seg = 32 - width, b = arg & 31, l = (int)lane;
            int clamp = kind == W_SHFL_UP ? 0 : 31;
            int max_lane = (l & seg) | (clamp & ~seg), min_lane = l & seg;
            int j;
            bool ok;
            if (kind == W_SHFL_UP) {
                j = l - b;
                ok = j >= max_lane;
            } else if (kind == W_SHFL_DOWN) {
                j = l + b;
                ok = j <= max_lane;
            } else if (kind == W_SHFL_XOR) {
                j = l ^ b;
                ok = j <= max_lane;
            } else {
                j = min_lane | (b & ~seg);
                ok = j <= max_lane;
            }
            if (!ok) j = l;
            if (j != l && !((mask >> j) & 1u)) {
                SIMT_FAIL("%s at %s:%d: lane %d reads lane %d, which is not in the mask 0x%08x "
                          "(an undefined value on a GPU)",
                          wait_name(kind), me->site.file, me->site.line, l, j, mask);
            }
            return ts[j].in;
        }
        case W_BALLOT:
        case W_ANY:
        case W_ALL: {
            unsigned bits = 0;
            for (unsigned m = mask; m; m &= m - 1) {
                unsigned l = (unsigned)__builtin_ctz(m);
                if (ts[l].in) bits |= 1u << l;
            }
            if (kind == W_BALLOT) return bits;
            if (kind == W_ANY) return bits != 0;
            return bits == mask;
        }
        case W_SYNCWARP:
            return 0;
        default: {  // reductions over 32-bit values
            uint64_t acc = kind == W_RED_ADD ? 0 : ts[__builtin_ctz(mask)].in;
            for (unsigned m = mask; m; m &= m - 1) {
                uint32_t v = (uint32_t)ts[__builtin_ctz(m)].in;
                if (kind == W_RED_ADD) acc = (uint32_t)(acc + v);
                if (kind == W_RED_MIN_S && (int32_t)v < (int32_t)acc) acc = v;
                if (kind == W_RED_MAX_S && (int32_t)v > (int32_t)acc) acc = v;
                if (kind == W_RED_MIN_U && v < (uint32_t)acc) acc = v;
                if (kind == W_RED_MAX_U && v > (uint32_t)acc) acc = v;
            }
            return acc;
        }
    }
}

inline uint64_t collective(int kind, Site s, unsigned mask, uint64_t value, int arg, int width) {
    Thread* me = g.cur;
    unsigned lane = me->lane, base = me->linear - lane;
    Warp& w = g.warps[me->linear >> 5];
    if (!((mask >> lane) & 1u)) {
        SIMT_FAIL("%s at %s:%d: %s (lane %u) calls it with mask 0x%08x, which does not name it",
                  wait_name(kind), s.file, s.line, where(me).c_str(), lane, mask);
    }
    unsigned have = warp_lanes(base);
    if (mask & ~have) {
        SIMT_FAIL("%s at %s:%d: mask 0x%08x names lanes the warp does not have (a block of %u "
                  "threads: lanes 0x%08x)",
                  wait_name(kind), s.file, s.line, mask, g.n_threads, have);
    }
    if (width < 1 || width > 32 || (width & (width - 1))) {
        SIMT_FAIL("%s at %s:%d: width %d is not a power of 2 up to 32", wait_name(kind), s.file,
                  s.line, width);
    }
    if (mask & w.exited) {
        SIMT_FAIL("%s at %s:%d with mask 0x%08x: lane(s) 0x%08x have exited (%s); every lane of "
                  "the mask must take part",
                  wait_name(kind), s.file, s.line, mask, mask & w.exited, where(me).c_str());
    }
    if (mask & w.at_barrier) {
        SIMT_FAIL("%s at %s:%d with mask 0x%08x: lane(s) 0x%08x wait at __syncthreads, so neither "
                  "can go on (%s)",
                  wait_name(kind), s.file, s.line, mask, mask & w.at_barrier, where(me).c_str());
    }
    me->wait = kind;
    me->site = s;
    me->mask = mask;
    me->in = value;
    me->arg = arg;
    me->width = width;
    // Join the pending call of this site with this mask. Lanes of other masks may wait at
    // other calls meanwhile (a GPU schedules them independently); but lanes of one mask at
    // two calls, or one call made with two masks, are divergent.
    Pending* p = nullptr;
    for (int i = 0; i < w.n_pending; ++i) {
        Pending& q = w.pending[i];
        bool same_call = q.kind == kind && same_site(q.site, s);
        if (same_call && q.mask == mask) {
            p = &q;
        } else if ((same_call && (q.mask & mask)) || (!same_call && q.mask == mask)) {
            SIMT_FAIL("divergent warp collectives: lane %u at %s (%s:%d, mask 0x%08x) while lanes "
                      "0x%08x wait at %s (%s:%d, mask 0x%08x) (%s)",
                      lane, wait_name(kind), s.file, s.line, mask, q.arrived, wait_name(q.kind),
                      q.site.file, q.site.line, q.mask, where(me).c_str());
        }
    }
    if (p == nullptr) {
        p = &w.pending[w.n_pending++];
        *p = Pending{kind, s, mask, 0};
    }
    p->arrived |= 1u << lane;
    if (p->arrived != mask) {
        me->state = BLOCKED;
        yield_to_scheduler();
        return me->out;
    }
    *p = w.pending[--w.n_pending];  // complete: no longer pending
    for (unsigned m = mask; m; m &= m - 1) {
        unsigned l = (unsigned)__builtin_ctz(m);
        g.threads[base + l].out = result_of(kind, l, mask, base, arg, width);
    }
    for (unsigned m = mask; m; m &= m - 1) {
        Thread* o = &g.threads[base + __builtin_ctz(m)];
        o->wait = W_NONE;
        o->state = READY;
    }
    return me->out;
}

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "a warp shuffle moves a value of at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}

template <class T>
inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}

template <class T>
inline T shuffle(int kind, Site s, unsigned mask, T v, int arg, int width) {
    return from_bits<T>(collective(kind, s, mask, to_bits(v), arg, width));
}

// A thread has returned from the kernel.
inline void thread_exit_checks(Thread* me) {
    Warp& w = g.warps[me->linear >> 5];
    for (int i = 0; i < w.n_pending; ++i) {
        const Pending& p = w.pending[i];
        if ((p.mask >> me->lane) & 1u) {
            SIMT_FAIL("%s exits while lanes 0x%08x wait for it at %s (%s:%d, mask 0x%08x)",
                      where(me).c_str(), p.arrived, wait_name(p.kind), p.site.file, p.site.line,
                      p.mask);
        }
    }
    w.exited |= 1u << me->lane;
}

// ---- shared memory -------------------------------------------------------------------------
inline int new_slot() { return g.slots++; }

// Shared arrays of a block live in an arena of our own (not the malloc heap, which a
// stray write would corrupt): [lead canary][array][trail canary, as long as the array]
// ... [a final zone of canary], every canary checked at the end of the block. Under ASan
// each array is an allocation of its own, so that ASan sees every access outside it.
constexpr size_t LEAD = 256, TAIL_ZONE = 16 * 1024, ARENA = 1 << 20;

inline char* arena() {
    static char* base = nullptr;
    if (base == nullptr) {
        size_t page = page_size();
        void* p = mmap(nullptr, ARENA + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return nullptr;
        mprotect((char*)p + ARENA, page, PROT_NONE);  // past everything: a fault, not a write
        base = (char*)p;
    }
    return base;
}

inline SharedArray allocate_shared(size_t bytes, size_t align, const char* name) {
    if (align < 16) align = 16;
    g.shared_bytes += (bytes + align - 1) / align * align;
    if (g.shared_bytes > SHARED_LIMIT) {
        SIMT_FAIL("block (%u,%u,%u) uses %zu bytes of shared memory (with %s), more than the %zu "
                  "a launch may use without opting in",
                  g.block_idx.x, g.block_idx.y, g.block_idx.z, g.shared_bytes, name, SHARED_LIMIT);
    }
    SharedArray a{nullptr, nullptr, bytes, name};
#if SIMT_ASAN
    void* p = nullptr;
    if (posix_memalign(&p, align, bytes ? bytes : 1) != 0) SIMT_FAIL("out of memory");
    a.base = a.data = (char*)p;
#else
    char* base = arena();
    if (base == nullptr) SIMT_FAIL("no memory for shared arrays");
    size_t trail = bytes > LEAD ? bytes : LEAD;
    size_t at = (g.arena_used + LEAD + align - 1) / align * align;
    if (at + bytes + trail + TAIL_ZONE > ARENA) SIMT_FAIL("the shared-memory arena is full");
    a.base = base + g.arena_used;
    a.data = base + at;
    memset(a.base, CANARY_BYTE, (size_t)(a.data - a.base));
    memset(a.data + bytes, CANARY_BYTE, trail + TAIL_ZONE);  // the next array overwrites
    g.arena_used = at + bytes + trail;
#endif
    memset(a.data, 0xff, bytes);  // leftovers: every float a NaN
    return a;
}

inline bool canaries_intact(const char* from, const char* to) {
    for (const char* p = from; p < to; ++p) {
        if ((unsigned char)*p != CANARY_BYTE) return false;
    }
    return true;
}

// Check a shared array's canaries (a write outside it), then let it go.
inline void free_shared(SharedArray& a) {
    if (a.base == nullptr) return;
#if SIMT_ASAN
    free(a.base);
#else
    size_t trail = a.bytes > LEAD ? a.bytes : LEAD;
    bool ok = canaries_intact(a.base, a.data) && canaries_intact(a.data + a.bytes, a.data + a.bytes + trail);
    if (!ok && !g.failed) {
        g.failed = true;
        g.error = format("block (%u,%u,%u) wrote outside shared array %s (%zu bytes)",
                         g.block_idx.x, g.block_idx.y, g.block_idx.z, a.name, a.bytes);
    }
#endif
    a.base = a.data = nullptr;
}

inline char* shared_at(int slot, size_t bytes, size_t align, const char* name) {
    if ((size_t)slot >= g.shared.size()) g.shared.resize((size_t)slot + 1, SharedArray{});
    SharedArray& a = g.shared[(size_t)slot];
    if (a.base == nullptr) a = allocate_shared(bytes, align, name);
    return a.data;
}

// `__shared__ T name;` in a function becomes `T& name = shared_var<T, ID>("name");`: one
// object per block, fresh (0xff bytes) in every block.
template <class T, int ID>
inline T& shared_var(const char* name) {
    static const int slot = new_slot();
    return *reinterpret_cast<T*>(shared_at(slot, sizeof(T), alignof(T), name));
}

// `extern __shared__ T name[];`: the launch's dynamic shared memory.
inline void* dynamic_shared() {
    if (g.dynamic.base == nullptr) g.dynamic = allocate_shared(g.dynamic_bytes, 256, "extern __shared__");
    return g.dynamic.data;
}

inline void end_block_shared() {
    for (SharedArray& a : g.shared) free_shared(a);
    free_shared(g.dynamic);
#if !SIMT_ASAN
    if (g.arena_used > 0 && !canaries_intact(arena() + g.arena_used, arena() + g.arena_used + TAIL_ZONE) &&
        !g.failed) {
        g.failed = true;
        g.error = format("block (%u,%u,%u) wrote past its last shared array", g.block_idx.x,
                         g.block_idx.y, g.block_idx.z);
    }
#endif
    g.arena_used = 0;
    g.shared_bytes = 0;
}

// ---- the scheduler -------------------------------------------------------------------------
inline uint64_t next_random() {  // splitmix64
    uint64_t z = (g.rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

inline void make_order(std::vector<unsigned>& perm, unsigned n) {
    perm.resize(n);
    for (unsigned i = 0; i < n; ++i) perm[i] = g.order == 1 ? n - 1 - i : i;
    if (g.order == 2) {
        for (unsigned i = n; i > 1; --i) std::swap(perm[i - 1], perm[next_random() % i]);
    }
}

inline std::string describe_waits() {
    std::string out;
    int shown = 0;
    for (unsigned i = 0; i < g.n_threads && shown < 8; ++i) {
        Thread& t = g.threads[i];
        if (t.state != BLOCKED) continue;
        out += format("; thread %u waits at %s (%s:%d, mask 0x%08x)", i, wait_name(t.wait),
                      t.site.file, t.site.line, t.mask);
        ++shown;
    }
    return out;
}

inline void run_block() {
    unsigned n = g.block.x * g.block.y * g.block.z;
    g.n_threads = n;
    if (g.threads.size() < n) g.threads.resize(n);
    for (unsigned i = 0; i < n; ++i) {
        Thread& t = g.threads[i];
        t.idx = uint3{i % g.block.x, (i / g.block.x) % g.block.y, i / (g.block.x * g.block.y)};
        t.linear = i;
        t.lane = i & 31u;
        t.state = READY;
        t.wait = W_NONE;
        t.mask = 0;
        t.barriers = 0;
        t.stack = stack_of(i);
        start_fiber(&t);
    }
    g.warps.assign((n + 31) / 32, Warp{0, 0, 0, {}});
    g.live = n;
    g.at_barrier = 0;
    for (;;) {
        // a round: every thread that can run, in the order; a fiber that waits or exits
        // passes control to the next ready one itself, the last back to here
        make_order(g.perm, n);
        g.round_at = 0;
        Thread* t = next_ready();
        if (t != nullptr) {
            g.cur = t;
            void* sched_fake = nullptr;
            asan_start_switch(&sched_fake, t->stack, STACK_BYTES);
            simt_fiber_switch(&g.sched_sp, t->sp);
            asan_finish_switch(sched_fake, nullptr, nullptr);
            g.cur = nullptr;
        }
        if (g.failed || g.live == 0) return;
        if (t == nullptr) {
            g.failed = true;
            g.error = format("deadlock in block (%u,%u,%u): %u live threads, none can go on%s",
                             g.block_idx.x, g.block_idx.y, g.block_idx.z, g.live,
                             describe_waits().c_str());
            return;
        }
    }
}

}  // namespace detail
}  // namespace simt

namespace simt {
namespace detail {

[[noreturn]] inline void thread_exit() {
    Thread* me = g.cur;
    thread_exit_checks(me);
    me->state = EXITED;
    g.live -= 1;
    if (g.at_barrier > 0 && g.at_barrier == g.live) release_barrier();
    leave_for_good();
}

}  // namespace detail
}  // namespace simt

// A fiber's first instructions (from simt_fiber_entry): run the kernel as its thread.
extern "C" void simt_fiber_main() {
    using namespace simt::detail;
    asan_finish_switch(nullptr, nullptr, nullptr);
    g.invoke(g.args);
    thread_exit();
}

// ---- the CUDA device API -------------------------------------------------------------------
#define __syncthreads() ::simt::detail::syncthreads(SIMT_HERE)
#define __syncwarp(...) ::simt::detail::SyncWarp{SIMT_HERE}(__VA_ARGS__)
#define __shfl_sync(...) ::simt::detail::shfl(::simt::detail::W_SHFL_IDX, SIMT_HERE, __VA_ARGS__)
#define __shfl_up_sync(...) ::simt::detail::shfl(::simt::detail::W_SHFL_UP, SIMT_HERE, __VA_ARGS__)
#define __shfl_down_sync(...) \
    ::simt::detail::shfl(::simt::detail::W_SHFL_DOWN, SIMT_HERE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::simt::detail::shfl(::simt::detail::W_SHFL_XOR, SIMT_HERE, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
    ((unsigned)::simt::detail::collective(::simt::detail::W_BALLOT, SIMT_HERE, (mask), (pred) != 0, 0, 32))
#define __any_sync(mask, pred) \
    ((int)::simt::detail::collective(::simt::detail::W_ANY, SIMT_HERE, (mask), (pred) != 0, 0, 32))
#define __all_sync(mask, pred) \
    ((int)::simt::detail::collective(::simt::detail::W_ALL, SIMT_HERE, (mask), (pred) != 0, 0, 32))
#define __reduce_add_sync(mask, v) ::simt::detail::reduce(::simt::detail::W_RED_ADD, SIMT_HERE, (mask), (v))
#define __reduce_min_sync(mask, v) ::simt::detail::reduce_minmax(true, SIMT_HERE, (mask), (v))
#define __reduce_max_sync(mask, v) ::simt::detail::reduce_minmax(false, SIMT_HERE, (mask), (v))
#define __trap() SIMT_FAIL("__trap() in %s at %s:%d", ::simt::detail::where(::simt::detail::g.cur).c_str(), __FILE__, __LINE__)
#undef assert
#define assert(e)                                                                           \
    ((e) ? (void)0                                                                          \
         : SIMT_FAIL("assertion %s failed in %s at %s:%d", #e,                              \
                     ::simt::detail::where(::simt::detail::g.cur).c_str(), __FILE__, __LINE__))

namespace simt {
namespace detail {

struct SyncWarp {
    Site site;
    void operator()(unsigned mask = 0xffffffffu) const { collective(W_SYNCWARP, site, mask, 0, 0, 32); }
};

template <class T>
inline T shfl(int kind, Site s, unsigned mask, T v, int arg, int width = 32) {
    return shuffle<T>(kind, s, mask, v, arg, width);
}

template <class T>
inline T reduce(int kind, Site s, unsigned mask, T v) {
    static_assert(sizeof(T) == 4 && std::is_integral<T>::value, "32-bit integers");
    return (T)(uint32_t)collective(kind, s, mask, (uint32_t)v, 0, 32);
}

template <class T>
inline T reduce_minmax(bool min, Site s, unsigned mask, T v) {
    static_assert(sizeof(T) == 4 && std::is_integral<T>::value, "32-bit integers");
    int kind = std::is_signed<T>::value ? (min ? W_RED_MIN_S : W_RED_MAX_S)
                                        : (min ? W_RED_MIN_U : W_RED_MAX_U);
    return (T)(uint32_t)collective(kind, s, mask, (uint32_t)v, 0, 32);
}

}  // namespace detail
}  // namespace simt

// The lanes of the caller's warp that have not exited (a GPU may report fewer).
inline unsigned __activemask() {
    using namespace simt::detail;
    unsigned base = g.cur->linear - g.cur->lane, m = 0;
    for (unsigned l = 0; l < 32 && base + l < g.n_threads; ++l) {
        if (g.threads[base + l].state != EXITED) m |= 1u << l;
    }
    return m;
}
inline unsigned __lanemask_lt() { return (1u << simt::detail::g.cur->lane) - 1u; }

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(unsigned) {}
inline long long clock64() {
    static long long t = 0;
    return t += 1;
}
template <class T>
inline T __ldg(const T* p) {
    return *p;
}

// ---- atomics (a block's threads never switch inside one: each is atomic) --------------------
template <class T>
inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = (T)(old + v);
    return old;
}
template <class T>
inline T atomicSub(T* p, T v) {
    T old = *p;
    *p = (T)(old - v);
    return old;
}
template <class T>
inline T atomicExch(T* p, T v) {
    T old = *p;
    *p = v;
    return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
    T old = *p;
    if (v < old) *p = v;
    return old;
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}
template <class T>
inline T atomicCAS(T* p, T compare, T v) {
    T old = *p;
    if (old == compare) *p = v;
    return old;
}
template <class T>
inline T atomicAnd(T* p, T v) {
    T old = *p;
    *p = old & v;
    return old;
}
template <class T>
inline T atomicOr(T* p, T v) {
    T old = *p;
    *p = old | v;
    return old;
}
template <class T>
inline T atomicXor(T* p, T v) {
    T old = *p;
    *p = old ^ v;
    return old;
}
inline unsigned atomicInc(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = old >= v ? 0u : old + 1u;
    return old;
}
inline unsigned atomicDec(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = (old == 0u || old > v) ? v : old - 1u;
    return old;
}

// ---- integer intrinsics --------------------------------------------------------------------
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
    return c;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---- float intrinsics (correctly rounded on the host, as the _rn forms are on a GPU) ----------
inline float __int_as_float(int x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}
inline int __float_as_int(float f) {
    int x;
    memcpy(&x, &f, 4);
    return x;
}
inline float __uint_as_float(unsigned x) {
    float f;
    memcpy(&f, &x, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned x;
    memcpy(&x, &f, 4);
    return x;
}
inline double __longlong_as_double(long long x) {
    double d;
    memcpy(&d, &x, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long x;
    memcpy(&x, &d, 8);
    return x;
}
inline float __fadd_rn(float a, float b) {
    volatile float r = a + b;
    return r;
}
inline float __fsub_rn(float a, float b) {
    volatile float r = a - b;
    return r;
}
inline float __fmul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }
inline float __sinf(float a) { return sinf(a); }
inline float __cosf(float a) { return cosf(a); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __saturatef(float a) { return a < 0.0f ? 0.0f : (a > 1.0f ? 1.0f : (a == a ? a : 0.0f)); }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline int __float2int_rn(float a) { return (int)nearbyintf(a); }
inline int __float2int_rz(float a) { return (int)a; }

// ---- half and bfloat16 ---------------------------------------------------------------------
struct __half {
    unsigned short __x;
};
struct __nv_bfloat16 {
    unsigned short __x;
};

// float -> IEEE half, rounded to nearest even; a NaN becomes the GPU's 0x7fff.
inline unsigned short simt_float_to_half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;
    if (a >= 0x47800000u) return (unsigned short)(sign | 0x7c00u);  // >= 65536: infinity
    if (a < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), by a float addition
        volatile float magic = 0.5f;  // 2^-1: its ulp is 2^-24, the subnormal half step
        float m;
        memcpy(&m, &a, 4);
        volatile float s = m + magic;
        uint32_t b;
        float sv = s;
        memcpy(&b, &sv, 4);
        return (unsigned short)(sign | (b - 0x3f000000u));
    }
    uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd;  // exponent bias 127 -> 15, round half to even
    return (unsigned short)(sign | (a >> 13));
}
inline float simt_half_bits_to_float(unsigned short h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0x1fu) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;
    } else {
        float f = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
inline float __half2float(__half h) { return simt_half_bits_to_float(h.__x); }
inline __half __float2half(float f) { return __half{simt_float_to_half_bits(f)}; }
inline __half __float2half_rn(float f) { return __half{simt_float_to_half_bits(f)}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
inline __half __hadd(__half a, __half b) {
    return __float2half((float)((double)__half2float(a) + (double)__half2float(b)));
}
inline __half __hsub(__half a, __half b) {
    return __float2half((float)((double)__half2float(a) - (double)__half2float(b)));
}
inline __half __hmul(__half a, __half b) { return __float2half(__half2float(a) * __half2float(b)); }

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.__x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fffu};
    return __nv_bfloat16{(unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }

// ---- launching -------------------------------------------------------------------------------
namespace simt {
namespace detail {

template <class... A, size_t... I>
inline void call_with(void (*f)(A...), void** a, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_reference<A>::type*>(a[I])...);
}

template <class... A>
inline void invoke(void (*f)(A...), void** a) {
    call_with(f, a, std::index_sequence_for<A...>{});
}

// Parameter kinds for the loader: 0 pointer, 1 signed integer, 2 unsigned integer,
// 3 floating point, 4 anything else (not launchable from Python).
template <class A>
constexpr int kind_of() {
    return std::is_pointer<A>::value          ? 0
           : std::is_floating_point<A>::value ? 3
           : std::is_integral<A>::value       ? (std::is_signed<A>::value ? 1 : 2)
                                              : 4;
}

template <class... A>
inline int describe(void (*)(A...), int* kinds, int* sizes, int cap) {
    int k[] = {kind_of<A>()..., 0};
    int s[] = {(int)sizeof(A)..., 0};
    int n = (int)sizeof...(A);
    for (int i = 0; i < n && i < cap; ++i) {
        kinds[i] = k[i];
        sizes[i] = s[i];
    }
    return n;
}

}  // namespace detail
}  // namespace simt

// Run `invoke(args)` as a kernel on grid x block threads. Returns 0, or 1 with the error in
// `err` (a NUL-terminated message of at most err_len bytes).
extern "C" __attribute__((visibility("default"))) int simt_launch(
    void (*invoke)(void**), void** args, const unsigned* grid, const unsigned* block,
    unsigned long long dynamic_bytes, int order, unsigned long long seed, char* err,
    unsigned long long err_len) {
    using namespace simt::detail;
    std::lock_guard<std::mutex> hold(g_lock);
    g.failed = false;
    g.error.clear();
    g.invoke = invoke;
    g.args = args;
    g.grid = dim3(grid[0], grid[1], grid[2]);
    g.block = dim3(block[0], block[1], block[2]);
    g.order = order;
    g.rng = seed;
    g.dynamic_bytes = dynamic_bytes;
#if SIMT_ASAN
    {  // the calling thread's stack, which fibers switch back to (asked once per thread:
       // for the main thread glibc reads /proc/self/maps)
        static thread_local void* lo = nullptr;
        static thread_local size_t size = 0;
        if (lo == nullptr) {
            pthread_attr_t attr;
            if (pthread_getattr_np(pthread_self(), &attr) == 0) {
                pthread_attr_getstack(&attr, &lo, &size);
                pthread_attr_destroy(&attr);
            }
        }
        g.sched_stack_bottom = lo;
        g.sched_stack_size = size;
    }
#endif
    unsigned long long n = (unsigned long long)block[0] * block[1] * block[2];
    unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    std::string bad;
    if (n == 0 || blocks == 0) bad = "an empty grid or block";
    else if (n > 1024 || block[0] > 1024 || block[1] > 1024 || block[2] > 64)
        bad = format("a block of %u x %u x %u threads (at most 1024, z at most 64)", block[0],
                     block[1], block[2]);
    else if (grid[0] > 2147483647u || grid[1] > 65535u || grid[2] > 65535u)
        bad = format("a grid of %u x %u x %u blocks (x < 2^31, y and z at most 65535)", grid[0],
                     grid[1], grid[2]);
    else if (order < 0 || order > 2)
        bad = format("thread order %d", order);
    else if (dynamic_bytes > SHARED_LIMIT)
        bad = format("%llu bytes of dynamic shared memory (at most %zu)", dynamic_bytes, SHARED_LIMIT);
    if (bad.empty()) {
        ensure_stacks((size_t)n);
        if (g.n_stacks < n) bad = "no memory for the fibers' stacks";
    }
    if (!bad.empty()) {
        snprintf(err, (size_t)err_len, "%s", bad.c_str());
        return 1;
    }
    std::vector<unsigned long long> blocks_order((size_t)blocks);
    for (unsigned long long i = 0; i < blocks; ++i) blocks_order[i] = order == 1 ? blocks - 1 - i : i;
    if (order == 2) {
        for (unsigned long long i = blocks; i > 1; --i)
            std::swap(blocks_order[i - 1], blocks_order[next_random() % i]);
    }
    for (unsigned long long b : blocks_order) {
        g.block_idx = uint3{(unsigned)(b % grid[0]), (unsigned)((b / grid[0]) % grid[1]),
                            (unsigned)(b / ((unsigned long long)grid[0] * grid[1]))};
        run_block();
        end_block_shared();
        if (g.failed) break;
    }
    g.cur = nullptr;
    g.stacks_dirty = g.failed;
    if (g.failed) {
        snprintf(err, (size_t)err_len, "%s", g.error.c_str());
        return 1;
    }
    return 0;
}
