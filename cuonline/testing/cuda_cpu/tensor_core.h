// tensor_core.h: C++ bodies of the tensor-core helpers of kernels_cu/tensor_core.cuh
// (to_tf32, mma_m16n8k16, mma_m16n8k8_tf32, mma_m8n8k4_f64, ldmatrix) for the host compiler.
//
// The kernel text declares these functions and defines them only under #ifdef __CUDA_ARCH__
// (inline PTX); this header, force-included before the kernel text, defines them with the same
// names and signatures, so g++ compiles the same text. The operands a lane needs are gathered
// from the other lanes with __shfl_sync, exactly as the PTX ISA lays the fragments out over the
// warp ("Matrix fragments for mma.m16n8k16 / m16n8k8 / m8n8k4", "ldmatrix"; the layouts are
// summarised at the top of tensor_core.cuh); the small product is computed in the accumulator
// precision and each lane keeps its own fragment. All 32 lanes must call a helper together (the
// .sync.aligned rule), as on the GPU.
#pragma once

#include "fp16.h"
#include "math_functions.h"
#include "warp.h"

namespace cuonline {
namespace tc {

// ---------------------------------------------------------------------------------------------
// Lane index and bit-level conversions shared by the bodies below.
namespace emu {

constexpr unsigned kFull = ::cuemu::kFullMask;  // the mask of every .sync.aligned helper

__device__ __forceinline__ int lane_id() {
    return int(((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x) & 31u);
}

__device__ __forceinline__ unsigned long long pack64(unsigned lo, unsigned hi) {
    return (unsigned long long)lo | ((unsigned long long)hi << 32);
}
__device__ __forceinline__ unsigned lo32(unsigned long long x) { return unsigned(x); }
__device__ __forceinline__ unsigned hi32(unsigned long long x) { return unsigned(x >> 32); }

// The two 16-bit halves of a register, widened (exactly) to float.
template <class T> struct Half2Bits;
template <> struct Half2Bits<__half> {
    __device__ __forceinline__ static float lo(unsigned r) {
        return __half2float(__ushort_as_half((unsigned short)(r & 0xffffu)));
    }
    __device__ __forceinline__ static float hi(unsigned r) {
        return __half2float(__ushort_as_half((unsigned short)(r >> 16)));
    }
};
template <> struct Half2Bits<__nv_bfloat16> {
    __device__ __forceinline__ static float lo(unsigned r) {
        return __bfloat162float(__ushort_as_bfloat16((unsigned short)(r & 0xffffu)));
    }
    __device__ __forceinline__ static float hi(unsigned r) {
        return __bfloat162float(__ushort_as_bfloat16((unsigned short)(r >> 16)));
    }
};

// A tf32 operand register as the tensor core reads it: sign, 8-bit exponent, the upper 10
// mantissa bits; the low 13 bits are not used.
__device__ __forceinline__ float tf32_value(unsigned r) { return __uint_as_float(r & 0xffffe000u); }

}  // namespace emu

// ---------------------------------------------------------------------------------------------
// cvt.rna.tf32.f32: round to nearest, ties away from zero, to a 10-bit mantissa (low 13 bits 0).

__device__ __forceinline__ unsigned to_tf32(float x) {
    const unsigned bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u)  // inf or NaN: no rounding carry into the exponent
        return (bits & 0x007fffffu) ? 0x7fffffffu : bits;
    return (bits + 0x1000u) & 0xffffe000u;
}

// ---------------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
//
// Lane (g, t) computes D[g][2t+j] and D[g+8][2t+j], j = 0, 1: it needs rows g and g+8 of A
// (held by lanes 4g..4g+3) and columns 2t and 2t+1 of B (held by lanes 8t..8t+3 and
// 8t+4..8t+7). Products of 16-bit values are exact in float; they are summed in float, in k
// order, onto C (the hardware's summation order is unspecified: results may differ by an ulp).
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const float (&c)[4]) {
    typedef emu::Half2Bits<T> H;   // T = __half or __nv_bfloat16 (no other T compiles)
    using emu::hi32;
    using emu::lo32;
    using emu::pack64;
    const int lane = emu::lane_id(), g = lane >> 2, t = lane & 3;
    float arow[2][16];  // arow[h][k] = A[g + 8h][k]
    float bcol[2][16];  // bcol[j][k] = B[k][2t + j]
    const unsigned long long mine01 = pack64(a[0], a[1]), mine23 = pack64(a[2], a[3]);
    const unsigned long long mineb = pack64(b[0], b[1]);
    for (int q = 0; q < 4; ++q) {
        // lane 4g+q holds A[g][2q, 2q+1], A[g+8][2q, 2q+1], A[g][2q+8, 2q+9], A[g+8][2q+8, 2q+9]
        const unsigned long long x01 = __shfl_sync(emu::kFull, mine01, 4 * g + q);
        const unsigned long long x23 = __shfl_sync(emu::kFull, mine23, 4 * g + q);
        arow[0][2 * q] = H::lo(lo32(x01));
        arow[0][2 * q + 1] = H::hi(lo32(x01));
        arow[1][2 * q] = H::lo(hi32(x01));
        arow[1][2 * q + 1] = H::hi(hi32(x01));
        arow[0][2 * q + 8] = H::lo(lo32(x23));
        arow[0][2 * q + 9] = H::hi(lo32(x23));
        arow[1][2 * q + 8] = H::lo(hi32(x23));
        arow[1][2 * q + 9] = H::hi(hi32(x23));
        // lane 4n+q holds B[2q, 2q+1][n] and B[2q+8, 2q+9][n]
        for (int j = 0; j < 2; ++j) {
            const unsigned long long y = __shfl_sync(emu::kFull, mineb, 4 * (2 * t + j) + q);
            bcol[j][2 * q] = H::lo(lo32(y));
            bcol[j][2 * q + 1] = H::hi(lo32(y));
            bcol[j][2 * q + 8] = H::lo(hi32(y));
            bcol[j][2 * q + 9] = H::hi(hi32(y));
        }
    }
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int h = i >> 1, j = i & 1;  // c[i] = C[g + 8h][2t + j]
        float acc = c[i];
        for (int k = 0; k < 16; ++k) acc += arow[h][k] * bcol[j][k];
        out[i] = acc;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// ---------------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (operands from to_tf32)
//
// Lane (g, t) needs rows g, g+8 of A (lanes 4g..4g+3) and columns 2t, 2t+1 of B.
// Products of tf32 values (11-bit significands) are exact in float.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4],
                                                 const unsigned (&b)[2], const float (&c)[4]) {
    const int lane = emu::lane_id(), g = lane >> 2, t = lane & 3;
    float arow[2][8];  // arow[h][k] = A[g + 8h][k]
    float bcol[2][8];  // bcol[j][k] = B[k][2t + j]
    const unsigned long long mine01 = emu::pack64(a[0], a[1]), mine23 = emu::pack64(a[2], a[3]);
    const unsigned long long mineb = emu::pack64(b[0], b[1]);
    for (int q = 0; q < 4; ++q) {
        // lane 4g+q holds A[g][q], A[g+8][q], A[g][q+4], A[g+8][q+4]
        const unsigned long long x01 = __shfl_sync(emu::kFull, mine01, 4 * g + q);
        const unsigned long long x23 = __shfl_sync(emu::kFull, mine23, 4 * g + q);
        arow[0][q] = emu::tf32_value(emu::lo32(x01));
        arow[1][q] = emu::tf32_value(emu::hi32(x01));
        arow[0][q + 4] = emu::tf32_value(emu::lo32(x23));
        arow[1][q + 4] = emu::tf32_value(emu::hi32(x23));
        // lane 4n+q holds B[q][n] and B[q+4][n]
        for (int j = 0; j < 2; ++j) {
            const unsigned long long y = __shfl_sync(emu::kFull, mineb, 4 * (2 * t + j) + q);
            bcol[j][q] = emu::tf32_value(emu::lo32(y));
            bcol[j][q + 4] = emu::tf32_value(emu::hi32(y));
        }
    }
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int h = i >> 1, j = i & 1;
        float acc = c[i];
        for (int k = 0; k < 8; ++k) acc += arow[h][k] * bcol[j][k];
        out[i] = acc;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// ---------------------------------------------------------------------------------------------
// mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64
//
// Lane (g, t) needs row g of A (lanes 4g..4g+3) and columns 2t, 2t+1 of B (lanes
// 8t..8t+3, 8t+4..8t+7); fused multiply-adds in k order onto C.
__device__ __forceinline__ void mma_m8n8k4_f64(double (&d)[2], double a, double b,
                                               const double (&c)[2]) {
    const int lane = emu::lane_id(), g = lane >> 2, t = lane & 3;
    double arow[4], bcol[2][4];
    for (int q = 0; q < 4; ++q) {
        arow[q] = __shfl_sync(emu::kFull, a, 4 * g + q);           // A[g][q]
        for (int j = 0; j < 2; ++j)
            bcol[j][q] = __shfl_sync(emu::kFull, b, 4 * (2 * t + j) + q);  // B[q][2t+j]
    }
    double out[2];
    for (int j = 0; j < 2; ++j) {
        double acc = c[j];
        for (int k = 0; k < 4; ++k) acc = fma(arow[k], bcol[j][k], acc);
        out[j] = acc;
    }
    d[0] = out[0];
    d[1] = out[1];
}

// ---------------------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16
//
// Exchange the row addresses; lane (g, t) reads, for matrix i, the 32 bits at column 2t of
// row g, or (.trans) column g of rows 2t and 2t+1.
// (memcpy: the tile may have been written as __half, float or bytes.)
template <int kNum, bool kTrans>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[kNum], const void* row) {
    static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
    const unsigned long long mine = (unsigned long long)row;
    if (mine & 15u) __trap();  // a misaligned row address is an error on the GPU too
    const int lane = emu::lane_id(), g = lane >> 2, t = lane & 3;
    for (int i = 0; i < kNum; ++i) {
        if constexpr (kTrans) {
            const unsigned long long p0 = __shfl_sync(emu::kFull, mine, 8 * i + 2 * t);
            const unsigned long long p1 = __shfl_sync(emu::kFull, mine, 8 * i + 2 * t + 1);
            unsigned short lo, hi;
            std::memcpy(&lo, reinterpret_cast<const char*>(p0) + 2 * g, 2);
            std::memcpy(&hi, reinterpret_cast<const char*>(p1) + 2 * g, 2);
            r[i] = (unsigned)lo | ((unsigned)hi << 16);
        } else {
            const unsigned long long p = __shfl_sync(emu::kFull, mine, 8 * i + g);
            std::memcpy(&r[i], reinterpret_cast<const char*>(p) + 4 * t, 4);
        }
    }
}

}  // namespace tc
}  // namespace cuonline
