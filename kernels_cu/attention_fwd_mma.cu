// attention_fwd_mma.cu: exact attention forward on tensor cores, FlashAttention-2 loop shape.
//
// Variant selection: source.py prepends #define lines (see AttentionMmaSpec in
// cuonline/kernels/specs.py), then the files cuonline/kernels/families.py lists: common.cuh,
// tensor_core.cuh (PTX helpers, shared-memory layouts), mma_fragments.cuh (Ops<T>: the
// fragment traits of each element type), mma_tile_load.cuh (global -> shared tile loads),
// attention_score.cuh (the score pipeline: visibility, score transform, option flags) and
// attention_combine.cuh. Required defines:
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
//   CUONLINE_HAS_WINDOW, _HAS_BIAS, _HAS_BIAS_BLOCK, _HAS_MASK, _HAS_KV_LENGTHS, _HAS_ALIBI,
//   _HAS_REL_BIAS, _HAS_REL_QK, _HAS_SOFTCAP, CUONLINE_SOFTCAP_BIAS, CUONLINE_RETURN_LSE,
//   CUONLINE_SPLIT                 feature flags, 0 or 1 (read by attention_score.cuh)
//   CUONLINE_DR                    width of rel_q / rel_k (0 without rel_qk)
//
// Work decomposition (the arguments: CUONLINE_ATTENTION_PARAMS in attention_score.cuh)
//   grid.x = nbatch * n_query_tiles, grid.z = key splits; block = kWarps warps.
//   Every product is a sequence of 16x8 output tiles: a warp multiplies its 16 query rows by 8
//   keys (scores) or 8 output columns (P·V). The accumulator of a 16x8 tile is 4 values per
//   lane in the m16n8 C layout: lane (g = lane / 4, t = lane % 4) holds rows g and g + 8,
//   columns 2t and 2t + 1. f64 issues two m8n8k4 per tile (rows 0-7 and 8-15): the m8n8 C
//   fragment is the upper half of the m16n8 one, so all four element types share this body and
//   only the Ops traits (mma_fragments.cuh) differ.
//   Online softmax in that layout: each lane keeps the state of its two rows (m, its share of
//   l, its columns of o); row maxima and sums reduce over the 4 lanes of a quad (shfl_xor 1, 2).
//   P = exp(S - m) becomes the A operand of P·V in registers (no shared-memory round trip).
// Shared memory (dynamic, element type T, conflict-free layouts from tensor_core.cuh):
//   sQ: (kBlockM, kDp)                      loaded once
//   sK: (kStages, kBlockN, kDp)             ring of K tiles
//   sV: (kStages, kBlockN, kDvp)            ring of V tiles
//   with rel_qk (kHasRelQk), in the accumulation type:
//   sRq: (kBlockM, kLdRel)                  the query tile's rel_q rows, loaded with Q
//   sRk: (kBlockM + kBlockN - 1, kLdRel)    the band of rel_k of the current key tile, loaded
//                                           (plain loads) after the previous tile's last
//                                           barrier and before this tile's first; the dot per
//                                           score element is a scalar loop over Dr
// Operands are addressed as in attention_fwd_simt.cu: base + offsets[b * 8 + op] + row *
// strides[2 op] + col * strides[2 op + 1] (elements, 64-bit); out and lse are contiguous.

#ifndef CUONLINE_STAGES
#error "attention_fwd_mma.cu needs the CUONLINE_* variant defines (see cuonline/kernels/specs.py)"
#endif

