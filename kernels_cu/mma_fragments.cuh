// mma_fragments.cuh: the tensor-core family's fragment traits, one per element type.
//
// Pasted (by cuonline/kernels/source.py, in the order cuonline/kernels/families.py lists) after
// common.cuh and tensor_core.cuh (the PTX helpers: ldmatrix, mma, the swizzled SmemTile) into
// the tensor-core family's text. Ops<T> is everything attention_fwd_mma.cu knows of an element
// type: the mma's k, the register fragments, how they are loaded from shared memory and how
// the score accumulators become the A operand of P·V. Reads no variant define.

namespace cuonline {
namespace mma {

using namespace cuonline::tc;

// ---------------------------------------------------------------------------------------------
// Ops<T>: the element type's mma and its fragment loads. Interface:
//   kK                       the mma's k (16 f16/bf16, 8 tf32, 4 f64)
//   AFrag, BFrag             register fragments of A (16 x kK) and B (kK x 8)
//   load_a<L>(a, s, r0, k0)  A = s[r0 .. r0+16)[k0 .. k0+kK)       (s: (rows, cols) tile, L layout)
//   load_bt2<L>(b0, b1, s, n0, k0)   B = s[n0 .. n0+8)[k0 ..]^T and the next 8 rows (K for Q·K^T)
//   load_pv_b2<L>(b0, b1, s, kk, n0) B of P·V k-step kk: s[keys of kk][n0 .. n0+8) (V), and
//                                    the next 8 columns
//   p_to_a(a, p, kk)         the A fragment of P·V k-step kk from the score accumulators p
//   mma(d, a, b)             d += a b on one 16x8 tile
// P·V may visit the keys of a k-step in any order as long as p_to_a and load_pv_b agree: tf32
// and f64 take the order in which the score accumulators already sit in the lane (2t, 2t+1),
// which saves every shuffle.

__device__ __forceinline__ int lane_() { return threadIdx.x % 32; }

// ldmatrix of row-major tiles for Q (A) and K (B = K^T), shared by the 16-bit types and tf32.
// An ldmatrix row is 16 bytes: 8 halves or 4 floats, and register i of lane (g, t) receives
// b16 pair t of row g of matrix i, i.e. elements 2t, 2t + 1 (16-bit) or element t (float):
// exactly the A and B fragment layouts of m16n8k16 and of m16n8k8.tf32.
template <class E> struct LdsmQK {
    static constexpr int kC = 16 / int(sizeof(E));  // elements per ldmatrix row
    // x4: lane supplies row r0 + lane % 16 at column k0 + kC (lane / 16): registers are
    // A[g][t], A[g + 8][t], A[g][t + kC], A[g + 8][t + kC] (in units of the b16 pair)
    template <class L>
    __device__ __forceinline__ static void load_a(unsigned (&a)[4], const E* s, int r0, int k0) {
        const int lane = lane_();
        ldmatrix_x4(a, s + split_offset<L>(r0, k0, lane % 16, (lane / 16) * kC));
    }
    // x4 of an (n, k) tile: rows n0 + 8 (lane / 16) + lane % 8, columns k0 + kC ((lane / 8) % 2);
    // registers {0, 1} are n-tile n0, {2, 3} n-tile n0 + 8
    template <class L>
    __device__ __forceinline__ static void load_bt2(unsigned (&b0)[2], unsigned (&b1)[2],
                                                   const E* s, int n0, int k0) {
        const int lane = lane_();
        unsigned r[4];
        ldmatrix_x4(r, s + split_offset<L>(n0, k0, (lane / 16) * 8 + lane % 8,
                                           ((lane / 8) % 2) * kC));
        b0[0] = r[0]; b0[1] = r[1]; b1[0] = r[2]; b1[1] = r[3];
    }
};

template <class T16> struct Ops16 {
    static constexpr int kK = 16;
    static constexpr bool kRoundTiles = false;  // see Ops<float>
    typedef unsigned AFrag[4];
    typedef unsigned BFrag[2];

    template <class L>
    __device__ __forceinline__ static void load_a(AFrag& a, const T16* s, int r0, int k0) {
        LdsmQK<T16>::template load_a<L>(a, s, r0, k0);
    }
    template <class L>
    __device__ __forceinline__ static void load_bt2(BFrag& b0, BFrag& b1, const T16* s, int n0,
                                                   int k0) {
        LdsmQK<T16>::template load_bt2<L>(b0, b1, s, n0, k0);
    }
    // ldmatrix x4 .trans of a (k, n) tile: lane supplies key row 16 kk + lane % 16 at column
    // n0 + 8 (lane / 16); registers {0, 1} are n-tile n0, {2, 3} n-tile n0 + 8
    template <class L>
    __device__ __forceinline__ static void load_pv_b2(BFrag& b0, BFrag& b1, const T16* s, int kk,
                                                     int n0) {
        const int lane = lane_();
        unsigned r[4];
        ldmatrix_x4_trans(r, s + split_offset<L>(16 * kk, n0, lane % 16, (lane / 16) * 8));
        b0[0] = r[0]; b0[1] = r[1]; b1[0] = r[2]; b1[1] = r[3];
    }
    // Two n-tiles of the score accumulators are one A fragment (acc_to_a_frag).
    template <int kNt>
    __device__ __forceinline__ static void p_to_a(AFrag& a, const float (&p)[kNt][4], int kk) {
        acc_to_a_frag<T16>(a, p[2 * kk], p[2 * kk + 1]);
    }
    __device__ __forceinline__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b) {
        mma_m16n8k16<T16>(d, a, b, d);
    }
};

template <class X> struct Ops;
template <> struct Ops<__half> : Ops16<__half> {};
template <> struct Ops<__nv_bfloat16> : Ops16<__nv_bfloat16> {};

// tf32: float tiles in shared memory. K and V are rounded to tf32 (cvt.rna) in the tile,
// Q and P as their fragments are built.
template <> struct Ops<float> {
    static constexpr int kK = 8;
    // K and V tiles are rounded to tf32 in shared memory once per tile (round_tile, by the
    // threads that loaded them) rather than by every warp at every fragment load; Q (loaded
    // once) and P (in registers) are rounded as their fragments are built.
    static constexpr bool kRoundTiles = true;
    typedef unsigned AFrag[4];
    typedef unsigned BFrag[2];

    // a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4], by ldmatrix
    // (4 floats per row), then rounded
    template <class L>
    __device__ __forceinline__ static void load_a(AFrag& a, const float* s, int r0, int k0) {
        LdsmQK<float>::template load_a<L>(a, s, r0, k0);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = to_tf32(__uint_as_float(a[i]));
    }
    // b[0] = B[t][g] = s[n0 + g][k0 + t], b[1] = B[t+4][g], for n-tiles n0 and n0 + 8
    template <class L>
    __device__ __forceinline__ static void load_bt2(BFrag& b0, BFrag& b1, const float* s, int n0,
                                                   int k0) {
        LdsmQK<float>::template load_bt2<L>(b0, b1, s, n0, k0);  // K: rounded in the tile
    }
    // k-step kk covers keys 8 kk .. 8 kk + 7 in the order 0, 2, 4, 6, 1, 3, 5, 7: lane (g, t)
    // holds P[g][2t], P[g][2t+1] = A[g][t], A[g][t+4], so B[t][n] = V[2t][n], B[t+4][n] = V[2t+1][n].
    template <class L>
    __device__ __forceinline__ static void load_pv_b2(BFrag& b0, BFrag& b1, const float* s, int kk,
                                                     int n0) {
        const int g = lane_() / 4, t = lane_() % 4;
        b0[0] = __float_as_uint(s[split_offset<L>(8 * kk, n0, 2 * t, g)]);  // V: rounded
        b0[1] = __float_as_uint(s[split_offset<L>(8 * kk, n0, 2 * t + 1, g)]);
        b1[0] = __float_as_uint(s[split_offset<L>(8 * kk, n0 + 8, 2 * t, g)]);
        b1[1] = __float_as_uint(s[split_offset<L>(8 * kk, n0 + 8, 2 * t + 1, g)]);
    }
    template <int kNt>
    __device__ __forceinline__ static void p_to_a(AFrag& a, const float (&p)[kNt][4], int kk) {
        a[0] = to_tf32(p[kk][0]);
        a[1] = to_tf32(p[kk][2]);
        a[2] = to_tf32(p[kk][1]);
        a[3] = to_tf32(p[kk][3]);
    }
    __device__ __forceinline__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b) {
        mma_m16n8k8_tf32(d, a, b, d);
    }
};

