// attention_mma.cu: exact attention forward on tensor cores, FlashAttention-2 loop shape.
//
// Variant selection: source.py prepends #define lines (see MmaSpec in cuonline/kernels/specs.py)
// and pastes common.cuh, tensor_core.cuh and attention_combine.cuh. Required defines:
//   CUONLINE_T, CUONLINE_ACC     element / accumulation type, one of
//                                  __half, float          mma.m16n8k16 f16, f32 accumulators
//                                  __nv_bfloat16, float   mma.m16n8k16 bf16, f32 accumulators
//                                  float, float           mma.m16n8k8 tf32 (precision="tf32")
//                                  double, double         mma.m8n8k4 f64, f64 accumulators
//   CUONLINE_D, CUONLINE_DV      head dims of q/k and of v (may differ); padded in shared memory
//                                to kDp (a multiple of the mma k) and kDvp (a multiple of 16),
//                                the padding zero-filled
//   CUONLINE_WARPS               warps per block
//   CUONLINE_M_TILES             16-row query tiles per warp (1 or 2): warp w owns query rows
//                                [16 kMt w, 16 kMt (w + 1)); with 2, every K and V fragment a
//                                warp loads from shared memory feeds twice the mmas
//   CUONLINE_BLOCK_N             keys per tile (a multiple of 16)
//   CUONLINE_STAGES              K/V tiles in flight (1: load then compute; 2: tile j+1 loads
//                                while tile j computes)
//   CUONLINE_CP_ASYNC            1: q/k/v rows are 16-byte aligned with unit column stride and
//                                go global -> shared by cp.async; 0: element-wise loads (any
//                                strides) into the same layout
//   CUONLINE_HAS_WINDOW, _HAS_BIAS, _HAS_MASK, _HAS_KV_LENGTHS, _HAS_ALIBI, _HAS_SOFTCAP,
//   CUONLINE_RETURN_LSE, CUONLINE_SPLIT   feature flags, 0 or 1 (as in attention_fwd.cu)
//
// Work decomposition (the arguments: CUONLINE_ATTENTION_PARAMS in attention_block.cuh)
//   grid.x = nbatch * n_query_tiles, grid.z = key splits; block = kWarps warps.
//   Every product is a sequence of 16x8 output tiles: a warp multiplies its 16 query rows by 8
//   keys (scores) or 8 output columns (P·V). The accumulator of a 16x8 tile is 4 values per
//   lane in the m16n8 C layout: lane (g = lane / 4, t = lane % 4) holds rows g and g + 8,
//   columns 2t and 2t + 1. f64 issues two m8n8k4 per tile (rows 0-7 and 8-15): the m8n8 C
//   fragment is the upper half of the m16n8 one, so all four element types share this body and
//   only the Ops traits below differ.
//   Online softmax in that layout: each lane keeps the state of its two rows (m, its share of
//   l, its columns of o); row maxima and sums reduce over the 4 lanes of a quad (shfl_xor 1, 2).
//   P = exp(S - m) becomes the A operand of P·V in registers (no shared-memory round trip).
// Shared memory (dynamic, element type T, conflict-free layouts from tensor_core.cuh):
//   sQ: (kBlockM, kDp)                      loaded once
//   sK: (kStages, kBlockN, kDp)             ring of K tiles
//   sV: (kStages, kBlockN, kDvp)            ring of V tiles
// Operands are addressed as in attention_fwd.cu: base + offsets[b * 5 + op] + row *
// strides[2 op] + col * strides[2 op + 1] (elements, 64-bit); out and lse are contiguous.

#ifndef CUONLINE_STAGES
#error "attention_mma.cu needs the CUONLINE_* variant defines (see cuonline/kernels/specs.py)"
#endif