namespace cuonline {
namespace mma {

using namespace cuonline::tc;
using namespace cuonline::operand;

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;

typedef Ops<T> Op;  // mma_fragments.cuh

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
constexpr bool kCpAsync = CUONLINE_CP_ASYNC != 0;  // else element-wise loads (any strides)
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
typedef TileLoader<kThreads, kCpAsync> Tiles;  // mma_tile_load.cuh

// T, or with a split the partial, normalised out per split (workspace), merged by the combine
typedef AttentionOut<T, Acc> OutT;

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
// keeps the compiler from hoisting one 64-bit offset per output column out of it (spills).
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

// "at least 1 block per SM": ptxas's default target spilled (docs/kernels.md, "Launch bounds").
extern "C" __global__ void __launch_bounds__(cuonline::mma::kThreads, 1)
cuonline_attention_mma(CUONLINE_ATTENTION_PARAMS(cuonline::mma::OutT))
{
    using namespace cuonline;
    using namespace cuonline::mma;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_T, cuonline_mma_smem);
    T* sQ = cuonline_mma_smem;                 // (kBlockM, kDp)
    T* sK = sQ + kQElems;                      // (kStages, kBlockN, kDp)
    T* sV = sK + kStages * kKElems;            // (kStages, kBlockN, kDvp)
    // (kBlockM, kLdRel) then (kBlockM + kBlockN - 1, kLdRel), with rel_qk only; the tiles
    // before it are whole 16-byte rows, so the Acc region is aligned
    Acc* sRq = reinterpret_cast<Acc*>(sV + kStages * kVElems);
    Acc* sRk = sRq + kBlockM * kLdRel;

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    // ---- which queries, and which keys may be visible to them (attention_score.cuh)
    const BlockRange range = forward_block_range<kBlockM>(
        lq, lk, diagonal_offset, kv_lengths, window_left, window_right, split_keys,
        varlen_tiles, varlen_seqs, varlen_n_tiles);
    const long long i0 = range.i0;
    const long long key_end = range.key_end, j_lo = range.j_lo, j_hi = range.j_hi;
    // the block's queries: lq, or those of its sequence in a packed batch (local indices)
    const int len_q = range.lq;

    const long long* off = offsets + range.ob * kCount;
    const T* q_b = q + off[kQ];
    const T* k_b = k + off[kK];
    const T* v_b = v + off[kV];

