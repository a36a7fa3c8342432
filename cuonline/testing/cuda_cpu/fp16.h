// fp16.h: __half and __nv_bfloat16 with bit-exact conversions, standing in for cuda_fp16.h and
// cuda_bf16.h (which the kernel text includes under #ifdef __CUDACC__ only).
#pragma once

#include "types.h"

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
