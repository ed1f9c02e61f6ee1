// simt_sync.h: __syncthreads and the warp collectives, by CUDA's rules.
// Part of the SIMT emulator (simt.h includes it).
#pragma once

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

}  // namespace detail
}  // namespace simt