namespace cuonline {
namespace mma {

using namespace cuonline::tc;

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;

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

typedef Ops<T> Op;

// ---------------------------------------------------------------------------------------------
// compile-time shape

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

constexpr int kD = CUONLINE_D;
constexpr int kDv = CUONLINE_DV;
constexpr int kWarps = CUONLINE_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kMt = CUONLINE_M_TILES;
constexpr int kBlockM = 16 * kMt * kWarps;
constexpr int kBlockN = CUONLINE_BLOCK_N;
constexpr int kStages = CUONLINE_STAGES;
constexpr int kDp = round_up(kD, Op::kK);   // Q·K^T reduction length, zero-padded
constexpr int kDvp = round_up(kDv, 16);     // P·V output columns, zero-padded (n-tile pairs)
constexpr int kNt = kBlockN / 8;            // score n-tiles per warp
constexpr int kNv = kDvp / 8;               // output n-tiles per warp
constexpr int kKs = kDp / Op::kK;           // k-steps of Q·K^T
constexpr int kKv = kBlockN / Op::kK;       // k-steps of P·V
static_assert(kBlockN % 16 == 0, "key tiles are pairs of 8-key n-tiles");
static_assert(kStages == 1 || kStages == 2, "one or two K/V stages");
static_assert(kMt == 1 || kMt == 2, "one or two 16-row query tiles per warp");
// Q fragments stay in registers when they are small (32 words at most: f16 D <= 128 with one
// query tile per warp, D <= 64 with two); larger ones are re-read from sQ each tile rather
// than spill.
constexpr int kAFragWords = int(sizeof(typename Op::AFrag) / 4);
constexpr bool kQInRegs = kMt * kKs * kAFragWords <= 32;

typedef SmemTile<kDp, int(sizeof(T))> LQK;   // layout of sQ and of each sK stage
typedef SmemTile<kDvp, int(sizeof(T))> LV;   // layout of each sV stage
constexpr int kQElems = kBlockM * LQK::kStride;
constexpr int kKElems = kBlockN * LQK::kStride;
constexpr int kVElems = kBlockN * LV::kStride;
constexpr int kChunk = 16 / int(sizeof(T));  // elements per 16-byte chunk

constexpr int kNumOperands = 5;
enum Operand { kQ = 0, kK = 1, kV = 2, kBias = 3, kMask = 4 };

#if CUONLINE_SPLIT
typedef Acc OutT;  // partial, normalised out per split (workspace), merged by the combine
#else
typedef T OutT;
#endif

// The 16-byte chunks of a (kRows, kPadCols) tile that this thread moves. The first kLoaders
// threads (whole rows of chunks: all of them for power-of-two widths, 120 of 128 for the 12
// chunks of D = 96) each keep one chunk column and step down the rows kRowStep at a time: its
// column, its first shared-memory offset and its global address are worked out once per tile,
// and each further chunk is one constant step away in both (fully unrolled; see load_tile).
// Rows wider than the block (f64 D = 128 on one warp) take a plain strided loop.
template <int kRows, int kPadCols>
struct OwnChunks {
    static constexpr int kRowChunks = kPadCols / kChunk;
    static constexpr int kLoaders = kThreads / kRowChunks * kRowChunks;
    static constexpr bool kOneColumn = kLoaders > 0;
    static constexpr int kRowStep = kOneColumn ? kLoaders / kRowChunks : 1;
    static constexpr int kSteps = (kRows + kRowStep - 1) / kRowStep;  // kOneColumn only

