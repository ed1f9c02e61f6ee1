// simt_fiber.h: each CUDA thread a fiber: its stack, and switching between fibers.
// Part of the SIMT emulator (simt.h includes it).
#pragma once

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
