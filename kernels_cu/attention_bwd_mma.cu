// attention_bwd_mma.cu: exact attention backward on tensor cores, FlashAttention-2's
// decomposition, deterministic: no atomics, every output element written by one lane.
//
// Variant selection: source.py prepends #define lines (cuonline/kernels/specs.py,
// AttentionBwdMmaSpec), then the files cuonline/kernels/families.py lists: common.cuh,
// tensor_core.cuh, mma_fragments.cuh (Ops<T>: the forward's fragment traits), mma_tile_load.cuh
// (TileLoader), attention_score.cuh (the forward's score pipeline) and attention_grads.cuh (the
// backward families' parameters, P and the gradients at one place, one text with the SIMT
// family). Required defines, beside the feature flags of attention_score.cuh:
//   CUONLINE_T, CUONLINE_ACC       element / accumulation type, as attention_fwd_mma.cu
//                                  (__half or __nv_bfloat16 with float; float (tf32) with
//                                  float; double with double)
//   CUONLINE_D, CUONLINE_DV        head dims of q/k and of v (1..128), zero-padded in shared
//                                  memory to multiples of 16 (every mma k, and n-tile pairs)
//   CUONLINE_WARPS                 warps per block; warp w owns 16 rows (keys in the dK/dV
//                                  kernel, queries in the dQ kernel): kBlockR = 16 kWarps
//   CUONLINE_BLOCK_C               rows of the streamed tiles (queries for dK/dV, keys for
//                                  dQ), a multiple of 16
//   CUONLINE_CP_ASYNC              1: q, k, v, dout rows are 16-byte aligned with unit column
//                                  stride and go global -> shared by cp.async; 0: element-wise
//   CUONLINE_WRITE_DS, CUONLINE_DR as attention_bwd_simt.cu (dS written; dS, dC reduced)
//
// The math, as attention_bwd_simt.cu (Delta from the host, P recomputed from lse):
//   P = exp(s - lse)  dV = P^T dO  dP = dO V^T  dS = P * (dP - Delta)  (soft caps: chain rule)
//   dQ = scale g K    dK = scale g^T Q          dbias = g (ds)         dC (with rel_qk)
// Every product is an mma on the forward's fragments (Ops<T>); the operands that are results
// (P, g) stay in registers: the C layout of two 16x8 accumulator tiles is the A layout of one
// k-step (Ops::p_to_a, rounded to the input type as the forward rounds P), so
//   dK/dV kernel (warp: 16 keys x the tile's queries, transposed scores):
//     S^T  = K Q^T     A = K  (sK, load_a)      B = Q^T (sQ rows, load_bt2)
//     dP^T = V dO^T    A = V  (sV, load_a)      B = dO^T (sdO rows, load_bt2)
//     dV  += P^T dO    A = P^T (p_to_a)         B = dO (sdO as (k, n), load_pv_b2)
//     dK  += g^T Q     A = g^T (p_to_a)         B = Q  (sQ as (k, n), load_pv_b2)
//   dQ kernel (warp: 16 queries x the tile's keys):
//     S = Q K^T, dP = dO V^T as the forward's scores; dQ += g K with B = K (load_pv_b2).
// Lane (g = lane / 4, t = lane % 4) of a 16x8 accumulator tile holds rows g, g + 8 and
// columns 2t, 2t + 1 (tensor_core.cuh).
//
// NaN and inf: invisible places have P = 0 and g = 0 by a select, but an mma multiplies
// them into every column: 0 * NaN = NaN. A non-finite q, k, v or dout would reach rows that
// do not see it, so the host dispatches such calls to attention_bwd_simt (which skips zero
// weights) and this family sees finite inputs only. Rows that see no key (lse = -inf) have
// P = 0 everywhere and get zero gradients; keys past kv_lengths (or Lk) are never read (the
// loader zero-fills them).
//
// Work decomposition (launches of one module, as attention_bwd_simt.cu)
//   cuonline_attention_bwd_mma_dkdv: grid.x = nbatch * n_key_tiles; dK and dV of the block's
//     kBlockR keys stay in registers through the loop over the query tiles that may see them.
//   cuonline_attention_bwd_mma_dq: grid.x = nbatch * n_query_tiles (the heaviest causal tiles
//     first, block_range); dQ stays in registers; with kWriteDs each place of the loop's tiles
//     adds g into ds (as attention_bwd_simt.cu); with a block bias, rel_bias or rel_qk the tile's g (and its content
//     gradient dC) go to shared memory and are reduced there, as attention_bwd_simt.cu; each
//     query row's sum of P goes to row_sums, for the host's check of lse.
// Shared memory (dynamic; element type T in tensor_core.cuh's SmemTile layouts, then Acc):
//   dK/dV: sK (kBlockR, kDp), sV (kBlockR, kDvp)  the owned keys, loaded once
//          sQ (kBlockC, kDp), sdO (kBlockC, kDvp) a query tile
//          sLse, sDelta (kBlockC)                 its statistics (Acc)
//   dQ:    sQ (kBlockR, kDp), sdO (kBlockR, kDvp) the owned queries, loaded once
//          sK (kBlockC, kDp), sV (kBlockC, kDvp)  a key tile
//   with rel_qk, as attention_bwd_simt.cu: sRq (the tile's or the block's rel_q rows) and sRk
//   (the band of rel_k the tile's distances reach), Acc, behind the same barriers; the dQ
//   kernel's sGb (dS: block bias, rel_bias) and sGc (dC: rel_qk), (kBlockR, kBlockC + 1) Acc.
// Operands are addressed through the offset table of attention_bwd_simt.cu: the forward's
// operands, then dout (op = kCount); dq, dk, dv, ds and the partials contiguous in the
// accumulation type.