    // f(r, col) for every chunk (r, col) of this thread
    template <class F>
    __device__ __forceinline__ static void for_each(F&& f) {
        if constexpr (kOneColumn) {
            if (kLoaders < kThreads && int(threadIdx.x) >= kLoaders) return;
            const int col = int(threadIdx.x) % kRowChunks * kChunk;
            const int r_first = int(threadIdx.x) / kRowChunks;
#pragma unroll
            for (int k = 0; k < kSteps; ++k) {
                const int r = r_first + k * kRowStep;
                if (kRows % kRowStep == 0 || r < kRows) f(r, col);
            }
        } else {
            for (int idx = threadIdx.x; idx < kRows * kRowChunks; idx += kThreads) {
                const int r = idx / kRowChunks;
                f(r, (idx - r * kRowChunks) * kChunk);
            }
        }
    }
};

// Stage rows [r0, r0 + kRows) x columns [0, kCols) of a (rows, cols) operand into a tile of
// layout L whose padded width is L's; rows at or past row_end and columns past kCols are zero
// and never read from global memory. cp.async moves whole 16-byte chunks (host-checked
// alignment); the fallback reads elements through both strides.
template <class L, int kRows, int kCols, int kPadCols>
__device__ __forceinline__ void load_tile(T* s, const T* base, long long row_stride,
                                          long long col_stride, long long r0, long long row_end) {
    typedef OwnChunks<kRows, kPadCols> Own;
    // rows of the tile that exist in the operand, in [0, kRows]
    const long long left = row_end - r0;
    const int rows = left <= 0 ? 0 : (left >= kRows ? kRows : int(left));
    const T* tile = base + r0 * row_stride;
#if CUONLINE_CP_ASYNC
    (void)col_stride;
    if constexpr (Own::kOneColumn) {
        // The lean path: per chunk, one 64-bit pointer step, a row test and the copy. When
        // kRowStep is a multiple of the layout's row period (8 for the swizzle, 1 for padded
        // rows) the shared offsets are compile-time steps from the first one.
        if (Own::kLoaders < kThreads && int(threadIdx.x) >= Own::kLoaders) return;
        const int col = int(threadIdx.x) % Own::kRowChunks * kChunk;
        const int r_first = int(threadIdx.x) / Own::kRowChunks;
        // bytes of this thread's column that lie inside kCols (16 unless D is padded)
        int col_bytes = 16;
        if constexpr (kCols < kPadCols) {
            col_bytes = (kCols - col) * int(sizeof(T));
            col_bytes = col_bytes < 0 ? 0 : (col_bytes > 16 ? 16 : col_bytes);
        }
        // A chunk past `rows` copies 0 bytes and zero-fills: its address is formed, never read
        // (cp.async with src-size 0). The pointer steps by src_step rather than being
        // recomputed as src + k src_step: ptxas then keeps one pointer live, not one per chunk
        // (f16 D = 64: 168 registers against 178).
        const T* src = tile + r_first * row_stride + col;
        const long long src_step = Own::kRowStep * row_stride;
        T* const dst = s + L::offset(r_first, col);
#pragma unroll
        for (int k = 0; k < Own::kSteps; ++k, src += src_step) {
            const int r = r_first + k * Own::kRowStep;
            if (kRows % Own::kRowStep != 0 && r >= kRows) break;
            T* d = Own::kRowStep % L::kRowPeriod == 0 ? dst + k * Own::kRowStep * L::kStride
                                                      : s + L::offset(r, col);
            cp_async_16(d, src, r < rows ? col_bytes : 0);
        }
    } else {
        Own::for_each([&](int r, int col) {  // rows wider than the block
            int bytes = r < rows ? (kCols - col) * int(sizeof(T)) : 0;
            bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
            cp_async_16(s + L::offset(r, col), tile + r * row_stride + col, bytes);
        });
    }
#else
    Own::for_each([&](int r, int col) {
        T* dst = s + L::offset(r, col);
        const T* src = tile + r * row_stride + col * col_stride;
#pragma unroll
        for (int e = 0; e < kChunk; ++e)
            dst[e] = r < rows && col + e < kCols ? src[e * col_stride] : FromAcc<T>::cvt(0.0f);
    });
#endif
}

// tf32 (Ops<float>::kRoundTiles): round this thread's chunks of a staged tile in place. Called
// after this thread's copies landed and before the barrier that hands the tile to all warps.
template <class L, int kRows, int kPadCols>
__device__ __forceinline__ void round_tile(T* s) {
    OwnChunks<kRows, kPadCols>::for_each([&](int r, int col) {
        T* chunk = s + L::offset(r, col);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) chunk[e] = __uint_as_float(to_tf32(chunk[e]));
    });
}

// ---------------------------------------------------------------------------------------------
// The scalar slow path of a row whose output came out non-finite (see the kernel's last loop):
// values as the mma sees them, so that the recomputed row rounds as the fast path does.

// An element of q, k or v as an mma operand: tf32 rounds to nearest (cvt.rna, as the tiles
// and the Q fragments are rounded); the 16-bit types and f64 widen exactly.
template <class E>
__device__ __forceinline__ Acc mma_operand(E x) {
    if constexpr (Op::kRoundTiles) return __uint_as_float(to_tf32(x));
    else return to_acc(x);
}
// A weight P as the A operand of P·V: rounded to the input type (16-bit types, as
// acc_to_a_frag) or to tf32; f64 unchanged.
template <class E = T>
__device__ __forceinline__ Acc mma_weight(Acc p) {
    if constexpr (sizeof(E) == 2) return to_acc(FromAcc<E>::cvt(p));
    else if constexpr (Op::kRoundTiles) return __uint_as_float(to_tf32(p));
    else return p;
}
// The same 64-bit value (a pointer or an integer), opaque to the compiler. After the key loop:
// values loaded through an opaque pointer are loaded again rather than kept in registers
// through the loop from the loads before it. Inside the slow path's key loop: an opaque step
// keeps the compiler from hoisting one 64-bit offset per output column out of it (Dv = 256:
// 64 registers, and spills).
template <class X>
__device__ __forceinline__ X opaque(X x) {
    static_assert(sizeof(X) == 8, "a 64-bit value");
#ifdef __CUDA_ARCH__
    asm volatile("" : "+l"(x));
#endif
    return x;
}
// Every accumulator of the lane's share of a row is finite (NaN and +-inf fail).
template <int kN>
__device__ __forceinline__ bool all_finite(const Acc (&o)[kN]) {
    bool ok = true;
#pragma unroll
    for (int c = 0; c < kN; ++c) ok = ok && is_finite_(o[c]);
    return ok;
}

}  // namespace mma
}  // namespace cuonline

