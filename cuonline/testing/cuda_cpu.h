// cuda_cpu.h: run CUDA C kernel text on a CPU, faithfully enough that kernel bugs show up.
//
// Force-included by cuonline.testing.emulate (g++ -std=c++20 -include cuda_cpu.h -x c++ k.cu).
// The kernel text is the exact string that cupy.RawModule compiles; nothing here defines
// __CUDACC__ or __CUDA_ARCH__, so `#ifdef __CUDACC__` blocks (cuda_fp16.h, inline PTX) are skipped
// and this header stands in for them.  CUONLINE_EMULATION is defined instead.
//
// Execution model (one launch):
//   * blocks run one after another, so `__shared__` can be `static`; every such variable
//     registers itself (see SharedVar) and, with the dynamic shared buffer, is filled with 0xFF
//     before every block, so reads of never-written shared memory give NaN / -1.
//   * CUEMU_MODE_FIBERS: every CUDA thread of a block is a user-space context on the launching OS
//     thread; contexts switch only at __syncthreads, __syncwarp, shuffles and votes.  Deadlocks
//     and misuse are reported as a launch error (a Python exception), not an abort.  Warps do
//     not advance together: one warp runs as far as it can (to a __syncthreads or its end)
//     before the next starts, in an order that changes from block to block, so a kernel that
//     counts on warps being in step between two barriers reads poison or stale data.
//   * CUEMU_MODE_THREADS: one OS thread per CUDA thread, created once per launch and walking the
//     grid block by block; barriers are futex-based.  This is the mode for ThreadSanitizer.
//     Misuse aborts the process with a message; a watchdog aborts a barrier stuck for
//     $CUONLINE_EMULATE_WATCHDOG_S seconds (default 20).
//   * Warp collectives follow the PTX shfl.sync rules through a per-warp exchange buffer.  A lane
//     that exited (or does not exist in a partial last warp) reads as all-ones bits (NaN / -1).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cassert>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if !defined(CUEMU_MODE_FIBERS) && !defined(CUEMU_MODE_THREADS)
#define CUEMU_MODE_FIBERS 1
#endif

#define CUONLINE_EMULATION 1

// ---------------------------------------------------------------------------------------------
// Qualifiers.  Defined after the standard headers: libstdc++ spells __noinline__ in attributes.
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define CUONLINE_DYNAMIC_SHARED(type, name) \
    type* const name = reinterpret_cast<type*>(::cuemu::dynamic_shared_base())

// ---------------------------------------------------------------------------------------------
// Built-in vector types.
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
#define CUEMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N { T x, y; }; \
    inline N make_##N(T x, T y) { return N{x, y}; }
#define CUEMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N { T x, y, z, w; }; \
    inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