#ifndef CUONLINE_BLOCK_C
#error "attention_bwd_mma.cu needs the CUONLINE_* variant defines (see cuonline/kernels/specs.py)"
#endif

namespace cuonline {
namespace bwd_mma {

using namespace cuonline::tc;
using namespace cuonline::mma;
using namespace cuonline::operand;

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;
typedef Ops<T> Op;  // mma_fragments.cuh

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

constexpr int kD = CUONLINE_D;
constexpr int kDv = CUONLINE_DV;
constexpr int kWarps = CUONLINE_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockR = 16 * kWarps;          // owned rows per block
constexpr int kBlockC = CUONLINE_BLOCK_C;     // streamed rows per tile
constexpr bool kCpAsync = CUONLINE_CP_ASYNC != 0;
constexpr bool kWriteDs = CUONLINE_WRITE_DS != 0;
constexpr int kLdG = kBlockC + 1;             // row stride of the tiles sGb, sGc
// the dQ kernel reduces dS in shared memory (rel_bias, block bias; a plain bias writes it)
constexpr bool kBiasTile = kHasRelBias || kHasBiasBlock;
static_assert(!(kWriteDs && kHasBiasBlock), "a block bias's dS is reduced, never written");
constexpr int kDp = round_up(kD, 16);         // a multiple of every mma k and of 2 n-tiles
constexpr int kDvp = round_up(kDv, 16);
constexpr int kNc = kBlockC / 8;              // n-tiles of a score tile (streamed rows)
constexpr int kNd = kDp / 8;                  // n-tiles of dK, dQ
constexpr int kNdv = kDvp / 8;                // n-tiles of dV
constexpr int kKd = kDp / Op::kK;             // k-steps over D
constexpr int kKdv = kDvp / Op::kK;           // k-steps over Dv
constexpr int kKc = kBlockC / Op::kK;         // k-steps over the streamed rows
constexpr int kDout = operand::kCount;        // dout's column of the offset table
constexpr int kOperands = operand::kCount + 1;
static_assert(kBlockC % 16 == 0, "streamed tiles are pairs of 8-row n-tiles");
static_assert(!kSplit, "attention_bwd_mma does not split keys");

typedef SmemTile<kDp, int(sizeof(T))> LD;     // sQ, sK
typedef SmemTile<kDvp, int(sizeof(T))> LDv;   // sV, sdO
constexpr int kOwnElems = kBlockR * (LD::kStride + LDv::kStride);
constexpr int kTileElems = kBlockC * (LD::kStride + LDv::kStride);
typedef TileLoader<kThreads, kCpAsync> Tiles;

// acc (16 x 8 kN per warp) += A B over kK k-steps, A from the rows [r0, r0 + 16) of sA (an
// (m, k) tile of layout LA), B^T from the rows of sB (an (n, k) tile of layout LB): the
// forward's score product, for S, S^T, dP and dP^T.
template <class LA, class LB, int kN, int kSteps>
__device__ __forceinline__ void mma_abt(Acc (&acc)[kN][4], const T* sA, int r0, const T* sB) {
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
        typename Op::AFrag a;
        Op::template load_a<LA>(a, sA, r0, ks * Op::kK);
#pragma unroll
        for (int n = 0; n < kN; n += 2) {
            typename Op::BFrag b0, b1;
            Op::template load_bt2<LB>(b0, b1, sB, n * 8, ks * Op::kK);
            Op::mma(acc[n], a, b0);
            Op::mma(acc[n + 1], a, b1);
        }
    }
}

// acc (16 x 8 kN per warp) += W B, W the warp's weights in C layout (kNc n-tiles: P, g, or
// their transposes) as A fragments, B the (k, n) = (streamed rows, columns) tile sB of layout
// LB: the forward's P·V product, for dV, dK and dQ.
template <class LB, int kN>
__device__ __forceinline__ void mma_wb(Acc (&acc)[kN][4], const Acc (&w)[kNc][4], const T* sB) {
#pragma unroll
    for (int kk = 0; kk < kKc; ++kk) {
        typename Op::AFrag a;
        Op::p_to_a(a, w, kk);
#pragma unroll
        for (int n = 0; n < kN; n += 2) {
            typename Op::BFrag b0, b1;
            Op::template load_pv_b2<LB>(b0, b1, sB, kk, n * 8);
            Op::mma(acc[n], a, b0);
            Op::mma(acc[n + 1], a, b1);
        }
    }
}

template <int kN>
__device__ __forceinline__ void zero(Acc (&acc)[kN][4]) {
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = Acc(0);
}

// Write this lane's share of a warp's 16 x 8 kN accumulator to rows row0 + g (+ 8) of a
// contiguous (rows, kCols) array: columns 8 n + 2t + c below kCols, rows below `rows`.
template <int kCols, int kN>
__device__ __forceinline__ void write_tile(Acc* out, const Acc (&acc)[kN][4], long long base_row,
                                           long long row0, long long rows) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long r = row0 + g + 8 * h;
        if (r >= rows) continue;
        Acc* dst = out + (base_row + r) * kCols;
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = 8 * n + 2 * t + c;
                if (col < kCols) dst[col] = acc[n][2 * h + c];
            }
    }
}

}  // namespace bwd_mma
}  // namespace cuonline