// "at least 1 block per SM": without it sm_90's ptxas capped some variants at 128 registers (4
// blocks of 128 threads per SM) and spilled (f16, D = 64, kv_lengths); with it they take ~150
// and 3 blocks fit. Whether the spill-free variant is also the faster one is for a GPU to say.
extern "C" __global__ void __launch_bounds__(cuonline::mma::kThreads, 1)
cuonline_attention_mma(CUONLINE_ATTENTION_PARAMS(cuonline::mma::OutT))
{
    using namespace cuonline;
    using namespace cuonline::mma;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_T, cuonline_mma_smem);
    T* sQ = cuonline_mma_smem;                 // (kBlockM, kDp)
    T* sK = sQ + kQElems;                      // (kStages, kBlockN, kDp)
    T* sV = sK + kStages * kKElems;            // (kStages, kBlockN, kDvp)

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    // ---- which queries, and which keys may be visible to them (attention_block.cuh)
    const BlockRange range =
        block_range<kBlockM>(lq, lk, kv_lengths, window_left, window_right, split_keys);
    const long long b = range.b, i0 = range.i0, i_end = range.i_end, diag = range.diag;
    const long long key_end = range.key_end, j_lo = range.j_lo, j_hi = range.j_hi;

    const long long* off = offsets + b * kNumOperands;
    const T* q_b = q + off[kQ];
    const T* k_b = k + off[kK];
    const T* v_b = v + off[kV];

    const ScoreMap<Acc> score_map(scale, softcap, alibi, b);  // scores in natural units

    // Lane's rows: slot r = 2 mt + h is row row0 + 8 r (query tile mt, h = 0: row g, h = 1:
    // row g + 8). state[r].o[2 nv + c] is output column 8 nv + 2t + c of slot r: the C layout
    // of n-tile nv, split by row.
    constexpr int kSlots = 2 * kMt;
    const int warp_row = 16 * kMt * warp;  // the warp's first row in the block
    const long long row0 = i0 + warp_row + g;
    SoftmaxState<Acc, 2 * kNv> state[kSlots];