// f64: a 16x8 tile is two m8n8k4 (rows g and g + 8); the four accumulators keep the m16n8
// layout, so the softmax code is the same as for the other types.
template <> struct Ops<double> {
    static constexpr int kK = 4;
    static constexpr bool kRoundTiles = false;
    typedef double AFrag[2];  // A[g][t], A[g+8][t]
    typedef double BFrag[1];  // B[t][g]

    template <class L>
    __device__ __forceinline__ static void load_a(AFrag& a, const double* s, int r0, int k0) {
        const int g = lane_() / 4, t = lane_() % 4;
        a[0] = s[split_offset<L>(r0, k0, g, t)];
        a[1] = s[split_offset<L>(r0, k0, g + 8, t)];
    }
    template <class L>
    __device__ __forceinline__ static void load_bt2(BFrag& b0, BFrag& b1, const double* s, int n0,
                                                   int k0) {
        const int g = lane_() / 4, t = lane_() % 4;
        b0[0] = s[split_offset<L>(n0, k0, g, t)];
        b1[0] = s[split_offset<L>(n0, k0, 8 + g, t)];
    }
    // k-step kk covers keys 8 (kk / 2) + 2t + (kk % 2), t = 0..3: the column of the score
    // accumulator the lane already holds (p[kk / 2][kk % 2] and p[kk / 2][2 + kk % 2]).
    template <class L>
    __device__ __forceinline__ static void load_pv_b2(BFrag& b0, BFrag& b1, const double* s, int kk,
                                                     int n0) {
        const int g = lane_() / 4, t = lane_() % 4;
        b0[0] = s[split_offset<L>(8 * (kk / 2), n0, 2 * t + kk % 2, g)];
        b1[0] = s[split_offset<L>(8 * (kk / 2), n0 + 8, 2 * t + kk % 2, g)];
    }
    template <int kNt>
    __device__ __forceinline__ static void p_to_a(AFrag& a, const double (&p)[kNt][4], int kk) {
        a[0] = p[kk / 2][kk % 2];
        a[1] = p[kk / 2][2 + kk % 2];
    }
    __device__ __forceinline__ static void mma(double (&d)[4], const AFrag& a, const BFrag& b) {
        double up[2] = {d[0], d[1]};
        double lo[2] = {d[2], d[3]};
        mma_m8n8k4_f64(up, a[0], b[0], up);
        mma_m8n8k4_f64(lo, a[1], b[0], lo);
        d[0] = up[0]; d[1] = up[1]; d[2] = lo[0]; d[3] = lo[1];
    }
};

}  // namespace mma
}  // namespace cuonline
