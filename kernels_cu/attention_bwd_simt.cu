// attention_bwd_simt.cu: exact attention backward, FlashAttention-2's decomposition, SIMT
// (plain FMA), deterministic: no atomics, every output element written by one thread.
//
// Variant selection: source.py prepends #define lines (cuonline/kernels/specs.py,
// AttentionBwdSimtSpec), then common.cuh, attention_score.cuh (the forward's score pipeline:
// which keys a query sees and how q·k becomes a logit, so every option has one definition) and
// attention_grads.cuh (the backward families' parameters, P and the gradients at one place).
// Required defines, beside the feature flags of attention_score.cuh:
//   CUONLINE_T, CUONLINE_ACC       element and accumulation type (float, or double for double)
//   CUONLINE_D, CUONLINE_DV        head dims of q/k and of v (1..256)
//   CUONLINE_WARPS                 warps per block
//   CUONLINE_ROWS_PER_WARP         rows a warp owns: keys (dK/dV kernel), queries (dQ kernel)
//   CUONLINE_ITEMS_PER_LANE        rows a lane streams per tile: queries (dK/dV), keys (dQ)
//   CUONLINE_WRITE_DS              the dQ kernel writes dS (the gradient of each logit with
//                                  respect to its additive bias term): a plain bias's gradient
//   CUONLINE_DR                    width of rel_q / rel_k (rel_qk): the dQ kernel then also
//                                  reduces dC, the gradient of each content score
//                                  scale q·k + rel_q·rel_k, into the rel_q/rel_k gradients
//
// The math (P recomputed from the forward's lse; Delta_i = rowsum(dO_i * O_i) is computed on
// the host and passed in):
//   P = exp(s - lse)            dV = P^T dO        dP = dO V^T
//   dS = P * (dP - Delta)       g = dS, through the soft cap's derivative where it caps
//   dQ = scale g K              dK = scale g^T Q   dbias = g (ds, or its block sums)
//   dC = g through the content score's cap (rel_q / rel_k from it)
// Places a query cannot see have P = 0 and g = 0 by a select (never a product), and a zero
// weight or gradient is skipped (warp-uniform) in the accumulations, so a NaN or inf behind a
// mask or in another row never reaches a gradient through 0 * NaN. Rows that see no key
// (lse = -inf) get zero gradients; keys past kv_lengths (or Lk) are never read.
//
// Work decomposition (launches of this module, no atomics)
//   cuonline_attention_bwd_dkdv: grid.x = nbatch * n_key_tiles; the block owns kBlockR keys
//     (warp w: keys [w kRows, (w+1) kRows)) and loops over the query tiles of kBlockC queries
//     that may see them (lane t: queries t, t + 32, ...). dK and dV of its keys stay in
//     registers (lane t: columns t, t + 32, ...) and are written once.
//   cuonline_attention_bwd_dq: grid.x = nbatch * n_query_tiles; the block owns kBlockR queries
//     and loops over the key tiles they may see (lane t: keys t, t + 32, ...); dQ stays in
//     registers; with kWriteDs each (i, j) of the loop's tiles adds its g into ds (a bias
//     shared by several batch elements: one launch per sharer, run b of ds its slot); with a
//     block bias, rel_bias or rel_qk the tile's g (and dC) go to shared memory and are reduced
//     there into the block's partials (attention_grads.cuh, tile_partials). Each query row's
//     sum of P goes to row_sums: the host checks lse with it.
//   cuonline_attention_bwd_rel_k (rel_qk): one warp per row of rel_k's gradient between its
//     clamped ends (attention_grads.cuh, rel_k_rows).
//   Per tile, scores and dP are lane-parallel over the streamed rows, then each streamed row's
//   weight is broadcast by shuffle and accumulated into the owned rows' columns, in a fixed
//   order: two runs give bitwise identical results.
// Shared memory (dynamic, in the accumulation type):
//   sA : (kBlockR, kD), sB: (kBlockR, kDv)     the owned rows (K, V or Q, dO), broadcast reads
//   sC : (kBlockC, kLdD), sE: (kBlockC, kLdDv) a streamed tile (Q, dO or K, V), lane t reads
//                                               row t: odd strides keep the lanes on 32 banks
//   sLse, sDelta: (kBlockC)                    the dK/dV kernel's per-query statistics
//   with rel_qk: sRq, the rel_q rows of the tile's queries, and sRk, the band of rel_k
//   their distances reach (attention_score.cuh's staging), behind the same barriers
//   dQ kernel, with a block bias or rel_bias: sGb (kBlockR, kLdG), the tile's dS; with
//   rel_qk: sGc (kBlockR, kLdG), its dC
//
// Operands are addressed as in the forward, through a per-batch table of element offsets
// offsets[b * (kCount + 1) + op] and strides[2 op], strides[2 op + 1]: the forward's operands
// (operand:: in attention_score.cuh, read by the score pipeline), then dout (op = kCount).
// lse and delta are contiguous (nbatch, lq); dq (nbatch, lq, D), dk (nbatch, lk, D), dv
// (nbatch, lk, Dv), ds (nbatch, lq, lk; a block bias: its slots) and the partials
// (attention_grads.cuh's parameter list) are contiguous, in the accumulation type (the host
// sums the partials and broadcast dimensions and converts to the input dtype).