CUEMU_VEC2(float, float2, 8)
CUEMU_VEC4(float, float4, 16)
CUEMU_VEC2(double, double2, 16)
CUEMU_VEC2(int, int2, 8)
CUEMU_VEC4(int, int4, 16)
CUEMU_VEC2(unsigned, uint2, 8)
CUEMU_VEC4(unsigned, uint4, 16)
CUEMU_VEC2(long long, longlong2, 16)
#undef CUEMU_VEC2
#undef CUEMU_VEC4
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
struct float3 { float x, y, z; };
inline float3 make_float3(float x, float y, float z) { return float3{x, y, z}; }

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Runtime.
namespace cuemu {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr uint64_t kPoison = ~uint64_t(0);

// One slot of a warp's exchange buffer: the value a lane offers and the warp generation at which
// it offered it (a stale tag means the lane exited or does not exist).
struct Slot { uint64_t value; uint64_t tag; };

inline void* g_dynamic_shared = nullptr;  // per launch, `shared_mem` bytes
inline size_t g_dynamic_shared_bytes = 0;
inline std::mutex g_launch_mutex;          // one launch at a time per module (static shared)
inline char g_last_error[2048];

inline void* dynamic_shared_base() { return g_dynamic_shared; }

// Static __shared__ variables.  emulate.py appends `static ::cuemu::SharedVar r{&v, sizeof v};`
// after every `__shared__` declaration of the kernel text, so each variable registers itself
// (and is poisoned) the first time its declaration runs.  (A linker section would be simpler,
// but GCC drops the section attribute of statics in templates and rejects it in inline
// functions.)
struct SharedRegistry {
    std::mutex mu;
    std::vector<std::pair<void*, size_t>> vars;
    size_t bytes = 0;
};
inline SharedRegistry& shared_registry() {
    static SharedRegistry r;
    return r;
}
struct SharedVar {
    SharedVar(void* p, size_t n) {
        SharedRegistry& r = shared_registry();
        std::lock_guard<std::mutex> lock(r.mu);
        for (auto& v : r.vars)
            if (v.first == p) return;
        r.vars.emplace_back(p, n);
        r.bytes += n;
        std::memset(p, 0xFF, n);  // first block: the declaration runs before any use
    }
};

inline size_t static_shared_bytes() {
    SharedRegistry& r = shared_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    return r.bytes;
}

// Fill all shared memory with 0xFF: never-written floats read as NaN, ints as -1.
inline void poison_shared() {
    SharedRegistry& r = shared_registry();
    {
        std::lock_guard<std::mutex> lock(r.mu);
        for (auto& v : r.vars) std::memset(v.first, 0xFF, v.second);
    }
    if (g_dynamic_shared_bytes) std::memset(g_dynamic_shared, 0xFF, g_dynamic_shared_bytes);
}

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

#if defined(CUEMU_MODE_FIBERS)
// =============================================================================================
// Fibers: all threads of a block are contexts on one OS thread.
enum : int { kReady = 0, kWaitBlock = 1, kWaitWarp = 2, kDone = 3 };

struct Warp {
    int live = 0, arrived = 0;
    uint64_t gen = 0;
    unsigned first = 0, lanes = 0;
    Slot slots[2][32];
};

struct Block {
    std::vector<ThreadRec> th;
    std::vector<Warp> warps;
    void* sched_sp = nullptr;
    int live = 0, arrived = 0;
    Body body = nullptr;
    void* ctx = nullptr;
    bool failed = false;
};
inline thread_local Block* g_block = nullptr;

}  // namespace cuemu

