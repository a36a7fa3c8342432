// warp.h: block and warp synchronization (__syncthreads, __syncwarp, fences, __trap) and the
// warp collectives (shuffles, votes), exact to the PTX shfl.sync rules, over the per-warp
// exchange buffer of the running mode.
#pragma once

#include "mode.h"

namespace cuemu {

// ---------------------------------------------------------------------------------------------
// Warp collectives (full mask only), common to both modes.

inline void check_mask(unsigned mask, const char* fn) {
    if (mask != kFullMask) {
        char msg[200];
        std::snprintf(msg, sizeof msg,
                      "%s called with mask 0x%08x; the emulation supports only the full mask "
                      "0xffffffff",
                      fn, mask);
        fail(msg);
    }
}

// Offer `mine`, wait for the warp, return the value offered by `src` lane in this round (all
// ones when that lane exited or does not exist).
inline uint64_t exchange(uint64_t mine, unsigned src) {
    const uint64_t g = warp_generation();
    Slot* buf = warp_slots()[g & 1];
    buf[self->lane] = Slot{mine, g};
    warp_barrier();
    const Slot s = buf[src];
    return s.tag == g ? s.value : kPoison;
}

// Ballot over the live lanes of the warp; `valid` gets the mask of lanes that took part.
inline unsigned ballot(bool pred, unsigned* valid) {
    const uint64_t g = warp_generation();
    Slot* buf = warp_slots()[g & 1];
    buf[self->lane] = Slot{pred ? 1u : 0u, g};
    warp_barrier();
    unsigned bits = 0, present = 0;
    for (unsigned l = 0; l < 32; ++l) {
        if (buf[l].tag != g) continue;
        present |= 1u << l;
        if (buf[l].value) bits |= 1u << l;
    }
    if (valid) *valid = present;
    return bits;
}

enum class Shfl { idx, up, down, bfly };

// Source lane per PTX shfl.sync, with c = ((32 - width) << 8) | clamp as cuda's headers build it.
inline unsigned shfl_source(Shfl mode, unsigned lane, long long b, int width, const char* fn) {
    if (width < 1 || width > 32 || (width & (width - 1))) {
        char msg[160];
        std::snprintf(msg, sizeof msg, "%s called with width %d; width must be a power of 2 in [1, 32]", fn, width);
        fail(msg);
    }
    const unsigned segmask = unsigned(32 - width) & 0x1f;
    const unsigned cval = mode == Shfl::up ? 0u : 0x1fu;
    const long long max_lane = (lane & segmask) | (cval & ~segmask);
    const long long min_lane = lane & segmask;
    long long j = lane;
    bool p = true;
    switch (mode) {
        case Shfl::up: j = (long long)lane - b; p = j >= max_lane; break;
        case Shfl::down: j = (long long)lane + b; p = j <= max_lane; break;
        case Shfl::bfly: j = (long long)(lane ^ (unsigned long long)b); p = j <= max_lane; break;
        case Shfl::idx: j = min_lane | ((long long)b & 0x1f & ~(long long)segmask); p = j <= max_lane; break;
    }
    return p ? unsigned(j) : lane;
}

template <class T>
inline T shfl(unsigned mask, T var, long long b, int width, Shfl mode, const char* fn) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                  "warp shuffles take values of at most 8 bytes");
    check_mask(mask, fn);
    const unsigned src = shfl_source(mode, self->lane, b, width, fn);
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    bits = exchange(bits, src);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

}  // namespace cuemu

// ---------------------------------------------------------------------------------------------
// Synchronization and warp intrinsics.
inline void __syncthreads() { cuemu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    cuemu::check_mask(mask, "__syncwarp");
    cuemu::warp_barrier();
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { cuemu::fail("kernel executed __trap()"); }

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {
    return cuemu::shfl(mask, var, srcLane, width, cuemu::Shfl::idx, "__shfl_sync");
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return cuemu::shfl(mask, var, delta, width, cuemu::Shfl::up, "__shfl_up_sync");
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return cuemu::shfl(mask, var, delta, width, cuemu::Shfl::down, "__shfl_down_sync");
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {
    return cuemu::shfl(mask, var, laneMask, width, cuemu::Shfl::bfly, "__shfl_xor_sync");
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    cuemu::check_mask(mask, "__ballot_sync");
    return cuemu::ballot(pred != 0, nullptr);
}
inline int __any_sync(unsigned mask, int pred) {
    cuemu::check_mask(mask, "__any_sync");
    return cuemu::ballot(pred != 0, nullptr) != 0;
}
inline int __all_sync(unsigned mask, int pred) {
    cuemu::check_mask(mask, "__all_sync");
    unsigned valid = 0;
    return cuemu::ballot(pred != 0, &valid) == valid;
}
inline unsigned __activemask() { return 0xffffffffu; }