#ifndef CUONLINE_ITEMS_PER_LANE
#error "attention_bwd_simt.cu needs the CUONLINE_* variant defines (see cuonline/kernels/specs.py)"
#endif

namespace cuonline {
namespace bwd {

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;

constexpr int kD = CUONLINE_D;
constexpr int kDv = CUONLINE_DV;
constexpr int kWarps = CUONLINE_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = CUONLINE_ROWS_PER_WARP;
constexpr int kBlockR = kWarps * kRows;       // owned rows per block
constexpr int kPer = CUONLINE_ITEMS_PER_LANE;
constexpr int kBlockC = 32 * kPer;            // streamed rows per tile
constexpr int kColsD = (kD + 31) / 32;        // columns of D per lane
constexpr int kColsDv = (kDv + 31) / 32;      // columns of Dv per lane
constexpr int kLdD = kD + 1;
constexpr int kLdDv = kDv + 1;
constexpr bool kWriteDs = CUONLINE_WRITE_DS != 0;
constexpr int kLdG = kBlockC + 1;             // row stride of the tiles sGb, sGc
// the dQ kernel reduces dS in shared memory (rel_bias, block bias; a plain bias writes it)
constexpr bool kBiasTile = kHasRelBias || kHasBiasBlock;
static_assert(!(kWriteDs && kHasBiasBlock), "a block bias's dS is reduced, never written");
// The backward's operand table: the forward's (read by the score pipeline), then dO.
constexpr int kDout = operand::kCount;
constexpr int kOperands = operand::kCount + 1;
static_assert(!kSplit, "attention_bwd_simt does not split keys");
using namespace cuonline::operand;

// Stage rows [r0, r0 + kRowsN) x columns [0, kWidth) of an operand into s (row stride kLd);
// rows at or past `row_end` are zero (never read from global memory).
template <int kRowsN, int kWidth, int kLd>
__device__ __forceinline__ void stage(Acc* s, const T* base, long long row_stride,
                                      long long col_stride, long long r0, long long row_end) {
    for (int idx = threadIdx.x; idx < kRowsN * kWidth; idx += kThreads) {
        const int r = idx / kWidth;
        const int c = idx - r * kWidth;
        const long long row = r0 + r;
        s[r * kLd + c] = row < row_end ? to_acc(base[row * row_stride + c * col_stride]) : Acc(0);
    }
}

}  // namespace bwd
}  // namespace cuonline

// dK and dV of one tile of keys. One block per SM at least, as the forward (ptxas's default
// target capped some forward variants' registers and spilled).
extern "C" __global__ void __launch_bounds__(cuonline::bwd::kThreads, 1)
cuonline_attention_bwd_dkdv(CUONLINE_ATTENTION_BWD_PARAMS)
{
    using namespace cuonline;
    using namespace cuonline::bwd;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_ACC, cuonline_bwd_dkdv_smem);
    Acc* sK = cuonline_bwd_dkdv_smem;     // (kBlockR, kD): the block's keys
    Acc* sV = sK + kBlockR * kD;          // (kBlockR, kDv)
    Acc* sQ = sV + kBlockR * kDv;         // (kBlockC, kLdD): a query tile
    Acc* sdO = sQ + kBlockC * kLdD;       // (kBlockC, kLdDv)
    Acc* sLse = sdO + kBlockC * kLdDv;    // (kBlockC)
    Acc* sDelta = sLse + kBlockC;         // (kBlockC)
    Acc* sRq = sDelta + kBlockC;          // (kBlockC, kLdRel), with rel_qk only
    Acc* sRk = sRq + kBlockC * kLdRel;    // (kBlockC + kBlockR - 1, kLdRel)

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    // ---- which keys, and the queries that may see them (packed: of the block's sequence)
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
    // query i sees key j only if i + diag - left <= j <= i + diag + right
    long long i_lo = 0, i_hi = len_q;
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

    Acc dk_acc[kRows][kColsD], dv_acc[kRows][kColsDv];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int c = 0; c < kColsD; ++c) dk_acc[r][c] = Acc(0);