// dK and dV of one tile of keys. One block per SM at least, as the forward (ptxas's default
// target would cap the registers of the accumulators).
extern "C" __global__ void __launch_bounds__(cuonline::bwd_mma::kThreads, 1)
cuonline_attention_bwd_mma_dkdv(CUONLINE_ATTENTION_BWD_PARAMS)
{
    using namespace cuonline;
    using namespace cuonline::bwd_mma;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_T, cuonline_bwd_mma_dkdv_smem);
    T* sK = cuonline_bwd_mma_dkdv_smem;           // (kBlockR, kDp): the block's keys
    T* sV = sK + kBlockR * LD::kStride;           // (kBlockR, kDvp)
    T* sQ = sK + kOwnElems;                       // (kBlockC, kDp): a query tile
    T* sdO = sQ + kBlockC * LD::kStride;          // (kBlockC, kDvp)
    // whole 16-byte rows before: the Acc region is aligned
    Acc* sLse = reinterpret_cast<Acc*>(sK + kOwnElems + kTileElems);  // (kBlockC)
    Acc* sDelta = sLse + kBlockC;                 // (kBlockC)
    Acc* sRq = sDelta + kBlockC;                  // (kBlockC, kLdRel), with rel_qk only
    Acc* sRk = sRq + kBlockC * kLdRel;            // (kBlockC + kBlockR - 1, kLdRel)

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    // ---- which keys, and the queries that may see them (as attention_bwd_simt.cu)
    const KeyBlock kb = key_block<kBlockR>(lq, lk, diagonal_offset, varlen_key_tiles,
                                           varlen_seqs, varlen_n_key_tiles);
    BlockRange range;
    range.b = kb.b;
    const long long b = range.b;
    const long long j0 = kb.j0;
    const int len_q = kb.lq, len_k = kb.lk;
    range.diag = kb.diag;
    range.key_end = len_k;
    if constexpr (kHasKvLengths) range.key_end = kv_lengths[b];  // clipped to [0, lk]
    range.j_lo = 0;
    range.j_hi = range.key_end;
    long long i_lo = 0, i_hi = len_q;  // query i sees key j only if i + diag - left <= j <= ...
    if constexpr (kHasWindow) {
        if (j0 - range.diag - window_right > i_lo) i_lo = j0 - range.diag - window_right;
        if (j0 + kBlockR - range.diag + window_left < i_hi)
            i_hi = j0 + kBlockR - range.diag + window_left;
    }
    range.i0 = i_lo;
    range.i_end = i_hi;

    const long long* off = offsets + kb.ob * kOperands;
    const T* q_b = q + off[kQ];
    const T* k_b = k + off[kK];
    const T* v_b = v + off[kV];
    const T* do_b = dout + off[kDout];
    const ScorePipeline<Acc> pipe(range, len_q, window_left, window_right, scale, softcap,
                                  alibi, bias, mask, off, strides, bias_block_rows,
                                  bias_block_cols, rel_bias, rel_bias_radius, rel_q, rel_k,
                                  rel_k_radius);

    const int warp_row = 16 * warp;   // the warp's first key in the block
    Acc dk_acc[kNd][4], dv_acc[kNdv][4];
    zero(dk_acc);
    zero(dv_acc);

    if (j0 < range.key_end && i_lo < i_hi) {
        // ---- the block's keys and values, in the first query tile's copy group
        Tiles::load<LD, kBlockR, kD, kDp>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0,
                                          range.key_end);
        Tiles::load<LDv, kBlockR, kDv, kDvp>(sV, v_b, strides[2 * kV], strides[2 * kV + 1], j0,
                                             range.key_end);

        const long long i_first = (i_lo / kBlockC) * kBlockC;
        for (long long i0 = i_first; i0 < i_hi; i0 += kBlockC) {
            // ---- stage a query tile: q, dO, lse, Delta (the barrier also keeps the previous
            //      tile alive until every warp has accumulated from it)
            __syncthreads();
            Tiles::load<LD, kBlockC, kD, kDp>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0,
                                              len_q);
            Tiles::load<LDv, kBlockC, kDv, kDvp>(sdO, do_b, strides[2 * kDout],
                                                 strides[2 * kDout + 1], i0, len_q);
            cp_async_commit();
            for (int idx = threadIdx.x; idx < kBlockC; idx += kThreads) {
                const long long i = i0 + idx;
                sLse[idx] = i < len_q ? lse[b * lq + kb.q_start + i] : neg_inf(Acc());
                sDelta[idx] = i < len_q ? delta[b * lq + kb.q_start + i] : Acc(0);
            }
            int band_lo = 0;  // rel_k rows [band_lo, band_lo + count) of this tile
            if constexpr (kHasRelQk) {
                int count;
                pipe.stage_rel_q<kThreads>(sRq, i0, kBlockC);
                pipe.rel_k_band(i0, kBlockC, j0, kBlockR, band_lo, count);
                pipe.stage_rel_k<kThreads>(sRk, band_lo, count);
            }
            cp_async_wait<0>();  // this thread's copies landed (the keys too, at the first)...
            if constexpr (Op::kRoundTiles) {
                if (i0 == i_first) {
                    Tiles::round<LD, kBlockR, kDp>(sK);
                    Tiles::round<LDv, kBlockR, kDvp>(sV);
                }
                Tiles::round<LD, kBlockC, kDp>(sQ);
                Tiles::round<LDv, kBlockC, kDvp>(sdO);
            }
            __syncthreads();     // ...and every thread's

            // ---- S^T = K Q^T and dP^T = V dO^T (16 keys x kBlockC queries per warp)
            Acc s[kNc][4], dp[kNc][4];
            zero(s);
            zero(dp);
            mma_abt<LD, LD, kNc, kKd>(s, sK, warp_row, sQ);
            mma_abt<LDv, LDv, kNc, kKdv>(dp, sV, warp_row, sdO);

            // ---- P (into s) and the gradients of the raw scores (into dp); s[n][2h + c] is
            //      key j0 + warp_row + g + 8h, query i0 + 8n + 2t + c
