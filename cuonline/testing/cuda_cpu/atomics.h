// atomics.h: CUDA's atomic functions as std::atomic_ref operations (the threads mode runs CUDA
// threads concurrently, so they must be real atomics), and __ldg.
#pragma once

#include "types.h"

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