#if defined(__x86_64__)
// Context switch: save callee-saved registers + SSE/x87 control words on the current stack,
// store the stack pointer in *save, load `load` and restore.  A new context's stack is prepared
// so that the first switch "returns" into cuemu_fiber_start with r12 = argument, r13 = function.
extern "C" void cuemu_ctx_switch(void** save, void* load);
extern "C" void cuemu_fiber_start();
asm(R"(
    .text
    .p2align 4
    .globl cuemu_ctx_switch
    .hidden cuemu_ctx_switch
    .type cuemu_ctx_switch,@function
cuemu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr (%rsp)
    fnstcw 8(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 8(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuemu_ctx_switch, .-cuemu_ctx_switch
    .p2align 4
    .globl cuemu_fiber_start
    .hidden cuemu_fiber_start
    .type cuemu_fiber_start,@function
cuemu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size cuemu_fiber_start, .-cuemu_fiber_start
)");
#else
#error "cuda_cpu.h fibers mode needs x86-64; use mode='threads'"
#endif

namespace cuemu {

inline void fiber_main(void* arg);

inline void* prepare_stack(char* top, void* arg) {
    auto* p = reinterpret_cast<uint64_t*>(top);  // top is 16-byte aligned
    p[-1] = reinterpret_cast<uint64_t>(&cuemu_fiber_start);  // return address
    p[-2] = 0;                                                // rbp
    p[-3] = 0;                                                // rbx
    p[-4] = reinterpret_cast<uint64_t>(arg);                  // r12
    p[-5] = reinterpret_cast<uint64_t>(&fiber_main);          // r13
    p[-6] = 0;                                                // r14
    p[-7] = 0;                                                // r15
    p[-9] = 0x1F80;                                           // mxcsr (default)
    p[-8] = 0x037F;                                           // x87 control word (default)
    return p - 9;
}

inline void yield_to_scheduler() {
    ThreadRec* me = self;
    cuemu_ctx_switch(&me->sp, g_block->sched_sp);
}

// Report misuse from inside a fiber: the launch fails with this message, the fiber never resumes.
[[noreturn]] inline void fail(const std::string& msg) {
    Block& b = *g_block;
    if (!b.failed) {
        b.failed = true;
        std::snprintf(g_last_error, sizeof g_last_error, "%s (%s)", msg.c_str(), where().c_str());
    }
    self->state = kDone;
    yield_to_scheduler();
    __builtin_unreachable();
}

inline void release_block(Block& b) {
    for (auto& t : b.th)
        if (t.state == kWaitBlock) t.state = kReady;
    b.arrived = 0;
}

inline void release_warp(Block& b, Warp& w) {
    for (unsigned i = w.first; i < w.first + w.lanes; ++i)
        if (b.th[i].state == kWaitWarp) b.th[i].state = kReady;
    w.arrived = 0;
    ++w.gen;
}

inline void block_barrier() {
    Block& b = *g_block;
    if (++b.arrived == b.live) { release_block(b); return; }
    self->state = kWaitBlock;
    yield_to_scheduler();
}

inline uint64_t warp_generation() { return g_block->warps[self->warp].gen; }
inline Slot (&warp_slots())[2][32] { return g_block->warps[self->warp].slots; }

inline void warp_barrier() {
    Block& b = *g_block;
    Warp& w = b.warps[self->warp];
    if (++w.arrived == w.live) { release_warp(b, w); return; }
    self->state = kWaitWarp;
    yield_to_scheduler();
}

// The thread returned from the kernel: leave the block and warp barriers (arrive-and-drop).
inline void thread_exit() {
    Block& b = *g_block;
    Warp& w = b.warps[self->warp];
    --b.live;
    --w.live;
    if (b.arrived > 0 && b.arrived == b.live) release_block(b);
    if (w.arrived > 0 && w.arrived == w.live) release_warp(b, w);
    self->state = kDone;
    yield_to_scheduler();
    __builtin_unreachable();
}

inline void fiber_main(void* arg) {
    (void)arg;
    g_block->body(g_block->ctx);
    thread_exit();
}

struct StackPool {
    std::vector<char*> stacks;
    size_t size = 0;
    ~StackPool() {
        for (char* s : stacks) munmap(s, size + 4096);
    }
};

// $CUONLINE_EMULATE_STACK_KB: KiB per fiber stack, digits only, 64..1048576 (default 256).
// emulate.py checks the value before every launch; one that reaches here anyway gives 0, and
// the launch fails with a message instead of overflowing a tiny stack or the size itself.
inline size_t stack_bytes() {
    static size_t n = [] {
        const char* e = std::getenv("CUONLINE_EMULATE_STACK_KB");
        if (!e || !*e) return size_t(256) * 1024;
        size_t kb = 0;
        for (const char* c = e; *c; ++c) {
            if (*c < '0' || *c > '9' || kb > 1048576) return size_t(0);
            kb = kb * 10 + size_t(*c - '0');
        }
        return kb >= 64 && kb <= 1048576 ? kb * 1024 : size_t(0);
    }();
    return n;
}

// Stacks with a guard page at the bottom, kept for the next launch.
inline char* stack_top(StackPool& pool, size_t i) {
    if (pool.size == 0) pool.size = stack_bytes();
    if (pool.size == 0) return nullptr;
    while (pool.stacks.size() <= i) {
        void* p = mmap(nullptr, pool.size + 4096, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return nullptr;
        mprotect(p, 4096, PROT_NONE);
        pool.stacks.push_back(static_cast<char*>(p));
    }
    return pool.stacks[i] + 4096 + pool.size;
}

inline std::string deadlock_report(const Block& b) {
    std::string msg = "deadlock in block (" + std::to_string(blockIdx.x) + "," +
                      std::to_string(blockIdx.y) + "," + std::to_string(blockIdx.z) + "): ";
    int at_block = 0;
    for (auto& t : b.th) at_block += t.state == kWaitBlock;
    msg += std::to_string(at_block) + " of " + std::to_string(b.live) +
           " live threads wait at __syncthreads (" + std::to_string(b.live - at_block) +
           " missing)";
    for (size_t w = 0; w < b.warps.size(); ++w) {
        const Warp& wp = b.warps[w];
        if (wp.arrived > 0)
            msg += "; warp " + std::to_string(w) + ": " + std::to_string(wp.arrived) + " of " +
                   std::to_string(wp.live) + " live lanes wait at a warp collective";
    }
    return msg;
}

inline int launch_impl(Body body, void* ctx, dim3 grid, dim3 block) {
    static StackPool pool;
    const unsigned n = block.x * block.y * block.z;
    Block b;
    b.th.resize(n);
    b.warps.resize((n + 31) / 32);
    b.body = body;
    b.ctx = ctx;
    for (unsigned i = 0; i < n; ++i) {
        ThreadRec& t = b.th[i];
        t.linear = i;
        t.warp = i / 32;
        t.lane = i % 32;
        t.tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
        t.stack_top = stack_top(pool, i);
        if (!t.stack_top) {
            if (stack_bytes() == 0)
                std::snprintf(g_last_error, sizeof g_last_error,
                              "CUONLINE_EMULATE_STACK_KB=%s is not an integer from 64 to 1048576",
                              env_text("CUONLINE_EMULATE_STACK_KB"));
            else
                std::snprintf(g_last_error, sizeof g_last_error, "cannot allocate fiber stacks");
            return 1;
        }
    }
    for (size_t w = 0; w < b.warps.size(); ++w) {
        b.warps[w].first = unsigned(w * 32);
        b.warps[w].lanes = std::min(32u, n - unsigned(w * 32));
        std::memset(b.warps[w].slots, 0xFF, sizeof b.warps[w].slots);
    }
    g_block = &b;
    gridDim = grid;
    blockDim = block;
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = uint3{bx, by, bz};
        poison_shared();
        b.live = int(n);
        b.arrived = 0;
        for (auto& w : b.warps) { w.live = int(w.lanes); w.arrived = 0; }
        for (auto& t : b.th) {
            t.state = kReady;
            t.sp = prepare_stack(t.stack_top, &t);
        }
        // Warp order of this block: rotated by the block's index, and reversed in every other
        // run of nw blocks.
        // Lanes of the running warp take turns (they meet at every collective); the warp runs
        // until none of its lanes can go on, i.e. all wait at __syncthreads or have exited.
        // The lane that completes a __syncthreads carries its warp into the next phase first.
        const unsigned nw = unsigned(b.warps.size());
        const unsigned linear = (bz * grid.y + by) * grid.x + bx;
        const bool reverse = (linear / nw) % 2 == 1;
        while (b.live > 0) {
            bool ran = false;
            for (unsigned k = 0; k < nw; ++k) {
                const unsigned w = (linear + (reverse ? nw - 1 - k : k)) % nw;
                const Warp& wp = b.warps[w];
                for (bool progress = true; progress;) {
                    progress = false;
                    for (unsigned i = wp.first; i < wp.first + wp.lanes; ++i) {
                        ThreadRec& t = b.th[i];
                        if (t.state != kReady) continue;
                        self = &t;
                        threadIdx = t.tid;
                        cuemu_ctx_switch(&b.sched_sp, t.sp);
                        progress = ran = true;
                        if (b.failed) { g_block = nullptr; self = nullptr; return 1; }
                    }
                }
            }
            if (!ran) {
                std::snprintf(g_last_error, sizeof g_last_error, "%s",
                              deadlock_report(b).c_str());
                g_block = nullptr;
                self = nullptr;
                return 1;
            }
        }
    }
    g_block = nullptr;
    self = nullptr;
    return 0;
}

#else  // CUEMU_MODE_THREADS
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
#endif  // modes

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

extern "C" __attribute__((visibility("default"), used)) const char* cuemu_last_error() {
    return cuemu::g_last_error;
}
extern "C" __attribute__((visibility("default"), used)) size_t cuemu_static_shared_bytes() {
    return cuemu::static_shared_bytes();
}

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

// ---------------------------------------------------------------------------------------------
// Atomics (real atomics: threads mode runs CUDA threads concurrently).
template <class T>
inline T cuemu_atomic_add(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return cuemu_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return cuemu_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return cuemu_atomic_add(p, v); }
inline float atomicAdd(float* p, float v) { return cuemu_atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return cuemu_atomic_add(p, v); }
inline int atomicSub(int* p, int v) { return std::atomic_ref<int>(*p).fetch_sub(v); }
inline unsigned atomicSub(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_sub(v); }
template <class T>
inline T cuemu_atomic_exch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
inline int atomicExch(int* p, int v) { return cuemu_atomic_exch(p, v); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return cuemu_atomic_exch(p, v); }
inline float atomicExch(float* p, float v) { return cuemu_atomic_exch(p, v); }
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) { return cuemu_atomic_exch(p, v); }
template <class T>
inline T cuemu_atomic_cas(T* p, T expected, T desired) {
    std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
    return expected;
}
inline int atomicCAS(int* p, int c, int v) { return cuemu_atomic_cas(p, c, v); }
inline unsigned atomicCAS(unsigned* p, unsigned c, unsigned v) { return cuemu_atomic_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) { return cuemu_atomic_cas(p, c, v); }
template <class T>
inline T cuemu_atomic_max(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T cur = a.load();
    while (cur < v && !a.compare_exchange_weak(cur, v)) {}
    return cur;
}
template <class T>
inline T cuemu_atomic_min(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T cur = a.load();
    while (v < cur && !a.compare_exchange_weak(cur, v)) {}
    return cur;
}
inline int atomicMax(int* p, int v) { return cuemu_atomic_max(p, v); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return cuemu_atomic_max(p, v); }
inline int atomicMin(int* p, int v) { return cuemu_atomic_min(p, v); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return cuemu_atomic_min(p, v); }

template <class T>
inline T __ldg(const T* p) { return *p; }

// ---------------------------------------------------------------------------------------------
// Math.  libm gives the correctly rounded or nearly so results; results differ from a GPU by a
// few ulp (no FMA contraction, exact functions in place of the fast intrinsics).
template <class A, class B>
    requires std::is_arithmetic_v<A> && std::is_arithmetic_v<B>
inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) return std::fmin(C(a), C(b));
    else return C(b) < C(a) ? C(b) : C(a);
}
template <class A, class B>
    requires std::is_arithmetic_v<A> && std::is_arithmetic_v<B>
inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) return std::fmax(C(a), C(b));
    else return C(a) < C(b) ? C(b) : C(a);
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(unsigned(x)); }
inline int __ffs(int x) { return x ? std::countr_zero(unsigned(x)) + 1 : 0; }
using std::isfinite;
using std::isinf;
using std::isnan;

// ---------------------------------------------------------------------------------------------
// 16-bit floats: bit-exact round-to-nearest-even conversions; NaN converts to the canonical
// 0x7fff as CUDA's conversions do.
namespace cuemu {
inline unsigned short float_to_half_bits(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fffu;                            // NaN
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);          // rounds to inf
    if (ax >= 0x38800000u) {                                         // normal half
        const uint32_t v = ax - (112u << 23);
        return uint16_t(sign | ((v + 0xfffu + ((v >> 13) & 1u)) >> 13));
    }
    if (ax <= 0x33000000u) return uint16_t(sign);                    // <= 2^-25: zero
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;   // subnormal half
    const uint32_t s = 126u - e;                                     // 14..24
    uint32_t k = m >> s;
    const uint32_t rem = m & ((1u << s) - 1u), halfway = 1u << (s - 1u);
    if (rem > halfway || (rem == halfway && (k & 1u))) ++k;
    return uint16_t(sign | k);
}
inline float half_bits_to_float(unsigned short h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        const float v = float(m) * 0x1p-24f;
        return sign ? -v : v;
    }
    return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}
