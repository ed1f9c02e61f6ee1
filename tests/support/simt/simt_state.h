// simt_state.h: the emulator's state (threads, warps, shared arrays, the block) and errors.
// Part of the SIMT emulator (simt.h includes it).
#pragma once

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

}  // namespace detail
}  // namespace simt