#pragma unroll
    for (int r = 0; r < kSlots; ++r) state[r].init();

    if (j_lo < j_hi) {
        const long long tile_first = j_lo / kBlockN;
        const long long n_tiles = (j_hi + kBlockN - 1) / kBlockN - tile_first;
        const long long rs_k = strides[2 * kK], cs_k = strides[2 * kK + 1];
        const long long rs_v = strides[2 * kV], cs_v = strides[2 * kV + 1];

        // ---- prologue: Q in its own group, then the first kStages - 1 K/V tiles
        load_tile<LQK, kBlockM, kD, kDp>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0, lq);
        cp_async_commit();
#pragma unroll
        for (int s = 0; s + 1 < kStages; ++s) {
            if (s < n_tiles) {
                const long long j0 = (tile_first + s) * kBlockN;
                load_tile<LQK, kBlockN, kD, kDp>(sK + s * kKElems, k_b, rs_k, cs_k, j0, key_end);
                load_tile<LV, kBlockN, kDv, kDvp>(sV + s * kVElems, v_b, rs_v, cs_v, j0, key_end);
            }
            cp_async_commit();  // empty groups keep the group count uniform
        }

        typename Op::AFrag qf[kMt][kKs];  // used (and kept in registers) when kQInRegs
        if constexpr (kQInRegs) {
            cp_async_wait<kStages - 1>();  // the Q group
            __syncthreads();
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
                for (int ks = 0; ks < kKs; ++ks)
                    Op::template load_a<LQK>(qf[mt][ks], sQ, warp_row + 16 * mt, ks * Op::kK);
        }

        for (long long n = 0; n < n_tiles; ++n) {
            const long long j0 = (tile_first + n) * kBlockN;
            // ---- issue tile n + kStages - 1 into the stage that tile n - 1 used
            if (kStages > 1 && n + kStages - 1 < n_tiles) {
                const int s = int((n + kStages - 1) % kStages);
                const long long jn = j0 + (kStages - 1) * kBlockN;
                load_tile<LQK, kBlockN, kD, kDp>(sK + s * kKElems, k_b, rs_k, cs_k, jn, key_end);
                load_tile<LV, kBlockN, kDv, kDvp>(sV + s * kVElems, v_b, rs_v, cs_v, jn, key_end);
            } else if (kStages == 1) {
                load_tile<LQK, kBlockN, kD, kDp>(sK, k_b, rs_k, cs_k, j0, key_end);
                load_tile<LV, kBlockN, kDv, kDvp>(sV, v_b, rs_v, cs_v, j0, key_end);
            }
            cp_async_commit();
            cp_async_wait<kStages - 1>();  // tile n (and Q) landed for this thread...
            if constexpr (Op::kRoundTiles) {
                round_tile<LQK, kBlockN, kDp>(sK + int(n % kStages) * kKElems);
                round_tile<LV, kBlockN, kDvp>(sV + int(n % kStages) * kVElems);
            }
            __syncthreads();               // ...and for every thread
            const T* sKn = sK + int(n % kStages) * kKElems;
            const T* sVn = sV + int(n % kStages) * kVElems;

            // ---- scores: S (16 kMt x kBlockN per warp) = Q K^T; each K fragment feeds kMt
            //      query tiles
            Acc sc[kMt][kNt][4];
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) sc[mt][nt][i] = Acc(0);
#pragma unroll
            for (int ks = 0; ks < kKs; ++ks) {
                typename Op::AFrag af_smem[kMt];  // used when !kQInRegs
                if constexpr (!kQInRegs) {
#pragma unroll
                    for (int mt = 0; mt < kMt; ++mt)
                        Op::template load_a<LQK>(af_smem[mt], sQ, warp_row + 16 * mt,
                                                 ks * Op::kK);
                }
#pragma unroll
                for (int nt = 0; nt < kNt; nt += 2) {
                    typename Op::BFrag b0, b1;
                    Op::template load_bt2<LQK>(b0, b1, sKn, nt * 8, ks * Op::kK);
#pragma unroll
                    for (int mt = 0; mt < kMt; ++mt) {
                        const typename Op::AFrag& af = kQInRegs ? qf[mt][ks] : af_smem[mt];
                        Op::mma(sc[mt][nt], af, b0);
                        Op::mma(sc[mt][nt + 1], af, b1);
                    }
                }
            }

            // ---- score transform (softcap, bias, ALiBi) and masking, in natural units;
            //      sc[mt][nt][2h + c] is slot 2 mt + h (row row0 + 16 mt + 8h), key
            //      j0 + 8 nt + 2t + c.
            // An interior tile (all rows < lq, all keys inside [j_lo, j_hi), which lies inside
            // [0, key_end), and inside every row's window) needs no per-element range test:
            // the block-uniform branch saves the 64-bit compares on most tiles.
            bool interior = i0 + kBlockM <= lq && j0 >= j_lo && j0 + kBlockN <= j_hi;
