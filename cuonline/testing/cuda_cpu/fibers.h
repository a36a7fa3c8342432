// fibers.h: the default mode (CUEMU_MODE_FIBERS): every CUDA thread of a block is a user-space
// context on the launching OS thread, switched at barriers and warp collectives; deadlocks and
// misuse fail the launch with a message (a Python exception) instead of aborting.
#pragma once

#include "shared_memory.h"

#if !defined(CUEMU_MODE_FIBERS)
#error "fibers.h is the runtime of CUEMU_MODE_FIBERS"
#endif

namespace cuemu {

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
    // The stacks of one launch, reused by its blocks and unmapped when it returns. Not kept
    // for the next launch: each stack is two memory mappings (its guard page splits it), and
    // every emulated module is a library of its own, so a pool kept per module held 2 x
    // threads-per-block mappings for each module a process ever launched, and a test run
    // loading some 130 modules hit the kernel's limit of 65,530 (dlopen then failed with
    // "failed to map segment", thread creation hung). Mapping them per launch costs a few
    // microseconds per thread.
    StackPool pool;
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


}  // namespace cuemu
