// simt_block.h: a block's shared memory, its scheduler, and a thread's exit.
// Part of the SIMT emulator (simt.h includes it).
#pragma once

namespace simt {
namespace detail {

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
