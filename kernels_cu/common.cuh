// common.cuh: device helpers shared by every cuonline kernel family.
//
// This file is pasted textually (by cuonline/kernels/source.py) in front of each family's text,
// after the #define lines that select the variant. It is never reached through -I: CuPy's
// on-disk cache key hashes the source string and the options only, so an #include'd header
// edit would leave stale binaries behind.
//
// The same text is compiled by NVRTC (on a GPU host, or for listings) and by g++ with the
// emulation header force-included (cuonline.testing.emulate). Everything that only NVRTC
// understands sits under #ifdef __CUDACC__.

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_bf16.h>
// Dynamic shared memory; the size comes from the launch. The emulation header defines its own
// version (a launch-time buffer) because g++ has no `extern __shared__`.
#define CUONLINE_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif

#define CUONLINE_FULL_MASK 0xffffffffu

namespace cuonline {

// Select<c, A, B>::type is A if c, else B (NVRTC and the emulation share no <type_traits>).
template <bool kCond, class A, class B> struct Select { typedef A type; };
template <class A, class B> struct Select<false, A, B> { typedef B type; };

// ---------------------------------------------------------------------------------------------
// numerics: one overload per accumulation type, so kernels are written once for float and double

// NVRTC has no <math.h> and so no INFINITY: build -inf from its bit pattern.
__device__ __forceinline__ float neg_inf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double neg_inf(double) { return (double)__int_as_float(0xff800000); }

__device__ __forceinline__ float exp2_(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_(double x) { return exp2(x); }
// Attention weights of the tensor-core kernel's inner loop: for float the hardware
// ex2.approx.ftz, the approximation exp2f itself rests on (about 2 ulp), without exp2f's
// handling of subnormal results (a compare and two multiplies per weight). A weight below
// 2^-126 becomes 0: next to the row's largest weight (exp2(0) = 1) it moves no float32 sum.
// Everything else keeps exp2_: softmax outputs return tiny results to the user, and in the
// SIMT kernel the change cost more registers (spills) than it saved. The CPU emulation's
// header defines the float overload (as exp2f) for the host compiler.
__device__ __forceinline__ float exp2_weight(float x);
#ifdef __CUDA_ARCH__
__device__ __forceinline__ float exp2_weight(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif
__device__ __forceinline__ double exp2_weight(double x) { return exp2(x); }
__device__ __forceinline__ float log2_(float x) { return log2f(x); }
__device__ __forceinline__ double log2_(double x) { return log2(x); }
__device__ __forceinline__ float tanh_(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return tanh(x); }
// fmax ignores a NaN operand: a NaN score then reaches the sum through exp2 and makes its own
// row NaN, while the running maximum stays usable for the other keys of that row.
__device__ __forceinline__ float max_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_(double a, double b) { return fmax(a, b); }

// NaN and +-inf fail the test (a NaN compares false); no bit casts, so the emulation needs none.
__device__ __forceinline__ bool is_finite_(float x) { return (x < 0 ? -x : x) <= 3.40282347e38f; }
__device__ __forceinline__ bool is_finite_(double x) {
    return (x < 0 ? -x : x) <= 1.7976931348623157e308;
}

// log2(e) and ln(2) in the accumulation type (functions, not static members, so that no
// constant lands in global memory).
__device__ __forceinline__ float log2e(float) { return 1.44269504088896340736f; }
__device__ __forceinline__ double log2e(double) { return 1.44269504088896340736; }
__device__ __forceinline__ float ln2(float) { return 0.693147180559945309417f; }
__device__ __forceinline__ double ln2(double) { return 0.693147180559945309417; }

// ---------------------------------------------------------------------------------------------
// element conversions: inputs are widened to the accumulation type once, when a tile is staged

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> struct FromAcc;
template <> struct FromAcc<float> {
    __device__ __forceinline__ static float cvt(float x) { return x; }
};
template <> struct FromAcc<double> {
    __device__ __forceinline__ static double cvt(double x) { return x; }
};
template <> struct FromAcc<__half> {
    __device__ __forceinline__ static __half cvt(float x) { return __float2half_rn(x); }
};
template <> struct FromAcc<__nv_bfloat16> {
    __device__ __forceinline__ static __nv_bfloat16 cvt(float x) { return __float2bfloat16_rn(x); }
};

// ---------------------------------------------------------------------------------------------
// warp reductions (butterfly: every lane ends with the result)

template <class Acc> __device__ __forceinline__ Acc warp_max(Acc x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        x = max_(x, __shfl_xor_sync(CUONLINE_FULL_MASK, x, offset));
    return x;
}

template <class Acc> __device__ __forceinline__ Acc warp_sum(Acc x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        x += __shfl_xor_sync(CUONLINE_FULL_MASK, x, offset);
    return x;
}

// ---------------------------------------------------------------------------------------------
// Online-softmax state of one query row, as seen by one lane of the warp that owns the row.
//
// Scores and m are in natural units, so that any finite score is representable; exp2 does the
// exponentials of (s - m) log2(e) (`weight`): s - m <= 0, and a product that overflows is
// -inf, weight 0, which is exp(s - m) rounded. The cost against folding log2(e) into the
// scale is one multiply per score (FADD + FMUL, where the fold needs one FFMA).
//   m : running maximum of the scores seen so far (the same in every lane of the warp)
//   l : this lane's share of sum_j exp(s_j - m)  (summed across the warp only at the end)
//   o : this lane's kCols output columns of sum_j exp(s_j - m) * v_j  (columns lane + 32*c)
// A row that has seen only masked keys keeps m = -inf, l = 0, o = 0; the guard in
// `rescale_to` never forms (-inf) - (-inf).
template <class Acc, int kCols> struct SoftmaxState {
    Acc m;
    Acc l;
    Acc o[kCols];

    __device__ __forceinline__ void init() {
        m = neg_inf(Acc());
        l = Acc(0);
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[c] = Acc(0);
    }

    // exp(s - m_use) as exp2((s - m_use) log2 e), for s <= m_use
    __device__ __forceinline__ static Acc weight(Acc s, Acc m_use) {
        return exp2_((s - m_use) * log2e(Acc()));
    }

    // Raise the running maximum to include `tile_max`; rescale l and o by exp(m_old - m_new).
    // Returns the offset to subtract from this tile's scores before exp: the new maximum, or 0
    // while the row has seen nothing (then every score is -inf and exp2 gives exactly 0).
    __device__ __forceinline__ Acc rescale_to(Acc tile_max) {
        const Acc m_new = max_(m, tile_max);
        const Acc m_use = (m_new == neg_inf(Acc())) ? Acc(0) : m_new;
        const Acc alpha = weight(m, m_use);  // m == -inf gives 0; l and o are 0 then anyway
        m = m_new;
        l *= alpha;
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[c] *= alpha;
        return m_use;
    }

    // Merge a finished partial result given as (lse_part, its normalised columns out_c), with
    // lse_part in natural units: the state then holds sum_i exp(lse_i - m) * out_i. Used by the
    // split-key combine, where each lane holds the whole l (not a share).
    __device__ __forceinline__ void merge(Acc lse_part, const Acc (&out)[kCols]) {
        const Acc m_use = rescale_to(lse_part);
        const Acc w = weight(lse_part, m_use);  // -inf gives 0: an empty part adds nothing
        l += w;
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[c] += w * out[c];
    }

    // Normalise: o /= l_total and return lse in natural-log units. A row with l_total == 0 saw
    // no visible key: o = 0 and lse = -inf. NaN (a NaN query) is not 0 and propagates to the row.
    __device__ __forceinline__ Acc finalize(Acc l_total) {
        if (l_total == Acc(0)) {
#pragma unroll
            for (int c = 0; c < kCols; ++c) o[c] = Acc(0);
            return neg_inf(Acc());
        }
        const Acc inv = Acc(1) / l_total;
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[c] *= inv;
        return m + log2_(l_total) * ln2(Acc());  // m in natural units: no overflow
    }
};

// ---------------------------------------------------------------------------------------------
// Online normalizer of one row (Milakov & Gimelshein 2018), as used by the softmax family.
//
//   m : running maximum of the raw values seen so far (-inf: none yet)
//   l : sum_j exp2((x_j - m) * scale_log2)
// Unlike SoftmaxState, m stays in the units of the input: x - m is then exact for nearby
// values, so inputs of magnitude 1e4 in float32 keep full relative precision (a log2-unit m
// would round x * log2(e) to ~1e-3 there). Special values follow NumPy's max-then-exp:
// -inf (or masked) adds 0; a row of only those keeps l = 0 and never forms (-inf) - (-inf);
// NaN makes l NaN (max_ ignores it, exp2 does not); +inf makes l NaN through inf - inf.
template <class Acc> struct OnlineNormalizer {
    Acc m;
    Acc l;

    __device__ __forceinline__ void init() {
        m = neg_inf(Acc());
        l = Acc(0);
    }

    // Raise m to include `chunk_max`, rescale l by exp2((m_old - m_new) * scale_log2), and
    // return the offset to subtract from the chunk's values before exp2: the new maximum, or 0
    // while the row has seen nothing finite (its values are then -inf and exp2 gives 0).
    __device__ __forceinline__ Acc rescale_to(Acc chunk_max, Acc scale_log2) {
        const Acc m_new = max_(m, chunk_max);
        const Acc m_use = (m_new == neg_inf(Acc())) ? Acc(0) : m_new;
        l *= exp2_((m - m_use) * scale_log2);
        m = m_new;
        return m_use;
    }

    // Fold in another partial state (m2, l2) of the same row; commutative bit for bit (the
    // sum of two products), so a butterfly leaves every lane with the same state.
    __device__ __forceinline__ void merge(Acc m2, Acc l2, Acc scale_log2) {
        const Acc m_new = max_(m, m2);
        const Acc m_use = (m_new == neg_inf(Acc())) ? Acc(0) : m_new;
        l = l * exp2_((m - m_use) * scale_log2) + l2 * exp2_((m2 - m_use) * scale_log2);
        m = m_new;
    }

    // Merge the states of the lanes of one warp (butterfly: every lane ends with the result).
    __device__ __forceinline__ void warp_merge(Acc scale_log2) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const Acc m2 = __shfl_xor_sync(CUONLINE_FULL_MASK, m, offset);
            const Acc l2 = __shfl_xor_sync(CUONLINE_FULL_MASK, l, offset);
            merge(m2, l2, scale_log2);
        }
    }

    // log(sum_j exp(scale * x_j)) in natural-log units: -inf for an empty row, NaN stays NaN.
    __device__ __forceinline__ Acc lse(Acc scale) const {
        if (l == Acc(0)) return neg_inf(Acc());
        return m * scale + log2_(l) * ln2(Acc());
    }
};

}  // namespace cuonline
