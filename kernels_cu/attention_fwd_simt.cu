// attention_fwd_simt.cu: exact attention forward, FlashAttention-2 loop shape, SIMT (plain FMA).
//
// Variant selection: source.py prepends #define lines (see cuonline/kernels/specs.py), then the
// files cuonline/kernels/families.py lists: common.cuh, attention_score.cuh (the score pipeline:
// visibility, score transform, the option flags as constants) and attention_combine.cuh.
// Required defines:
//   CUONLINE_T, CUONLINE_ACC        element type (float, double, __half, __nv_bfloat16) and
//                                   accumulation type (float, or double for double inputs)
//   CUONLINE_D, CUONLINE_DV         head dims of q/k and of v (1..256, may differ)
//   CUONLINE_WARPS                  warps per block
//   CUONLINE_ROWS_PER_WARP          query rows owned by each warp  (kBlockM = warps * rows)
//   CUONLINE_KEYS_PER_LANE          keys scored by each lane per tile (kBlockN = 32 * keys)
//   CUONLINE_HAS_WINDOW, _HAS_BIAS, _HAS_BIAS_BLOCK, _HAS_MASK, _HAS_KV_LENGTHS, _HAS_ALIBI,
//   _HAS_REL_BIAS, _HAS_REL_QK, _HAS_SOFTCAP, CUONLINE_SOFTCAP_BIAS, CUONLINE_RETURN_LSE,
//   CUONLINE_SPLIT                 feature flags, 0 or 1 (read by attention_score.cuh)
//   CUONLINE_DR                    width of rel_q / rel_k (0 without rel_qk)
//
// Work decomposition
//   grid.x = nbatch * n_query_tiles, grid.z = number of key splits (1 without CUONLINE_SPLIT)
//   block  = kWarps warps; warp w owns query rows [w*kRows, (w+1)*kRows) of the tile.
//   Scores: lane t scores keys t, t+32, ... of the key tile against each of its warp's rows
//           (q rows broadcast from shared memory, K rows read at a padded stride).
//   Softmax: row max by warp shuffle; each lane keeps its share of the row sum.
//   P·V:    lane t accumulates output columns t, t+32, ...; p_j is broadcast by shuffle from
//           the lane that scored key j.
// Shared memory (dynamic, in the accumulation type):
//   sQ : (kBlockM, kD)            the query tile, loaded once
//   sKV: (kBlockN, kLdKV)         the K tile, then (after a barrier) the V tile of the same keys;
//                                 one buffer for both halves the footprint (no async copies in
//                                 SIMT, so there is no overlap to lose).
//   with rel_qk (kHasRelQk):
//   sRq: (kBlockM, kLdRel)        the query tile's rel_q rows, loaded with sQ
//   sRk: (kBlockM + kBlockN - 1, kLdRel)  the band of rel_k the tile's distances reach, loaded
//                                 with each K tile (behind the same barriers)
//
// Operands are addressed as base + offsets[b * 8 + op] + row * strides[2*op] + col *
// strides[2*op + 1] (elements, 64-bit), with op = 0 q, 1 k, 2 v, 3 bias, 4 mask, 5 rel_bias,
// 6 rel_q, 7 rel_k (operand:: in attention_score.cuh). The host
// computes the per-batch offsets from the broadcast views' strides, so broadcasting, transposes
// and negative steps cost no copy. out and lse are contiguous: (nbatch, lq, Dv) and (nbatch, lq).

#ifndef CUONLINE_KEYS_PER_LANE
#error "attention_fwd_simt.cu needs the CUONLINE_* variant defines (see cuonline/kernels/specs.py)"
#endif