    // visibility and the score transform (scores in natural units)
    const ScorePipeline<Acc> pipe(range, len_q, window_left, window_right, scale, softcap, alibi,
                                  bias, mask, off, strides, bias_block_rows, bias_block_cols,
                                  rel_bias, rel_bias_radius, rel_q, rel_k, rel_k_radius);

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
        Tiles::load<LQK, kBlockM, kD, kDp>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0, len_q);
        cp_async_commit();
        // visible after the first barrier below, like Q
        if constexpr (kHasRelQk) pipe.stage_rel_q<kThreads>(sRq, i0, kBlockM);
#pragma unroll
        for (int s = 0; s + 1 < kStages; ++s) {
            if (s < n_tiles) {
                const long long j0 = (tile_first + s) * kBlockN;
                Tiles::load<LQK, kBlockN, kD, kDp>(sK + s * kKElems, k_b, rs_k, cs_k, j0, key_end);
                Tiles::load<LV, kBlockN, kDv, kDvp>(sV + s * kVElems, v_b, rs_v, cs_v, j0, key_end);
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
                Tiles::load<LQK, kBlockN, kD, kDp>(sK + s * kKElems, k_b, rs_k, cs_k, jn, key_end);
                Tiles::load<LV, kBlockN, kDv, kDvp>(sV + s * kVElems, v_b, rs_v, cs_v, jn, key_end);
            } else if (kStages == 1) {
                Tiles::load<LQK, kBlockN, kD, kDp>(sK, k_b, rs_k, cs_k, j0, key_end);
                Tiles::load<LV, kBlockN, kDv, kDvp>(sV, v_b, rs_v, cs_v, j0, key_end);
            }
            cp_async_commit();
            // this tile's rel_k band: the previous tile's readers are past its last barrier
            int band_lo = 0;
            if constexpr (kHasRelQk) {
                int count;
                pipe.rel_k_band(i0, kBlockM, j0, kBlockN, band_lo, count);
                pipe.stage_rel_k<kThreads>(sRk, band_lo, count);
            }
            cp_async_wait<kStages - 1>();  // tile n (and Q) landed for this thread...
            if constexpr (Op::kRoundTiles) {
                Tiles::round<LQK, kBlockN, kDp>(sK + int(n % kStages) * kKElems);
                Tiles::round<LV, kBlockN, kDvp>(sV + int(n % kStages) * kVElems);
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

            // ---- score pipeline: logits in natural units, -inf for invisible keys;
            //      sc[mt][nt][2h + c] is slot 2 mt + h (row row0 + 16 mt + 8h), key
            //      j0 + 8 nt + 2t + c.
            // An interior tile (every row and key of it in range) needs no per-element range
            // test: the block-uniform branch saves the 64-bit compares on most tiles.
            const bool interior = pipe.covers(i0, i0 + kBlockM, j0, j0 + kBlockN);
            // Mask and bias rows of this tile at the lane's first key (j0 + 2t): an element is
            // then one multiple of the column stride away.
            typename ScorePipeline<Acc>::Row at[kSlots];
#pragma unroll
            for (int r = 0; r < kSlots; ++r) at[r] = pipe.row(row0 + 8 * r, j0 + 2 * t);
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
                        Acc rel = Acc(0);  // rel_q[i] · rel_k[delta], from the staged copies
                        if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i, j);
                        sc[mt][nt][e] = pipe.score(sc[mt][nt][e], i, j,
                                                   interior || pipe.in_range(i, j), at[r],
                                                   8 * nt + (e & 1), rel);
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

    // this lane's columns 8 nv + 2t + c (c = 0, 1) of output row `row`, from its fragment
    // values `vals` (2 kNv of them, already normalised)
    auto write_lane_row = [&](long long row, const Acc* vals) {
#pragma unroll
        for (int nv = 0; nv < kNv; ++nv)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = 8 * nv + 2 * t + c;
                if (col < kDv) out[row * kDv + col] = FromAcc<OutT>::cvt(vals[2 * nv + c]);
            }
    };

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
        const long long* const of = opaque(offsets) + range.ob * kCount;
        // mask and bias read through the same opaque tables
        const ScorePipeline<Acc> row_pipe = pipe.rebased(of, st);
        const T* const q_b = q + of[kQ];
        const T* const k_b = k + of[kK];
        const T* const v_b = v + of[kV];
        const Acc* const rel_q_t = opaque(rel_q);
        const Acc* const rel_k_t = opaque(rel_k);
        const long long rs_q = st[2 * kQ], rs_k = st[2 * kK], rs_v = st[2 * kV];
        // cp.async: unit column strides (checked on the host)
        const long long cs_q = kCpAsync ? 1 : st[2 * kQ + 1];
        const long long cs_k = kCpAsync ? 1 : st[2 * kK + 1];
        const long long cs_v = kCpAsync ? 1 : st[2 * kV + 1];
        long long j_first, j_last;  // keys [j_first, j_last) of row i
        row_pipe.row_keys(i, j_first, j_last);
        Acc o[2 * kNv];
#pragma unroll
        for (int c = 0; c < 2 * kNv; ++c) o[c] = Acc(0);
#pragma unroll 1
        for (long long j = j_first; j < j_last; ++j) {
            if (!row_pipe.keeps(i, j)) continue;
            Acc qk = Acc(0);
#pragma unroll 4
            for (int d = 0; d < kD; ++d)
                qk += mma_operand(q_b[i * rs_q + d * cs_q]) * mma_operand(k_b[j * rs_k + d * cs_k]);
            const Acc rel = kHasRelQk ? row_pipe.rel_qk_global(i, j, rel_q_t, rel_k_t) : Acc(0);
            const Acc x = row_pipe.logit(qk, i, j, rel);
            const Acc p = mma_weight(exp2_weight((x - m) * log2e(Acc())));
            // columns 8 nv + 2t + c: a pointer to the lane's first, stepped 8 columns a time
            const T* v_j = v_b + j * rs_v + 2 * t * cs_v;
            const long long step = kCpAsync ? 8 : opaque(8 * cs_v);
#pragma unroll
            for (int nv = 0; nv < kNv; ++nv, v_j += step)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    if (8 * nv + 2 * t + c < kDv)
                        o[2 * nv + c] += p * mma_operand(v_j[c * cs_v]);
        }
        const Acc inv = Acc(1) / l_total;  // as SoftmaxState::finalize
#pragma unroll
        for (int c = 0; c < 2 * kNv; ++c) o[c] *= inv;
        write_lane_row(output_row<kBlockM>(range, i, lq), o);
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
        slow[r] = i < len_q && l_total > Acc(0) && !all_finite(state[r].o);
        slow_m[r] = state[r].m;
        slow_l[r] = l_total;
        const Acc row_lse = state[r].finalize(l_total);
        if (i >= len_q) continue;
        const long long row = output_row<kBlockM>(range, i, lq);
        write_lane_row(row, state[r].o);
        if constexpr (kWritesLse) {
            if (t == 0) lse[row] = row_lse;
        }
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