#pragma unroll
            for (int n = 0; n < kNc; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const long long j = j0 + warp_row + g + 8 * (e >> 1);
                    const int ii = 8 * n + 2 * t + (e & 1);
                    const long long i = i0 + ii;
                    Acc rel = Acc(0);  // rel_q[i] · rel_k[delta], from the staged copies
                    if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i, j);
                    const Acc x = pipe.score(s[n][e], i, j, rel);
                    const Acc p = backward_weight(x, sLse[ii]);
                    Acc g_bias, g_content;
                    dp[n][e] = logit_grads(p, dp[n][e], sDelta[ii], x, s[n][e], rel, scale,
                                           softcap, g_bias, g_content);
                    s[n][e] = p;
                }

            // ---- dV += P^T dO, dK += g^T Q (P and g rounded to the input type as A)
            mma_wb<LDv, kNdv>(dv_acc, s, sdO);
            mma_wb<LD, kNd>(dk_acc, dp, sQ);
        }
    }

    // ---- write dK and dV of the block's keys (zero for keys nothing sees)
    write_tile<kD>(dk, dk_acc, b * lk + kb.k_start, j0 + warp_row, len_k);
    write_tile<kDv>(dv, dv_acc, b * lk + kb.k_start, j0 + warp_row, len_k);
}