#pragma unroll
        for (int c = 0; c < kColsDv; ++c) dv_acc[r][c] = Acc(0);
    }

    if (j0 < range.key_end && i_lo < i_hi) {
        // ---- stage the block's keys and values once; keys past key_end are zero
        stage<kBlockR, kD, kD>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0, range.key_end);
        stage<kBlockR, kDv, kDv>(sV, v_b, strides[2 * kV], strides[2 * kV + 1], j0,
                                 range.key_end);

        for (long long i0 = (i_lo / kBlockC) * kBlockC; i0 < i_hi; i0 += kBlockC) {
            // ---- stage a query tile: q, dO, lse, Delta (the barrier also keeps the previous
            //      tile alive until every warp has accumulated from it)
            __syncthreads();
            stage<kBlockC, kD, kLdD>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0, len_q);
            stage<kBlockC, kDv, kLdDv>(sdO, do_b, strides[2 * kDout], strides[2 * kDout + 1], i0,
                                       len_q);
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
            __syncthreads();

            // ---- scores s[r][t] = k_(warp row r) . q_(i0 + lane + 32 t), dP likewise
            Acc s[kRows][kPer], dp[kRows][kPer];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int t = 0; t < kPer; ++t) s[r][t] = dp[r][t] = Acc(0);
#pragma unroll 4
            for (int d = 0; d < kD; ++d) {
                Acc qd[kPer];
#pragma unroll
                for (int t = 0; t < kPer; ++t) qd[t] = sQ[(lane + 32 * t) * kLdD + d];
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const Acc kd = sK[(warp * kRows + r) * kD + d];  // broadcast
#pragma unroll
                    for (int t = 0; t < kPer; ++t) s[r][t] += kd * qd[t];
                }
            }
#pragma unroll 4
            for (int d = 0; d < kDv; ++d) {
                Acc od[kPer];
#pragma unroll
                for (int t = 0; t < kPer; ++t) od[t] = sdO[(lane + 32 * t) * kLdDv + d];
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const Acc vd = sV[(warp * kRows + r) * kDv + d];  // broadcast
#pragma unroll
                    for (int t = 0; t < kPer; ++t) dp[r][t] += vd * od[t];
                }
            }

            // ---- weights P (into s) and the gradients of the raw scores (into dp)
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const long long j = j0 + warp * kRows + r;
#pragma unroll
                for (int t = 0; t < kPer; ++t) {
                    const int ii = lane + 32 * t;
                    Acc rel = Acc(0);  // rel_q[i] · rel_k[delta], from the staged copies
                    if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i0 + ii, j);
                    const Acc x = pipe.score(s[r][t], i0 + ii, j, rel);
                    const Acc p = backward_weight(x, sLse[ii]);
                    Acc g_bias, g_content;
                    dp[r][t] = logit_grads(p, dp[r][t], sDelta[ii], x, s[r][t], rel, scale,
                                           softcap, g_bias, g_content);
                    s[r][t] = p;
                }
            }

            // ---- accumulate dV += P^T dO and dK += g^T Q: query ii's weights come from the
            //      lane that scored it; a zero (warp-uniform) adds nothing and is skipped
