// math_functions.h: CUDA's math functions and intrinsics on libm and bit casts.
#pragma once

#include "types.h"

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
// The inline-PTX helper of kernels_cu/common.cuh (declared there, defined there under
// #ifdef __CUDA_ARCH__ only): ex2.approx.ftz.f32 becomes the exact exp2f.
namespace cuonline {
__device__ __forceinline__ float exp2_weight(float x) { return exp2f(x); }
}  // namespace cuonline