inline unsigned short float_to_bf16_bits(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_float(unsigned short h) { return std::bit_cast<float>(uint32_t(h) << 16); }
}  // namespace cuemu

struct __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(cuemu::float_to_half_bits(f)) {}
    __half(double f) : __x(cuemu::float_to_half_bits(float(f))) {}
    operator float() const { return cuemu::half_bits_to_float(__x); }
};
struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(cuemu::float_to_bf16_bits(f)) {}
    __nv_bfloat16(double f) : __x(cuemu::float_to_bf16_bits(float(f))) {}
    operator float() const { return cuemu::bf16_bits_to_float(__x); }
};
static_assert(sizeof(__half) == 2 && std::is_trivially_copyable_v<__half>);
static_assert(sizeof(__nv_bfloat16) == 2 && std::is_trivially_copyable_v<__nv_bfloat16>);
using half = __half;
using nv_bfloat16 = __nv_bfloat16;
struct __align__(4) __half2 { __half x, y; };
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
using half2 = __half2;
using nv_bfloat162 = __nv_bfloat162;

inline __half __ushort_as_half(unsigned short b) { __half h; h.__x = b; return h; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { __nv_bfloat16 h; h.__x = b; return h; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __half __float2half(float f) { return __ushort_as_half(cuemu::float_to_half_bits(f)); }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __half2float(__half h) { return cuemu::half_bits_to_float(h.__x); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __ushort_as_bfloat16(cuemu::float_to_bf16_bits(f)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return cuemu::bf16_bits_to_float(h.__x); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half(a), __float2half(b)}; }
inline __half2 __float2half2_rn(float a) { return __floats2half2_rn(a, a); }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16(a), __float2bfloat16(b)};
}
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __floats2bfloat162_rn(a, a); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return float2{__bfloat162float(h.x), __bfloat162float(h.y)};
}
inline __half __hadd(__half a, __half b) { return __float2half(__half2float(a) + __half2float(b)); }
inline __half __hmul(__half a, __half b) { return __float2half(__half2float(a) * __half2float(b)); }