namespace cuonline {
namespace fwd {

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;

constexpr int kD = CUONLINE_D;
constexpr int kDv = CUONLINE_DV;
constexpr int kWarps = CUONLINE_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = CUONLINE_ROWS_PER_WARP;
constexpr int kBlockM = kWarps * kRows;
constexpr int kKeys = CUONLINE_KEYS_PER_LANE;
constexpr int kBlockN = 32 * kKeys;
constexpr int kCols = (kDv + 31) / 32;  // output columns per lane
constexpr int kDmax = kD > kDv ? kD : kDv;
// Lane t reads row t of sKV at column d: an odd row stride (in 4-byte words for float) puts
// the 32 lanes on 32 different banks.
constexpr int kLdKV = kDmax + 1;
using namespace cuonline::operand;

// Without a split the kernel writes the final out (element type); with a split it writes a
// partial, already normalised out and lse per split into an accumulation-type workspace.
typedef AttentionOut<T, Acc> OutT;

// Stage rows [j0, j0 + kBlockN) x columns [0, kCols_) of K or V into sKV. Keys at or past
// `key_end` (kv_lengths or Lk) are never read: their rows are zero, so padding may hold NaN.
// kCleanV (the V tile): a non-finite value is staged as 0 and the result says this thread met
// one, so that P·V never forms 0 * NaN for a key a row cannot see (see the fix-up below).
template <int kWidth, bool kCleanV>
__device__ __forceinline__ bool load_kv_tile(Acc* sKV, const T* base, long long row_stride,
                                             long long col_stride, long long j0,
                                             long long key_end) {
    bool dirty = false;
    for (int idx = threadIdx.x; idx < kBlockN * kWidth; idx += kThreads) {
        const int r = idx / kWidth;
        const int c = idx - r * kWidth;
        const long long j = j0 + r;
        Acc x = j < key_end ? to_acc(base[j * row_stride + c * col_stride]) : Acc(0);
        if constexpr (kCleanV) {
            const bool finite = is_finite_(x);
            dirty = dirty || !finite;
            x = finite ? x : Acc(0);
        }
        sKV[r * kLdKV + c] = x;
    }
    return dirty;
}

}  // namespace fwd
}  // namespace cuonline

// At least one block per SM, not ptxas's default target, which spilled (docs/kernels.md,
// "Launch bounds"); the two blocks choose_tiles plans for fit at any register count.
extern "C" __global__ void __launch_bounds__(cuonline::fwd::kThreads, 1)
cuonline_attention_fwd(CUONLINE_ATTENTION_PARAMS(cuonline::fwd::OutT))
{
    using namespace cuonline;
    using namespace cuonline::fwd;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_ACC, cuonline_fwd_smem);
    __shared__ int s_dirty[kWarps];           // per warp: its V chunk held a non-finite value
    Acc* sQ = cuonline_fwd_smem;              // (kBlockM, kD)
    Acc* sKV = cuonline_fwd_smem + kBlockM * kD;  // (kBlockN, kLdKV)
    Acc* sRq = sKV + kBlockN * kLdKV;             // (kBlockM, kLdRel), with rel_qk only
    Acc* sRk = sRq + kBlockM * kLdRel;            // (kBlockM + kBlockN - 1, kLdRel)

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

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

    SoftmaxState<Acc, kCols> state[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) state[r].init();

    if (j_lo < j_hi) {
        // ---- stage the query tile; rows past lq are zero and fully masked below
        for (int idx = threadIdx.x; idx < kBlockM * kD; idx += kThreads) {
            const int r = idx / kD;
            const int c = idx - r * kD;
            const long long i = i0 + r;
            sQ[idx] = i < len_q ? to_acc(q_b[i * strides[2 * kQ] + c * strides[2 * kQ + 1]]) : Acc(0);
        }
        if constexpr (kHasRelQk) pipe.stage_rel_q<kThreads>(sRq, i0, kBlockM);

        for (long long j0 = (j_lo / kBlockN) * kBlockN; j0 < j_hi; j0 += kBlockN) {
            // ---- load K tile (the barrier also keeps the previous V tile alive until read)
            __syncthreads();
            load_kv_tile<kD, false>(sKV, k_b, strides[2 * kK], strides[2 * kK + 1], j0, key_end);
            int band_lo = 0;  // rel_k rows [band_lo, band_lo + count) of this tile
            if constexpr (kHasRelQk) {
                int count;
                pipe.rel_k_band(i0, kBlockM, j0, kBlockN, band_lo, count);
                pipe.stage_rel_k<kThreads>(sRk, band_lo, count);
            }
            __syncthreads();

            // ---- scores: s[r][t] = q_row(r) . k_(j0 + lane + 32 t)
            Acc s[kRows][kKeys];
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int t = 0; t < kKeys; ++t) s[r][t] = Acc(0);
#pragma unroll 4
            for (int d = 0; d < kD; ++d) {
                Acc kd[kKeys];
#pragma unroll
                for (int t = 0; t < kKeys; ++t) kd[t] = sKV[(lane + 32 * t) * kLdKV + d];
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    const Acc qd = sQ[(warp * kRows + r) * kD + d];  // broadcast
#pragma unroll
                    for (int t = 0; t < kKeys; ++t) s[r][t] += qd * kd[t];
                }
            }

            // ---- score pipeline: logits in natural units, -inf for invisible keys
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const long long i = i0 + warp * kRows + r;
#pragma unroll
                for (int t = 0; t < kKeys; ++t) {
                    const long long j = j0 + lane + 32 * t;
                    Acc rel = Acc(0);  // rel_q[i] · rel_k[delta], from the staged copies
                    if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i, j);
                    s[r][t] = pipe.score(s[r][t], i, j, rel);
                }
            }

            // ---- rescale running state to the new row max; p = exp(s - m)
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                Acc tile_max = s[r][0];
#pragma unroll
                for (int t = 1; t < kKeys; ++t) tile_max = max_(tile_max, s[r][t]);
                const Acc m_use = state[r].rescale_to(warp_max(tile_max));