#pragma unroll
            for (int t = 0; t < kPer; ++t) {
#pragma unroll 2
                for (int src = 0; src < 32; ++src) {
                    const int ii = src + 32 * t;
                    Acc ov[kColsDv], qv[kColsD];
#pragma unroll
                    for (int c = 0; c < kColsDv; ++c) {
                        const int col = lane + 32 * c;
                        ov[c] = col < kDv ? sdO[ii * kLdDv + col] : Acc(0);
                    }
#pragma unroll
                    for (int c = 0; c < kColsD; ++c) {
                        const int col = lane + 32 * c;
                        qv[c] = col < kD ? sQ[ii * kLdD + col] : Acc(0);
                    }
#pragma unroll
                    for (int r = 0; r < kRows; ++r) {
                        const Acc p = __shfl_sync(CUONLINE_FULL_MASK, s[r][t], src);
                        const Acc g = __shfl_sync(CUONLINE_FULL_MASK, dp[r][t], src);
                        if (p != Acc(0)) {
#pragma unroll
                            for (int c = 0; c < kColsDv; ++c) dv_acc[r][c] += p * ov[c];
                        }
                        if (g != Acc(0)) {
#pragma unroll
                            for (int c = 0; c < kColsD; ++c) dk_acc[r][c] += g * qv[c];
                        }
                    }
                }
            }
        }
    }

    // ---- write dK and dV of the block's keys (zero for keys nothing sees)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const long long j = j0 + warp * kRows + r;
        if (j >= len_k) continue;
        const long long row = b * lk + kb.k_start + j;
#pragma unroll
        for (int c = 0; c < kColsD; ++c) {
            const int col = lane + 32 * c;
            if (col < kD) dk[row * kD + col] = dk_acc[r][c];
        }
#pragma unroll
        for (int c = 0; c < kColsDv; ++c) {
            const int col = lane + 32 * c;
            if (col < kDv) dv[row * kDv + col] = dv_acc[r][c];
        }
    }
}

// dQ of one tile of queries, and the gradients of its logits (kWriteDs: dS; the reduced ones).
extern "C" __global__ void __launch_bounds__(cuonline::bwd::kThreads, 1)
cuonline_attention_bwd_dq(CUONLINE_ATTENTION_BWD_PARAMS)
{
    using namespace cuonline;
    using namespace cuonline::bwd;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_ACC, cuonline_bwd_dq_smem);
    Acc* sQ = cuonline_bwd_dq_smem;       // (kBlockR, kD): the block's queries
    Acc* sdO = sQ + kBlockR * kD;         // (kBlockR, kDv)
    Acc* sK = sdO + kBlockR * kDv;        // (kBlockC, kLdD): a key tile
    Acc* sV = sK + kBlockC * kLdD;        // (kBlockC, kLdDv)
    Acc* sRq = sV + kBlockC * kLdDv;      // (kBlockR, kLdRel), with rel_qk only
    Acc* sRk = sRq + kBlockR * kLdRel;    // (kBlockR + kBlockC - 1, kLdRel)
    // the tile's dS (block bias, rel_bias) and dC (rel_qk) for the in-kernel reductions
    Acc* sGb = sRq + (kHasRelQk ? (2 * kBlockR + kBlockC - 1) * kLdRel : 0);
    Acc* sGc = sGb + (kBiasTile ? kBlockR * kLdG : 0);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

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

    Acc dq_acc[kRows][kColsD];
    Acc row_lse[kRows], row_delta[kRows];
    Acc row_sum[kRows];      // this lane's share of each row's sum of P
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        row_sum[r] = Acc(0);
#pragma unroll
        for (int c = 0; c < kColsD; ++c) dq_acc[r][c] = Acc(0);
        const long long i = i0 + warp * kRows + r;
        row_lse[r] = i < len_q ? lse[q_row0 + i] : neg_inf(Acc());
        row_delta[r] = i < len_q ? delta[q_row0 + i] : Acc(0);
    }

    if (j_lo < j_hi) {
        // ---- stage the block's queries and their output gradients once
        stage<kBlockR, kD, kD>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0, len_q);
        stage<kBlockR, kDv, kDv>(sdO, do_b, strides[2 * kDout], strides[2 * kDout + 1], i0,
                                 len_q);
        if constexpr (kHasRelQk) pipe.stage_rel_q<kThreads>(sRq, i0, kBlockR);

        for (long long j0 = (j_lo / kBlockC) * kBlockC; j0 < j_hi; j0 += kBlockC) {
            // ---- stage a key tile (the barrier also keeps the previous one alive until read)
            __syncthreads();
            stage<kBlockC, kD, kLdD>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0, key_end);
            stage<kBlockC, kDv, kLdDv>(sV, v_b, strides[2 * kV], strides[2 * kV + 1], j0,
                                       key_end);
            int band_lo = 0;  // rel_k rows [band_lo, band_lo + count) of this tile
            if constexpr (kHasRelQk) {
                int count;
                pipe.rel_k_band(i0, kBlockR, j0, kBlockC, band_lo, count);
                pipe.stage_rel_k<kThreads>(sRk, band_lo, count);
            }
            __syncthreads();

            // ---- scores s[r][t] = q_(warp row r) . k_(j0 + lane + 32 t), dP likewise
            Acc s[kRows][kPer], dp[kRows][kPer];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int t = 0; t < kPer; ++t) s[r][t] = dp[r][t] = Acc(0);