// ---------------------------------------------------------------------------------------------
// Launch glue, instantiated by the trampolines that emulate.py appends to the kernel text.
namespace cuemu {

template <class... A, size_t... I>
inline void invoke(void (*f)(A...), void** args, std::index_sequence<I...>) {
    // Each CUDA thread gets its own copy of the by-value parameters.
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// Signature code of one parameter, checked by emulate.py against the Python arguments:
// "p<k><size>" for a pointer to writable memory, "c<k><size>" for a pointer to const,
// "v<k><size>" for a value; <k> is f (floating), i (signed), u (unsigned), h (__half),
// b (__nv_bfloat16) or x (anything else).
template <class T>
inline std::string type_code_of() {
    if constexpr (std::is_same_v<T, __half>) return "h2";
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) return "b2";
    else if constexpr (std::is_floating_point_v<T>) return "f" + std::to_string(sizeof(T));
    else if constexpr (std::is_same_v<T, bool>) return "x1";
    else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) return "i" + std::to_string(sizeof(T));
    else if constexpr (std::is_integral_v<T>) return "u" + std::to_string(sizeof(T));
    else if constexpr (std::is_void_v<T>) return "x0";
    else return "x" + std::to_string(sizeof(T));
}
template <class A>
inline std::string param_code() {
    using T = std::remove_cv_t<A>;
    if constexpr (std::is_pointer_v<T>) {
        using P = std::remove_pointer_t<T>;
        return (std::is_const_v<P> ? "c" : "p") + type_code_of<std::remove_cv_t<P>>();
    } else {
        return "v" + type_code_of<T>();
    }
}
template <class... A>
inline const char* signature(void (*)(A...)) {
    static const std::string s = [] {
        std::string out;
        ((out += param_code<A>() + ","), ...);
        return out;
    }();
    return s.c_str();
}

template <class... A>
inline int launch(void (*f)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                  unsigned by, unsigned bz, size_t smem, void** args) {
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    g_last_error[0] = 0;
    struct Ctx { void (*f)(A...); void** args; } ctx{f, args};
    Body body = [](void* p) {
        auto* c = static_cast<Ctx*>(p);
        invoke(c->f, c->args, std::index_sequence_for<A...>{});
    };
    void* dyn = nullptr;
    if (smem) {
        dyn = std::aligned_alloc(128, (smem + 127) / 128 * 128);
        if (!dyn) {
            std::snprintf(g_last_error, sizeof g_last_error, "cannot allocate %zu bytes of dynamic shared memory", smem);
            return 1;
        }
    }
    g_dynamic_shared = dyn;
    g_dynamic_shared_bytes = smem;
    const int rc = launch_impl(body, &ctx, dim3(gx, gy, gz), dim3(bx, by, bz));
    g_dynamic_shared = nullptr;
    g_dynamic_shared_bytes = 0;
    std::free(dyn);
    return rc;
}

}  // namespace cuemu