#pragma unroll
                for (int t = 0; t < kKeys; ++t) {
                    // an invisible key (score -inf) gets weight -0: the fix-up below tells
                    // it from a visible weight that underflowed to +0
                    const Acc p = SoftmaxState<Acc, kCols>::weight(s[r][t], m_use);
                    s[r][t] = s[r][t] == neg_inf(Acc()) ? -Acc(0) : p;
                    state[r].l += s[r][t];
                }
            }

            // ---- load V tile into the same buffer once every warp is done with K
            __syncthreads();
            const bool dirty =
                load_kv_tile<kDv, true>(sKV, v_b, strides[2 * kV], strides[2 * kV + 1], j0,
                                        key_end);
            {
                const int warp_dirty = __any_sync(CUONLINE_FULL_MASK, dirty);
                if (lane == 0) s_dirty[warp] = warp_dirty;
            }
            __syncthreads();
            // s_dirty is rewritten only after the next tile's first barrier: safe to read here
            bool tile_dirty = false;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) tile_dirty = tile_dirty || s_dirty[w] != 0;

            // ---- accumulate P·V: lane owns columns lane + 32 c
#pragma unroll
            for (int t = 0; t < kKeys; ++t) {
#pragma unroll 4
                for (int src = 0; src < 32; ++src) {
                    const int jj = src + 32 * t;
                    Acc vv[kCols];
#pragma unroll
                    for (int c = 0; c < kCols; ++c) {
                        const int col = lane + 32 * c;
                        vv[c] = col < kDv ? sKV[jj * kLdKV + col] : Acc(0);
                    }
#pragma unroll
                    for (int r = 0; r < kRows; ++r) {
                        const Acc p = __shfl_sync(CUONLINE_FULL_MASK, s[r][t], src);
#pragma unroll
                        for (int c = 0; c < kCols; ++c) state[r].o[c] += p * vv[c];
                    }
                }
            }
            // ---- fix-up of a tile with non-finite values (staged as 0 above; rare, so they
            //      are read again from global memory): each adds p * v to the rows whose
            //      weight is not -0, i.e. that see the key. NaN stays in its own rows.
            if (tile_dirty) {
#pragma unroll 1
                for (int jj = 0; jj < kBlockN; ++jj) {
                    const int t = jj / 32, src = jj % 32;
                    const long long j = j0 + jj;
                    Acc p[kRows];
#pragma unroll
                    for (int r = 0; r < kRows; ++r) {
                        // s[r][t] with a runtime t: select it rather than index registers
                        Acc own = s[r][0];
#pragma unroll
                        for (int u = 1; u < kKeys; ++u) own = u == t ? s[r][u] : own;
                        p[r] = __shfl_sync(CUONLINE_FULL_MASK, own, src);
                    }
                    if (j >= key_end) continue;
#pragma unroll
                    for (int c = 0; c < kCols; ++c) {
                        const int col = lane + 32 * c;
                        if (col >= kDv) continue;
                        const Acc x = to_acc(v_b[j * strides[2 * kV] + col * strides[2 * kV + 1]]);
                        if (is_finite_(x)) continue;
#pragma unroll
                        for (int r = 0; r < kRows; ++r)
                            if (!(p[r] == Acc(0) && Acc(1) / p[r] < Acc(0)))  // not -0
                                state[r].o[c] += p[r] * x;
                    }
                }
            }
        }
    }

    // ---- finalize: sum the lanes' shares of l, normalise, write out (and lse)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const long long i = i0 + warp * kRows + r;
        const Acc l_total = warp_sum(state[r].l);
        const Acc row_lse = state[r].finalize(l_total);
        if (i >= len_q) continue;
        const long long row = output_row<kBlockM>(range, i, lq);
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
            const int col = lane + 32 * c;
            if (col < kDv) out[row * kDv + col] = FromAcc<OutT>::cvt(state[r].o[c]);
        }
        if constexpr (kWritesLse) {
            if (lane == 0) lse[row] = row_lse;
        }
    }
}

// The split-key combine (cuonline_attention_combine) is attention_combine.cuh, pasted before
// this file by source.py and shared with the tensor-core family.