#pragma unroll 4
            for (int d = 0; d < kD; ++d) {
                Acc kd[kPer];
#pragma unroll
                for (int t = 0; t < kPer; ++t) kd[t] = sK[(lane + 32 * t) * kLdD + d];
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const Acc qd = sQ[(warp * kRows + r) * kD + d];  // broadcast
#pragma unroll
                    for (int t = 0; t < kPer; ++t) s[r][t] += qd * kd[t];
                }
            }
#pragma unroll 4
            for (int d = 0; d < kDv; ++d) {
                Acc vd[kPer];
#pragma unroll
                for (int t = 0; t < kPer; ++t) vd[t] = sV[(lane + 32 * t) * kLdDv + d];
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const Acc od = sdO[(warp * kRows + r) * kDv + d];  // broadcast
#pragma unroll
                    for (int t = 0; t < kPer; ++t) dp[r][t] += od * vd[t];
                }
            }

            // ---- gradients of the raw scores (into dp); dS of every place of the tile
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const long long i = i0 + warp * kRows + r;
#pragma unroll
                for (int t = 0; t < kPer; ++t) {
                    const long long j = j0 + lane + 32 * t;
                    Acc rel = Acc(0);  // rel_q[i] · rel_k[delta], from the staged copies
                    if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i, j);
                    const Acc x = pipe.score(s[r][t], i, j, rel);
                    const Acc p = summed_weight(x, row_lse[r]);
                    row_sum[r] += p;
                    Acc g_bias, g_content;
                    dp[r][t] = logit_grads(p, dp[r][t], row_delta[r], x, s[r][t], rel, scale,
                                           softcap, g_bias, g_content);
                    const bool inside = i < len_q && j < len_k;
                    if constexpr (kWriteDs) {
                        if (inside) ds[(b * lq + i) * lk + j] += g_bias;
                    }
                    const int at = (warp * kRows + r) * kLdG + lane + 32 * t;
                    if constexpr (kBiasTile) sGb[at] = inside ? g_bias : Acc(0);
                    if constexpr (kHasRelQk) sGc[at] = inside ? g_content : Acc(0);
                }
            }

            // ---- accumulate dQ += g K: key jj's gradients come from the lane that scored it
#pragma unroll
            for (int t = 0; t < kPer; ++t) {
#pragma unroll 2
                for (int src = 0; src < 32; ++src) {
                    const int jj = src + 32 * t;
                    Acc kv[kColsD];
#pragma unroll
                    for (int c = 0; c < kColsD; ++c) {
                        const int col = lane + 32 * c;
                        kv[c] = col < kD ? sK[jj * kLdD + col] : Acc(0);
                    }
#pragma unroll
                    for (int r = 0; r < kRows; ++r) {
                        const Acc g = __shfl_sync(CUONLINE_FULL_MASK, dp[r][t], src);
                        if (g != Acc(0)) {
#pragma unroll
                            for (int c = 0; c < kColsD; ++c) dq_acc[r][c] += g * kv[c];
                        }
                    }
                }
            }

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
    //      sum of P over the warp's lanes (a fixed butterfly: every lane gets the same sum)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const long long i = i0 + warp * kRows + r;
        const Acc sum = warp_sum(row_sum[r]);
        if (i >= len_q) continue;
        if (lane == 0) row_sums[q_row0 + i] = sum;
#pragma unroll
        for (int c = 0; c < kColsD; ++c) {
            const int col = lane + 32 * c;
            if (col < kD) dq[(q_row0 + i) * kD + col] = dq_acc[r][c];
        }
    }
}

// rel_k's gradient at the exact distances, one warp per table row (attention_grads.cuh).
extern "C" __global__ void __launch_bounds__(32 * cuonline::kRelkWarps, 1)
cuonline_attention_bwd_rel_k(CUONLINE_ATTENTION_BWD_PARAMS)
{
    CUONLINE_ATTENTION_BWD_REL_K_BODY;
}
