// shared_memory.h: `__shared__` as `static`, the dynamic shared buffer of a launch, and the
// poisoning of both before every block.
//
// Blocks run one after another, so one static copy of a `__shared__` variable serves every
// block; filling it with 0xFF bytes before each block makes a read of never-written shared
// memory a NaN (or -1), which the tests see.
#pragma once

#include "runtime.h"

#define __shared__ static
#define CUONLINE_DYNAMIC_SHARED(type, name) \
    type* const name = reinterpret_cast<type*>(::cuemu::dynamic_shared_base())

namespace cuemu {

inline void* g_dynamic_shared = nullptr;  // per launch, `shared_mem` bytes
inline size_t g_dynamic_shared_bytes = 0;
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

}  // namespace cuemu

extern "C" __attribute__((visibility("default"), used)) size_t cuemu_static_shared_bytes() {
    return cuemu::static_shared_bytes();
}