#if CUONLINE_HAS_WINDOW
            interior = interior && j0 >= i_end - 1 + diag - window_left &&
                       j0 + kBlockN - 1 <= i0 + diag + window_right;
#endif
            // Mask and bias rows of this tile at the lane's first key (j0 + 2t): an element is
            // then one multiple of the column stride away (pointers are only dereferenced for
            // visible elements, which lie inside the operand).
#if CUONLINE_HAS_MASK
            const long long mask_cs = strides[2 * kMask + 1];
            const unsigned char* mask_row[kSlots];
#pragma unroll
            for (int r = 0; r < kSlots; ++r)
                mask_row[r] = mask + off[kMask] + (row0 + 8 * r) * strides[2 * kMask] +
                              (j0 + 2 * t) * mask_cs;
#endif
#if CUONLINE_HAS_BIAS
            const long long bias_cs = strides[2 * kBias + 1];
            const Acc* bias_row[kSlots];
#pragma unroll
            for (int r = 0; r < kSlots; ++r)
                bias_row[r] = bias + off[kBias] + (row0 + 8 * r) * strides[2 * kBias] +
                              (j0 + 2 * t) * bias_cs;
#endif
            Acc tile_max[kSlots];
#pragma unroll
            for (int r = 0; r < kSlots; ++r) tile_max[r] = neg_inf(Acc());
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = 2 * mt + (e >> 1);
                        const long long i = row0 + 8 * r;
                        const long long j = j0 + 8 * nt + 2 * t + (e & 1);
                        bool visible = true;
                        if (!interior) {
                            visible = i < lq && j < key_end && j >= j_lo && j < j_hi;
#if CUONLINE_HAS_WINDOW
                            visible = visible && j >= i + diag - window_left &&
                                      j <= i + diag + window_right;
#endif
                        }
#if CUONLINE_HAS_MASK
                        if (visible) visible = mask_row[r][(8 * nt + (e & 1)) * mask_cs] != 0;
#endif
                        Acc x = score_map.scaled(sc[mt][nt][e]);
#if CUONLINE_HAS_BIAS
                        if (visible)
                            x += score_map.bias(bias_row[r][(8 * nt + (e & 1)) * bias_cs]);
#endif
#if CUONLINE_HAS_ALIBI
                        x -= score_map.alibi(i + diag, j);
#endif
                        sc[mt][nt][e] = visible ? x : neg_inf(Acc());
                        tile_max[r] = max_(tile_max[r], sc[mt][nt][e]);
                    }
                }

            // ---- rescale running state to the new row max (quad-wide); p = exp(s - m)
