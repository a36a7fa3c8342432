// types.h: the CUDA qualifiers, the built-in vector types and the thread index variables.
//
// threadIdx, blockIdx, blockDim and gridDim are thread_local: every CUDA thread (a fiber or an
// OS thread, see fibers.h and threads.h) sees its own.
#pragma once

#include "system.h"

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