// dQ of one tile of queries, and the gradients of its logits (kWriteDs: dS; the reduced ones).
extern "C" __global__ void __launch_bounds__(cuonline::bwd_mma::kThreads, 1)
cuonline_attention_bwd_mma_dq(CUONLINE_ATTENTION_BWD_PARAMS)
{
    using namespace cuonline;
    using namespace cuonline::bwd_mma;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_T, cuonline_bwd_mma_dq_smem);
    T* sQ = cuonline_bwd_mma_dq_smem;             // (kBlockR, kDp): the block's queries
    T* sdO = sQ + kBlockR * LD::kStride;          // (kBlockR, kDvp)
    T* sK = sQ + kOwnElems;                       // (kBlockC, kDp): a key tile
    T* sV = sK + kBlockC * LD::kStride;           // (kBlockC, kDvp)
    Acc* sRq = reinterpret_cast<Acc*>(sQ + kOwnElems + kTileElems);  // (kBlockR, kLdRel)
    Acc* sRk = sRq + kBlockR * kLdRel;            // (kBlockR + kBlockC - 1, kLdRel)
    // the tile's dS (block bias, rel_bias) and dC (rel_qk) for the in-kernel reductions
    Acc* sGb = sRq + (kHasRelQk ? (2 * kBlockR + kBlockC - 1) * kLdRel : 0);
    Acc* sGc = sGb + (kBiasTile ? kBlockR * kLdG : 0);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;

    // ---- which queries, and which keys may be visible to them (attention_score.cuh)
    //      (packed: of the block's sequence, local indices; q_row0: the row of its query 0
    //      in the (nbatch, lq) buffers)
    const BlockRange range = forward_block_range<kBlockR>(
        lq, lk, diagonal_offset, kv_lengths, window_left, window_right, lk, varlen_tiles,
        varlen_seqs, varlen_n_tiles);
    const long long b = range.b, i0 = range.i0;
    const long long key_end = range.key_end, j_lo = range.j_lo, j_hi = range.j_hi;
    const int len_q = range.lq, len_k = range.lk;
    const long long q_row0 = b * lq + range.q_start;

    const long long* off = offsets + range.ob * kOperands;
    const T* q_b = q + off[kQ];
    const T* k_b = k + off[kK];
    const T* v_b = v + off[kV];
    const T* do_b = dout + off[kDout];
    const ScorePipeline<Acc> pipe(range, len_q, window_left, window_right, scale, softcap,
                                  alibi, bias, mask, off, strides, bias_block_rows,
                                  bias_block_cols, rel_bias, rel_bias_radius, rel_q, rel_k,
                                  rel_k_radius);

    const int warp_row = 16 * warp;   // the warp's first query in the block
    Acc dq_acc[kNd][4];
    zero(dq_acc);
    Acc row_lse[2], row_delta[2];     // rows g and g + 8 of the warp's queries
    Acc row_sum[2] = {Acc(0), Acc(0)};   // this lane's share of their sums of P
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long i = i0 + warp_row + g + 8 * h;
        row_lse[h] = i < len_q ? lse[q_row0 + i] : neg_inf(Acc());
        row_delta[h] = i < len_q ? delta[q_row0 + i] : Acc(0);
    }

    if (j_lo < j_hi) {
        // ---- the block's queries and output gradients, in the first key tile's copy group
        Tiles::load<LD, kBlockR, kD, kDp>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0,
                                          len_q);
        Tiles::load<LDv, kBlockR, kDv, kDvp>(sdO, do_b, strides[2 * kDout],
                                             strides[2 * kDout + 1], i0, len_q);
        if constexpr (kHasRelQk) pipe.stage_rel_q<kThreads>(sRq, i0, kBlockR);

        const long long j_first = (j_lo / kBlockC) * kBlockC;
        for (long long j0 = j_first; j0 < j_hi; j0 += kBlockC) {
            // ---- stage a key tile (the barrier also keeps the previous one alive until read)
            __syncthreads();
            Tiles::load<LD, kBlockC, kD, kDp>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0,
                                              key_end);
            Tiles::load<LDv, kBlockC, kDv, kDvp>(sV, v_b, strides[2 * kV], strides[2 * kV + 1],
                                                 j0, key_end);
            cp_async_commit();
            int band_lo = 0;  // rel_k rows [band_lo, band_lo + count) of this tile
            if constexpr (kHasRelQk) {
                int count;
                pipe.rel_k_band(i0, kBlockR, j0, kBlockC, band_lo, count);
                pipe.stage_rel_k<kThreads>(sRk, band_lo, count);
            }
            cp_async_wait<0>();  // this thread's copies landed (the queries too, at the first)...
            if constexpr (Op::kRoundTiles) {
                if (j0 == j_first) {
                    Tiles::round<LD, kBlockR, kDp>(sQ);
                    Tiles::round<LDv, kBlockR, kDvp>(sdO);
                }
                Tiles::round<LD, kBlockC, kDp>(sK);
                Tiles::round<LDv, kBlockC, kDvp>(sV);
            }
            __syncthreads();     // ...and every thread's

            // ---- S = Q K^T and dP = dO V^T (16 queries x kBlockC keys per warp)
            Acc s[kNc][4], dp[kNc][4];
            zero(s);
            zero(dp);
            mma_abt<LD, LD, kNc, kKd>(s, sQ, warp_row, sK);
            mma_abt<LDv, LDv, kNc, kKdv>(dp, sdO, warp_row, sV);

            // ---- gradients of the raw scores (into dp); dS (and dC) of every place;
            //      s[n][2h + c] is query i0 + warp_row + g + 8h, key j0 + 8n + 2t + c
