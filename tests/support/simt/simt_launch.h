// simt_launch.h: launching a kernel: its arguments, the grid, the blocks in the launch's order.
// Part of the SIMT emulator (simt.h includes it).
#pragma once

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