#pragma unroll
            for (int r = 0; r < kSlots; ++r) {
                const int mt = r / 2, h = r % 2;
                Acc mx = tile_max[r];
                mx = max_(mx, __shfl_xor_sync(CUONLINE_FULL_MASK, mx, 1));
                mx = max_(mx, __shfl_xor_sync(CUONLINE_FULL_MASK, mx, 2));
                const Acc m_use = state[r].rescale_to(mx);
#pragma unroll
                for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        // natural units: log2(e) multiplies only s - m <= 0 (common.cuh)
                        const Acc p =
                            exp2_weight((sc[mt][nt][2 * h + c] - m_use) * log2e(Acc()));
                        sc[mt][nt][2 * h + c] = p;
                        state[r].l += p;
                    }
            }

            // ---- accumulate P·V: O (16 kMt x kDvp per warp) += P (16 kMt x kBlockN) V; each
            //      V fragment feeds kMt query tiles
#pragma unroll
            for (int kk = 0; kk < kKv; ++kk) {
                typename Op::AFrag pf[kMt];
#pragma unroll
                for (int mt = 0; mt < kMt; ++mt) Op::p_to_a(pf[mt], sc[mt], kk);
#pragma unroll
                for (int nv = 0; nv < kNv; nv += 2) {
                    typename Op::BFrag vf[2];
                    Op::template load_pv_b2<LV>(vf[0], vf[1], sVn, kk, nv * 8);
#pragma unroll
                    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
                        for (int u = 0; u < 2; ++u) {
                            const int n = nv + u;
                            SoftmaxState<Acc, 2 * kNv>& top = state[2 * mt];
                            SoftmaxState<Acc, 2 * kNv>& bottom = state[2 * mt + 1];
                            Acc o[4] = {top.o[2 * n], top.o[2 * n + 1],
                                        bottom.o[2 * n], bottom.o[2 * n + 1]};
                            Op::mma(o, pf[mt], vf[u]);
                            top.o[2 * n] = o[0];
                            top.o[2 * n + 1] = o[1];
                            bottom.o[2 * n] = o[2];
                            bottom.o[2 * n + 1] = o[3];
                        }
                }
            }
            // every warp is done with this stage before a later iteration refills it
            __syncthreads();
        }
        // barrier-redundant: the groups still in flight here are empty (tile n_tiles - 1 was
        // waited for above); retired anyway so that no copy is ever in flight at exit
        cp_async_wait<0>();
    }

    // ---- keys a row cannot see must not reach it (issue 10, item 6). P·V is an mma, so an
    //      invisible key still multiplies its weight 0 into the row, and 0 · NaN = 0 · inf =
    //      NaN. Weights are finite and so are their products with finite values: only a
    //      non-finite value of V (seen or not) leaves a lane's share of a row's output
    //      non-finite. That share (rare) is recomputed after the rows are written, so that the
    //      key loop pays nothing: the sum over the keys the row sees of exp(s - m) v / l, with
    //      scalar scores from q and k in global memory; m and l are already right (scores do
    //      not involve V). A NaN or inf the row does see comes back. No shuffle: each lane
    //      decides for its own columns.
    auto recompute_output = [&](long long i, Acc m, Acc l_total) {
        const long long* const st = opaque(strides);
        const long long* const of = opaque(offsets) + b * kNumOperands;
        const T* const q_b = q + of[kQ];
        const T* const k_b = k + of[kK];
        const T* const v_b = v + of[kV];
        const long long rs_q = st[2 * kQ], rs_k = st[2 * kK], rs_v = st[2 * kV];
#if CUONLINE_CP_ASYNC
        constexpr long long cs_q = 1, cs_k = 1, cs_v = 1;  // checked on the host
#else
        const long long cs_q = st[2 * kQ + 1], cs_k = st[2 * kK + 1], cs_v = st[2 * kV + 1];
#endif
        long long j_first = j_lo, j_last = j_hi;  // keys [j_first, j_last) of row i
#if CUONLINE_HAS_WINDOW
        if (i + diag - window_left > j_first) j_first = i + diag - window_left;
        if (i + diag + window_right + 1 < j_last) j_last = i + diag + window_right + 1;
#endif
        Acc o[2 * kNv];
#pragma unroll
        for (int c = 0; c < 2 * kNv; ++c) o[c] = Acc(0);
#pragma unroll 1
        for (long long j = j_first; j < j_last; ++j) {
#if CUONLINE_HAS_MASK
            if (mask[of[kMask] + i * st[2 * kMask] + j * st[2 * kMask + 1]] == 0)
                continue;
#endif
            Acc qk = Acc(0);
#pragma unroll 4
            for (int d = 0; d < kD; ++d)
                qk += mma_operand(q_b[i * rs_q + d * cs_q]) * mma_operand(k_b[j * rs_k + d * cs_k]);
            Acc x = score_map.scaled(qk);
#if CUONLINE_HAS_BIAS
            x += score_map.bias(bias[of[kBias] + i * st[2 * kBias] + j * st[2 * kBias + 1]]);
#endif
#if CUONLINE_HAS_ALIBI
            x -= score_map.alibi(i + diag, j);
#endif
            const Acc p = mma_weight(exp2_weight((x - m) * log2e(Acc())));
            // columns 8 nv + 2t + c: a pointer to the lane's first, stepped 8 columns a time
            const T* v_j = v_b + j * rs_v + 2 * t * cs_v;
            const long long step = CUONLINE_CP_ASYNC ? 8 : opaque(8 * cs_v);
#pragma unroll
            for (int nv = 0; nv < kNv; ++nv, v_j += step)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    if (8 * nv + 2 * t + c < kDv)
                        o[2 * nv + c] += p * mma_operand(v_j[c * cs_v]);
        }
        const Acc inv = Acc(1) / l_total;  // as SoftmaxState::finalize
        const long long row = output_row<kBlockM>(b, i, lq);
#pragma unroll
        for (int nv = 0; nv < kNv; ++nv)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = 8 * nv + 2 * t + c;
                if (col < kDv) out[row * kDv + col] = FromAcc<OutT>::cvt(o[2 * nv + c] * inv);
            }
    };

    // ---- finalize: sum the quad's shares of l, normalise, write out (and lse)
    bool slow[kSlots];     // this lane's share of the row is recomputed (above)
    Acc slow_m[kSlots], slow_l[kSlots];