#pragma unroll
            for (int n = 0; n < kNc; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e >> 1;
                    const long long i = i0 + warp_row + g + 8 * h;
                    const long long j = j0 + 8 * n + 2 * t + (e & 1);
                    Acc rel = Acc(0);
                    if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i, j);
                    const Acc x = pipe.score(s[n][e], i, j, rel);
                    const Acc p = summed_weight(x, row_lse[h]);
                    row_sum[h] += p;
                    Acc g_bias, g_content;
                    dp[n][e] = logit_grads(p, dp[n][e], row_delta[h], x, s[n][e], rel, scale,
                                           softcap, g_bias, g_content);
                    const bool inside = i < len_q && j < len_k;
                    if constexpr (kWriteDs) {
                        if (inside) ds[(b * lq + i) * lk + j] += g_bias;
                    }
                    const int at = (warp_row + g + 8 * h) * kLdG + 8 * n + 2 * t + (e & 1);
                    if constexpr (kBiasTile) sGb[at] = inside ? g_bias : Acc(0);
                    if constexpr (kHasRelQk) sGc[at] = inside ? g_content : Acc(0);
                }

            // ---- dQ += g K (g rounded to the input type as A)
            mma_wb<LD, kNd>(dq_acc, dp, sK);

            // ---- the tile's reduced gradients into the block's partials (attention_grads.cuh)
            if constexpr (kBiasTile || kHasRelQk) {
                __syncthreads();
                tile_partials<kBlockR, kBlockC, kLdG, kThreads>(
                    sGb, sGc, sRq, sRk, pipe, b, i0, j0, len_q, len_k, range.diag,
                    bias_block_rows, bias_block_cols, rel_bias_radius, rel_k_radius, ds,
                    drel_bias, drel_q, drel_k, q_row0, range.slot);
            }
        }
    }

    // ---- write dQ of the block's queries (zero for a query that sees no key), and each row's
    //      sum of P over the 4 lanes of its quad (shfl_xor 1, 2: every lane gets the same sum)
    write_tile<kD>(dq, dq_acc, q_row0, i0 + warp_row, len_q);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        Acc sum = row_sum[h];
        sum += __shfl_xor_sync(CUONLINE_FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(CUONLINE_FULL_MASK, sum, 2);
        const long long i = i0 + warp_row + g + 8 * h;
        if (t == 0 && i < len_q) row_sums[q_row0 + i] = sum;
    }
}

// rel_k's gradient at the exact distances, one warp per table row (attention_grads.cuh).
extern "C" __global__ void __launch_bounds__(32 * cuonline::kRelkWarps, 1)
cuonline_attention_bwd_mma_rel_k(CUONLINE_ATTENTION_BWD_PARAMS)
{
    CUONLINE_ATTENTION_BWD_REL_K_BODY;
}
