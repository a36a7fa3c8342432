// threads.h: CUEMU_MODE_THREADS, the mode for ThreadSanitizer: one OS thread per CUDA thread,
// futex barriers with a watchdog; misuse aborts the process with a message.
#pragma once

#include "shared_memory.h"

#if !defined(CUEMU_MODE_THREADS)
#error "threads.h is the runtime of CUEMU_MODE_THREADS"
#endif

namespace cuemu {

// =============================================================================================
// Threads: one OS thread per CUDA thread.

// $CUONLINE_EMULATE_WATCHDOG_S: a finite number of seconds > 0 (default 20).  emulate.py checks
// it before every launch; a bad value that reaches here gives 0 and launch_impl refuses to run.
inline double watchdog_seconds() {
    static double s = [] {
        const char* e = std::getenv("CUONLINE_EMULATE_WATCHDOG_S");
        if (!e || !*e) return 20.0;
        char* end = nullptr;
        const double v = std::strtod(e, &end);
        return *end == 0 && std::isfinite(v) && v > 0 ? v : 0.0;
    }();
    return s;
}

[[noreturn]] inline void fail(const std::string& msg) {
    std::fprintf(stderr, "cuonline emulation: %s (%s)\n", msg.c_str(), where().c_str());
    std::fflush(stderr);
    std::abort();
}

// A reusable barrier on atomics + futex.  `state` packs (expected << 32 | arrived) so that an
// arrival and a drop (an exiting thread) are one atomic step each; `gen` counts completions and
// is the futex word.
struct Barrier {
    std::atomic<uint64_t> state{0};
    std::atomic<uint32_t> gen{0};
    const char* name = "";

    void reset(uint32_t expected) { state.store(uint64_t(expected) << 32, std::memory_order_relaxed); }

    void complete(uint64_t s) {
        state.store(s & ~uint64_t(0xffffffffu), std::memory_order_relaxed);
        gen.fetch_add(1, std::memory_order_release);
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen), FUTEX_WAKE_PRIVATE, INT_MAX,
                nullptr, nullptr, 0);
    }

    template <class Hook>
    void arrive_and_wait(Hook&& on_complete) {
        const uint32_t g = gen.load(std::memory_order_acquire);
        const uint64_t s = state.fetch_add(1, std::memory_order_acq_rel) + 1;
        if (uint32_t(s) == uint32_t(s >> 32)) {
            on_complete();
            complete(s);
            return;
        }
        wait(g);
    }
    void arrive_and_wait() { arrive_and_wait([] {}); }

    void arrive_and_drop() {
        const uint64_t s = state.fetch_sub(uint64_t(1) << 32, std::memory_order_acq_rel) -
                           (uint64_t(1) << 32);
        if (uint32_t(s) != 0 && uint32_t(s) == uint32_t(s >> 32)) complete(s);
    }

    void wait(uint32_t g) {
        for (int spin = 0; spin < 64; ++spin) {
            if (gen.load(std::memory_order_acquire) != g) return;
            __builtin_ia32_pause();
        }
        const auto start = std::chrono::steady_clock::now();
        while (gen.load(std::memory_order_acquire) == g) {
            timespec ts{1, 0};
            syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen), FUTEX_WAIT_PRIVATE, g, &ts,
                    nullptr, 0);
            const double waited =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (waited > watchdog_seconds() && gen.load(std::memory_order_acquire) == g) {
                const uint64_t s = state.load(std::memory_order_relaxed);
                char msg[256];
                std::snprintf(msg, sizeof msg,
                              "watchdog: %s stuck for %.0f s, %u of %u threads arrived (%u "
                              "missing)",
                              name, waited, uint32_t(s), uint32_t(s >> 32),
                              uint32_t(s >> 32) - uint32_t(s));
                fail(msg);
            }
        }
    }
};

struct Warp {
    Barrier bar;
    Slot slots[2][32];
};

struct Launch {
    Barrier start;  // between blocks: every thread finished the previous block
    Barrier block;  // __syncthreads
    std::vector<Warp> warps;
    unsigned n = 0;
};
inline Launch* g_launch = nullptr;

inline void block_barrier() { g_launch->block.arrive_and_wait(); }
inline uint64_t warp_generation() {
    return g_launch->warps[self->warp].bar.gen.load(std::memory_order_acquire);
}
inline Slot (&warp_slots())[2][32] { return g_launch->warps[self->warp].slots; }
inline void warp_barrier() { g_launch->warps[self->warp].bar.arrive_and_wait(); }

inline int launch_impl(Body body, void* ctx, dim3 grid, dim3 block) {
    if (watchdog_seconds() <= 0) {
        std::snprintf(g_last_error, sizeof g_last_error,
                      "CUONLINE_EMULATE_WATCHDOG_S=%s is not a finite number of seconds > 0",
                      env_text("CUONLINE_EMULATE_WATCHDOG_S"));
        return 1;
    }
    const unsigned n = block.x * block.y * block.z;
    Launch L;
    L.n = n;
    L.start.name = "block start";
    L.block.name = "__syncthreads";
    L.warps = std::vector<Warp>((n + 31) / 32);
    for (auto& w : L.warps) {
        w.bar.name = "warp collective";
        std::memset(w.slots, 0xFF, sizeof w.slots);
    }
    L.start.reset(n);
    g_launch = &L;
    auto worker = [&L, body, ctx, grid, block](unsigned i) {
        ThreadRec rec;
        rec.linear = i;
        rec.warp = i / 32;
        rec.lane = i % 32;
        rec.tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
        self = &rec;
        threadIdx = rec.tid;
        blockDim = block;
        gridDim = grid;
        for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = uint3{bx, by, bz};
            L.start.arrive_and_wait([&L] {
                L.block.reset(L.n);
                for (size_t w = 0; w < L.warps.size(); ++w)
                    L.warps[w].bar.reset(std::min(32u, L.n - unsigned(w * 32)));
                poison_shared();
            });
            body(ctx);
            // Exited threads leave the barriers, as on a GPU.
            L.warps[rec.warp].bar.arrive_and_drop();
            L.block.arrive_and_drop();
        }
        self = nullptr;
    };
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned i = 0; i < n; ++i) threads.emplace_back(worker, i);
    for (auto& t : threads) t.join();
    g_launch = nullptr;
    return 0;
}

}  // namespace cuemu