#pragma unroll
    for (int r = 0; r < kSlots; ++r) {
        const long long i = row0 + 8 * r;
        Acc l_total = state[r].l;
        l_total += __shfl_xor_sync(CUONLINE_FULL_MASK, l_total, 1);
        l_total += __shfl_xor_sync(CUONLINE_FULL_MASK, l_total, 2);
        // l_total > 0: the row sees a key and no score is NaN (else the row is 0, or NaN, as is)
        slow[r] = i < lq && l_total > Acc(0) && !all_finite(state[r].o);
        slow_m[r] = state[r].m;
        slow_l[r] = l_total;
        const Acc row_lse = state[r].finalize(l_total);
        if (i >= lq) continue;
        const long long row = output_row<kBlockM>(b, i, lq);
#pragma unroll
        for (int nv = 0; nv < kNv; ++nv)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = 8 * nv + 2 * t + c;
                if (col < kDv) out[row * kDv + col] = FromAcc<OutT>::cvt(state[r].o[2 * nv + c]);
            }
#if CUONLINE_SPLIT || CUONLINE_RETURN_LSE
        if (t == 0) lse[row] = row_lse;
#endif
    }
    // the same lane wrote these elements above: program order makes the recomputed ones last
    // one copy of the slow path for every slot (a runtime loop; the slot's values selected)
#pragma unroll 1
    for (int r = 0; r < kSlots; ++r) {
        bool slow_r = slow[0];
        Acc m_r = slow_m[0], l_r = slow_l[0];
#pragma unroll
        for (int u = 1; u < kSlots; ++u)
            if (u == r) {
                slow_r = slow[u];
                m_r = slow_m[u];
                l_r = slow_l[u];
            }
        if (slow_r) recompute_output(row0 + 8 * r, m_r, l_r);
    }
}
