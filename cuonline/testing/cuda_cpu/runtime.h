// runtime.h: what the two execution modes share: the per-thread record (`self`), the text of
// the last launch error and the exchange-buffer slot of the warp collectives.
#pragma once

#include "types.h"

namespace cuemu {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint64_t kPoison = ~uint64_t(0);

// One slot of a warp's exchange buffer: the value a lane offers and the warp generation at which
// it offered it (a stale tag means the lane exited or does not exist).
struct Slot { uint64_t value; uint64_t tag; };

inline std::mutex g_launch_mutex;          // one launch at a time per module (static shared)
inline char g_last_error[2048];

inline std::string where() {
    char buf[160];
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u), thread (%u,%u,%u)", blockIdx.x, blockIdx.y,
                  blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    return buf;
}

// Per CUDA thread bookkeeping, reachable through `self`.
struct ThreadRec {
    unsigned linear = 0, warp = 0, lane = 0;
    uint3 tid{0, 0, 0};
    // fibers mode
    void* sp = nullptr;
    int state = 0;
    char* stack_top = nullptr;
};
inline thread_local ThreadRec* self = nullptr;

using Body = void (*)(void*);

// A variable's text for a message ("" once unset: it is read once, at the first launch).
inline const char* env_text(const char* name) {
    const char* e = std::getenv(name);
    return e ? e : "";
}

}  // namespace cuemu
