// attention_stats.cu: statistics of the attention weights P = softmax(s) without the Lq x Lk
// matrix (cuonline.attention_stats), SIMT, deterministic (no atomics; every output element
// written by one thread, every sum in a fixed order).
//
// Variant selection: source.py prepends #define lines (cuonline/kernels/specs.py,
// AttentionStatsSpec), then common.cuh and attention_score.cuh (the forward's score pipeline:
// which keys a query sees and how q·k becomes a logit, so the statistics describe exactly the
// P that attention applies). Required defines, beside the feature flags of attention_score.cuh:
//   CUONLINE_T, CUONLINE_ACC       element and accumulation type (float, or double for double)
//   CUONLINE_D                     head dim of q and k (1..256)
//   CUONLINE_WARPS                 warps per block
//   CUONLINE_ROWS_PER_WARP         rows a warp owns: queries (pass 1, rows), keys (pass 2)
//   CUONLINE_KEYS_PER_LANE         rows a lane streams per tile: keys (pass 1, rows), queries
//                                  (pass 2)
//   CUONLINE_STATS_TOP_K           1: pass 1 keeps the running top-k selection (k <= 32)
//
// Three kernels, in the order the host launches them:
//   cuonline_attention_stats (pass 1, query-owned, the SIMT forward's loop without V):
//     grid.x = nbatch * n_query_tiles; warp w owns queries [w kRows, (w+1) kRows) of the
//     block's tile; lane t scores keys t, t + 32, ... of each key tile. Per row, as the
//     forward's online softmax: m (running max, warp-uniform), and per lane its share of
//     l = sum e^(s - m) and of u = sum e^(s - m) (s - m) (the entropy's sum, rescaled with l:
//     u' = alpha (u + (m - m') l)); the first key of the lane's largest score; with top-k,
//     the row's best k (score, key) pairs sorted in descending score, entry e in lane e
//     (ties: the earlier key first, as keys arrive in increasing order). Then
//       lse = m + log l,  entropy = log l - u / l,  max weight = 1 / l,
//       argmax = the lowest key among the lanes' firsts of the maximum,
//       top weights = e^(s - lse).
//     A row that sees no key: lse -inf, entropy 0, max weight 0, argmax -1, top keys -1
//     with weight 0 (never -inf - -inf, never 0 * -inf).
//   cuonline_attention_stats_received (pass 2, key-owned, shaped like the dK/dV kernel):
//     grid.x = nbatch * n_key_tiles; warp w owns keys [w kRows, (w+1) kRows) of the block's
//     tile; lane t scores queries t, t + 32, ... of each query tile the keys may be seen by,
//     in increasing order, and adds w_i e^(s_ij - lse_i) to its share; the shares are summed
//     by the butterfly of warp_sum. A zero weight adds nothing (not even a NaN row's P).
//   cuonline_attention_stats_rows (rows of P): grid.x = nbatch * ceil(nrows / kBlockM); warp
//     w owns the listed queries rows[tile kBlockM + w kRows + r] (gathered, so rel_q · rel_k
//     is read from global memory); each writes e^(s - lse) of every key it sees. Keys it does
//     not see (and the tail past kv_lengths, never visited) keep the host's zeros.
// Shared memory (dynamic, in the accumulation type; the largest kernel sizes the launch):
//   sA : (kBlockM, kD)               the owned rows (queries, or keys in pass 2), broadcast
//   sB : (kBlockN, kLd)              a streamed tile (keys, or queries in pass 2), lane t
//                                    reads row t: the odd stride keeps lanes on 32 banks
//   pass 2: sLse, sW (kBlockN)       the streamed queries' lse and weights
//   with rel_qk (pass 1 and 2): sRq (max(kBlockM, kBlockN), kLdRel), sRk (kBlockM + kBlockN - 1,
//                                    kLdRel): attention_score.cuh's staging
//
// Operands are addressed as in the forward (the same offset table, (nbatch, 8), and strides,
// (8, 2); the column of v is unused). Outputs are contiguous: lse, entropy, max_weight, argmax
// (nbatch, lq); top_indices, top_weights (nbatch, lq, top_k); received (nbatch, lk); weights
// (nbatch, nrows, lk).

#ifndef CUONLINE_STATS_TOP_K
#error "attention_stats.cu needs the CUONLINE_* variant defines (see cuonline/kernels/specs.py)"
#endif

namespace cuonline {
namespace stats {

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;

constexpr int kD = CUONLINE_D;
constexpr int kWarps = CUONLINE_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = CUONLINE_ROWS_PER_WARP;
constexpr int kBlockM = kWarps * kRows;       // owned rows per block
constexpr int kKeys = CUONLINE_KEYS_PER_LANE;
constexpr int kBlockN = 32 * kKeys;           // streamed rows per tile
constexpr int kLd = kD + 1;
constexpr bool kTopK = CUONLINE_STATS_TOP_K != 0;
// A key index no visible key has (keys are below 2^31: lk is an int)
constexpr int kNoKey = 0x7fffffff;
static_assert(!kSplit, "attention_stats does not split keys");
using namespace cuonline::operand;

// Stage rows [r0, r0 + kRowsN) x columns [0, kD) of q or k into s (row stride kLdS); rows at
// or past `row_end` are zero (never read from global memory).
template <int kRowsN, int kLdS>
__device__ __forceinline__ void stage(Acc* s, const T* base, long long row_stride,
                                      long long col_stride, long long r0, long long row_end) {
    for (int idx = threadIdx.x; idx < kRowsN * kD; idx += kThreads) {
        const int r = idx / kD;
        const int c = idx - r * kD;
        const long long row = r0 + r;
        s[r * kLdS + c] = row < row_end ? to_acc(base[row * row_stride + c * col_stride]) : Acc(0);
    }
}

// s[r][t] = a_(warp row r) · b_(lane + 32 t): the owned rows from sA (broadcast), the streamed
// ones from sB.
__device__ __forceinline__ void dot_tile(Acc (&s)[kRows][kKeys], const Acc* sA, const Acc* sB,
                                         int warp, int lane) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int t = 0; t < kKeys; ++t) s[r][t] = Acc(0);
#pragma unroll 4
    for (int d = 0; d < kD; ++d) {
        Acc bd[kKeys];
#pragma unroll
        for (int t = 0; t < kKeys; ++t) bd[t] = sB[(lane + 32 * t) * kLd + d];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const Acc ad = sA[(warp * kRows + r) * kD + d];  // broadcast
#pragma unroll
            for (int t = 0; t < kKeys; ++t) s[r][t] += ad * bd[t];
        }
    }
}

// P at a logit s given its row's lse: 0 where the key is invisible (s = -inf) or the row sees
// none (lse = -inf), by a select (never -inf - -inf); NaN stays in a NaN row.
__device__ __forceinline__ Acc weight_of(Acc s, Acc row_lse) {
    if (s == neg_inf(Acc()) || row_lse == neg_inf(Acc())) return Acc(0);
    return exp2_((s - row_lse) * log2e(Acc()));
}

// The running statistics of one query row, as one lane of its warp sees them.
//   m      running max of the row's scores (the same in every lane)
//   l, u   this lane's shares of sum e^(s - m) and sum e^(s - m) (s - m)
//   best, best_j   the lane's largest score and its first key (kNoKey before any)
//   top_s, top_j   with top-k: entry `lane` of the row's best (score, key) pairs, sorted by
//                  descending score (-inf, -1: no entry)
struct RowStats {
    Acc m, l, u, best, top_s;
    int best_j, top_j;

    __device__ __forceinline__ void init() {
        m = best = top_s = neg_inf(Acc());
        l = u = Acc(0);
        best_j = kNoKey;
        top_j = -1;
    }

    // Raise m to include `tile_max` (warp-uniform); rescale l and u. Returns the offset to
    // subtract from the tile's scores: the new max, or 0 while the row has seen nothing.
    __device__ __forceinline__ Acc rescale_to(Acc tile_max) {
        const Acc m_new = max_(m, tile_max);
        const Acc m_use = m_new == neg_inf(Acc()) ? Acc(0) : m_new;
        const Acc alpha = exp2_((m - m_use) * log2e(Acc()));  // m = -inf: 0
        // e^(s - m') (s - m') = alpha e^(s - m) ((s - m) + (m - m')); nothing seen: u = l = 0
        const Acc shift = m == neg_inf(Acc()) ? Acc(0) : m - m_use;
        u = alpha * (u + shift * l);
        l *= alpha;
        m = m_new;
        return m_use;
    }

    // Take in the score s of key j (keys in increasing order per lane), given m_use.
    __device__ __forceinline__ void add(Acc s, int j, Acc m_use) {
        if (s > best) {  // strict: the first key of the max; NaN never wins
            best = s;
            best_j = j;
        }
        if (s == neg_inf(Acc())) return;  // invisible: weight 0, and 0 * -inf is NaN
        const Acc x = s - m_use;
        const Acc p = exp2_(x * log2e(Acc()));
        l += p;
        u += p * x;
    }
};

// Insert the row's candidates s (key j0 + lane + 32 t at t) into the warp's sorted top-k
// entries (one per lane, the first `top_k` meaningful). Only a score above the current k-th
// entry enters (an equal one comes later, so it loses the tie); they are taken in key order
// (t, then lane), and each goes after the entries with a score >= its own. Warp-uniform loop.
__device__ __forceinline__ void top_insert(RowStats& st, const Acc (&s)[kKeys], long long j0,
                                           int top_k, int lane) {
    Acc kth = __shfl_sync(CUONLINE_FULL_MASK, st.top_s, top_k - 1);
#pragma unroll
    for (int t = 0; t < kKeys; ++t) {
        unsigned want = __ballot_sync(CUONLINE_FULL_MASK, s[t] > kth);
        while (want != 0u) {
            const int src = __ffs(int(want)) - 1;
            const Acc x = __shfl_sync(CUONLINE_FULL_MASK, s[t], src);
            const int pos = __popc(__ballot_sync(CUONLINE_FULL_MASK, st.top_s >= x));
            const Acc up_s = __shfl_up_sync(CUONLINE_FULL_MASK, st.top_s, 1);
            const int up_j = __shfl_up_sync(CUONLINE_FULL_MASK, st.top_j, 1);
            if (lane == pos) {
                st.top_s = x;
                st.top_j = int(j0) + src + 32 * t;
            } else if (lane > pos) {
                st.top_s = up_s;
                st.top_j = up_j;
            }
            kth = __shfl_sync(CUONLINE_FULL_MASK, st.top_s, top_k - 1);
            // the later lanes of this t that still beat the k-th entry (2u << 31 is 0)
            want = __ballot_sync(CUONLINE_FULL_MASK, s[t] > kth) & ~((2u << src) - 1u);
        }
    }
}

}  // namespace stats
}  // namespace cuonline

// The parameters every statistics kernel starts with: the forward's operands (without v) and
// scalars, in the order cuonline/kernels/stats_plan.py passes them.
#define CUONLINE_STATS_PARAMS                                                                  \
    const CUONLINE_T* __restrict__ q,             /* per batch: (lq, D) */                    \
        const CUONLINE_T* __restrict__ k,         /* per batch: (lk, D) */                    \
        const CUONLINE_ACC* __restrict__ bias,    /* per batch: (lq, lk) or null */           \
        const unsigned char* __restrict__ mask,   /* per batch: (lq, lk) or null */           \
        const long long* __restrict__ kv_lengths, /* (nbatch,) or null */                     \
        const CUONLINE_ACC* __restrict__ alibi,   /* (nbatch,) or null */                     \
        const CUONLINE_ACC* __restrict__ rel_bias, /* per batch: (1, Rb) or null */           \
        const CUONLINE_ACC* __restrict__ rel_q,   /* per batch: (lq, Dr) or null */           \
        const CUONLINE_ACC* __restrict__ rel_k,   /* per batch: (Rk, Dr) or null */           \
        const long long* __restrict__ offsets,    /* (nbatch, 8) */                           \
        const long long* __restrict__ strides,    /* (8, 2) */                                \
        int lq, int lk,                                                                       \
        long long diagonal_offset,        /* q_offset - k_offset: query i faces key i + it */ \
        CUONLINE_ACC scale, CUONLINE_ACC softcap,                                             \
        long long window_left, long long window_right, /* >= 2^60: unbounded */              \
        int bias_block_rows, int bias_block_cols,      /* (r, c) of a block bias, else 1 */  \
        int rel_bias_radius, int rel_k_radius          /* (Rb - 1) / 2, (Rk - 1) / 2 */

#define CUONLINE_STATS_PIPELINE(range)                                                         \
    ScorePipeline<Acc>(range, lq, window_left, window_right, scale, softcap, alibi, bias, mask, \
                       offsets + (range).b * kCount, strides, bias_block_rows,                  \
                       bias_block_cols, rel_bias, rel_bias_radius, rel_q, rel_k, rel_k_radius)

// Pass 1: lse, entropy, max weight, argmax and the top-k of each query row.
extern "C" __global__ void __launch_bounds__(cuonline::stats::kThreads, 1)
cuonline_attention_stats(CUONLINE_STATS_PARAMS,
                         CUONLINE_ACC* __restrict__ lse,          // (nbatch, lq)
                         CUONLINE_ACC* __restrict__ entropy,      // (nbatch, lq)
                         CUONLINE_ACC* __restrict__ max_weight,   // (nbatch, lq)
                         long long* __restrict__ argmax,          // (nbatch, lq)
                         long long* __restrict__ top_indices,     // (nbatch, lq, top_k) or null
                         CUONLINE_ACC* __restrict__ top_weights,  // (nbatch, lq, top_k) or null
                         int top_k)                               // 0..32 (1.. with kTopK)
{
    using namespace cuonline;
    using namespace cuonline::stats;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_ACC, cuonline_stats_smem);
    Acc* sQ = cuonline_stats_smem;            // (kBlockM, kD)
    Acc* sK = sQ + kBlockM * kD;              // (kBlockN, kLd)
    Acc* sRq = sK + kBlockN * kLd;            // (kBlockM, kLdRel), with rel_qk only
    Acc* sRk = sRq + kBlockM * kLdRel;        // (kBlockM + kBlockN - 1, kLdRel)

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    // ---- which queries, and which keys may be visible to them (attention_score.cuh)
    const BlockRange range = block_range<kBlockM>(lq, lk, diagonal_offset, kv_lengths,
                                                  window_left, window_right, lk);
    const long long b = range.b, i0 = range.i0;
    const long long* off = offsets + b * kCount;
    const T* q_b = q + off[kQ];
    const T* k_b = k + off[kK];
    const ScorePipeline<Acc> pipe = CUONLINE_STATS_PIPELINE(range);

    RowStats st[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) st[r].init();

    if (range.j_lo < range.j_hi) {
        // ---- stage the query tile; rows past lq are zero and fully masked below
        stage<kBlockM, kD>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0, lq);
        if constexpr (kHasRelQk) pipe.stage_rel_q<kThreads>(sRq, i0, kBlockM);

        for (long long j0 = (range.j_lo / kBlockN) * kBlockN; j0 < range.j_hi; j0 += kBlockN) {
            // ---- stage the key tile (the barrier keeps the previous one until every warp
            //      has scored it)
            __syncthreads();
            stage<kBlockN, kLd>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0,
                                range.key_end);
            int band_lo = 0;  // rel_k rows [band_lo, band_lo + count) of this tile
            if constexpr (kHasRelQk) {
                int count;
                pipe.rel_k_band(i0, kBlockM, j0, kBlockN, band_lo, count);
                pipe.stage_rel_k<kThreads>(sRk, band_lo, count);
            }
            __syncthreads();

            // ---- scores, then the score pipeline: logits, -inf for invisible keys
            Acc s[kRows][kKeys];
            dot_tile(s, sQ, sK, warp, lane);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const long long i = i0 + warp * kRows + r;
#pragma unroll
                for (int t = 0; t < kKeys; ++t) {
                    const long long j = j0 + lane + 32 * t;
                    Acc rel = Acc(0);
                    if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i, j);
                    s[r][t] = pipe.score(s[r][t], i, j, rel);
                }
            }

            // ---- top-k, then the running max, l, u and the first key of the max
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                if constexpr (kTopK) top_insert(st[r], s[r], j0, top_k, lane);
                Acc tile_max = s[r][0];
#pragma unroll
                for (int t = 1; t < kKeys; ++t) tile_max = max_(tile_max, s[r][t]);
                const Acc m_use = st[r].rescale_to(warp_max(tile_max));
#pragma unroll
                for (int t = 0; t < kKeys; ++t) st[r].add(s[r][t], int(j0) + lane + 32 * t, m_use);
            }
        }
    }

    // ---- finish: sum the lanes' shares, reduce the first key of the max, write
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const long long i = i0 + warp * kRows + r;
        const Acc l_total = warp_sum(st[r].l);
        const Acc u_total = warp_sum(st[r].u);
        Acc best = st[r].best;
        int best_j = st[r].best_j;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const Acc other = __shfl_xor_sync(CUONLINE_FULL_MASK, best, offset);
            const int other_j = __shfl_xor_sync(CUONLINE_FULL_MASK, best_j, offset);
            if (other > best || (other == best && other_j < best_j)) {
                best = other;
                best_j = other_j;
            }
        }
        if (i >= lq) continue;
        const long long row = b * lq + i;
        Acc row_lse = neg_inf(Acc()), row_h = Acc(0), row_max = Acc(0);
        long long row_arg = -1;
        if (l_total != Acc(0)) {  // not a row without keys (a NaN row stays NaN)
            const Acc log_l = log2_(l_total) * ln2(Acc());
            row_lse = st[r].m + log_l;
            row_h = log_l - u_total / l_total;
            row_max = Acc(1) / l_total;
            row_arg = best_j == kNoKey ? -1 : best_j;
        }
        if (lane == 0) {
            lse[row] = row_lse;
            entropy[row] = row_h;
            max_weight[row] = row_max;
            argmax[row] = row_arg;
        }
        if constexpr (kTopK) {
            if (lane < top_k) {
                const bool none = st[r].top_s == neg_inf(Acc());
                top_indices[row * top_k + lane] = none ? -1 : st[r].top_j;
                top_weights[row * top_k + lane] = none ? Acc(0) : weight_of(st[r].top_s, row_lse);
            }
        }
    }
}

// Pass 2: received_j = sum_i w_i e^(s_ij - lse_i) of the block's keys.
extern "C" __global__ void __launch_bounds__(cuonline::stats::kThreads, 1)
cuonline_attention_stats_received(CUONLINE_STATS_PARAMS,
                                  const CUONLINE_ACC* __restrict__ lse,   // (nbatch, lq)
                                  const CUONLINE_ACC* __restrict__ query_weights,  // or null
                                  CUONLINE_ACC* __restrict__ received)    // (nbatch, lk)
{
    using namespace cuonline;
    using namespace cuonline::stats;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_ACC, cuonline_stats_received_smem);
    Acc* sK = cuonline_stats_received_smem;   // (kBlockM, kD): the block's keys
    Acc* sQ = sK + kBlockM * kD;              // (kBlockN, kLd): a query tile
    Acc* sLse = sQ + kBlockN * kLd;           // (kBlockN)
    Acc* sW = sLse + kBlockN;                 // (kBlockN)
    Acc* sRq = sW + kBlockN;                  // (kBlockN, kLdRel), with rel_qk only
    Acc* sRk = sRq + kBlockN * kLdRel;        // (kBlockN + kBlockM - 1, kLdRel)

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    // ---- which keys, and the queries that may see them (as the dK/dV kernel)
    const long long n_ktiles = (lk + kBlockM - 1) / kBlockM;
    BlockRange range;
    range.b = blockIdx.x / n_ktiles;
    const long long b = range.b;
    const long long j0 = (blockIdx.x - b * n_ktiles) * kBlockM;
    range.diag = diagonal_offset;
    range.key_end = lk;
    if constexpr (kHasKvLengths) range.key_end = kv_lengths[b];  // clipped to [0, lk]
    range.j_lo = 0;
    range.j_hi = range.key_end;
    // query i sees key j only if i + diag - left <= j <= i + diag + right
    long long i_lo = 0, i_hi = lq;
    if constexpr (kHasWindow) {
        if (j0 - range.diag - window_right > i_lo) i_lo = j0 - range.diag - window_right;
        if (j0 + kBlockM - range.diag + window_left < i_hi)
            i_hi = j0 + kBlockM - range.diag + window_left;
    }
    range.i0 = i_lo;
    range.i_end = i_hi;
    const long long* off = offsets + b * kCount;
    const T* q_b = q + off[kQ];
    const T* k_b = k + off[kK];
    const ScorePipeline<Acc> pipe = CUONLINE_STATS_PIPELINE(range);

    Acc acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = Acc(0);

    if (j0 < range.key_end && i_lo < i_hi) {
        // ---- stage the block's keys once; keys past key_end are zero
        stage<kBlockM, kD>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0, range.key_end);

        for (long long i0 = (i_lo / kBlockN) * kBlockN; i0 < i_hi; i0 += kBlockN) {
            // ---- stage a query tile with its lse and weights (the barrier keeps the
            //      previous one until every warp has summed it)
            __syncthreads();
            stage<kBlockN, kLd>(sQ, q_b, strides[2 * kQ], strides[2 * kQ + 1], i0, lq);
            for (int idx = threadIdx.x; idx < kBlockN; idx += kThreads) {
                const long long i = i0 + idx;
                sLse[idx] = i < lq ? lse[b * lq + i] : neg_inf(Acc());
                sW[idx] = i >= lq ? Acc(0) : (query_weights ? query_weights[b * lq + i] : Acc(1));
            }
            int band_lo = 0;
            if constexpr (kHasRelQk) {
                int count;
                pipe.stage_rel_q<kThreads>(sRq, i0, kBlockN);
                pipe.rel_k_band(i0, kBlockN, j0, kBlockM, band_lo, count);
                pipe.stage_rel_k<kThreads>(sRk, band_lo, count);
            }
            __syncthreads();

            // ---- s[r][t] = k_(warp row r) . q_(i0 + lane + 32 t); add w_i P_ij
            Acc s[kRows][kKeys];
            dot_tile(s, sK, sQ, warp, lane);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const long long j = j0 + warp * kRows + r;
#pragma unroll
                for (int t = 0; t < kKeys; ++t) {
                    const int ii = lane + 32 * t;
                    const Acc w = sW[ii];
                    if (w == Acc(0)) continue;
                    Acc rel = Acc(0);
                    if constexpr (kHasRelQk) rel = pipe.rel_qk(sRq, sRk, i0, band_lo, i0 + ii, j);
                    acc[r] += w * weight_of(pipe.score(s[r][t], i0 + ii, j, rel), sLse[ii]);
                }
            }
        }
    }

    // ---- the lanes' shares summed in a fixed order; keys nothing sees receive 0
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const long long j = j0 + warp * kRows + r;
        const Acc total = warp_sum(acc[r]);
        if (j < lk && lane == 0) received[b * lk + j] = total;
    }
}

// Rows of P: weights[b, n, j] = e^(s_(rows[n], j) - lse) for the listed queries.
extern "C" __global__ void __launch_bounds__(cuonline::stats::kThreads, 1)
cuonline_attention_stats_rows(CUONLINE_STATS_PARAMS,
                              const CUONLINE_ACC* __restrict__ lse,   // (nbatch, lq)
                              const long long* __restrict__ rows,     // (nrows,) in [0, lq)
                              int nrows,
                              CUONLINE_ACC* __restrict__ weights)     // (nbatch, nrows, lk), 0
{
    using namespace cuonline;
    using namespace cuonline::stats;

    CUONLINE_DYNAMIC_SHARED(CUONLINE_ACC, cuonline_stats_rows_smem);
    Acc* sQ = cuonline_stats_rows_smem;       // (kBlockM, kD): the listed queries
    Acc* sK = sQ + kBlockM * kD;              // (kBlockN, kLd)

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    const long long n_tiles = (nrows + kBlockM - 1) / kBlockM;
    BlockRange range;
    range.b = blockIdx.x / n_tiles;
    const long long b = range.b;
    const long long n0 = (blockIdx.x - b * n_tiles) * kBlockM;  // first listed row
    range.i0 = 0;
    range.i_end = lq;
    range.diag = diagonal_offset;
    range.key_end = lk;
    if constexpr (kHasKvLengths) range.key_end = kv_lengths[b];  // clipped to [0, lk]
    range.j_lo = 0;
    range.j_hi = range.key_end;
    const long long* off = offsets + b * kCount;
    const T* q_b = q + off[kQ];
    const T* k_b = k + off[kK];
    const ScorePipeline<Acc> pipe = CUONLINE_STATS_PIPELINE(range);

    // ---- stage the listed queries (a slot past nrows is a zero row with i = lq: invisible)
    for (int idx = threadIdx.x; idx < kBlockM * kD; idx += kThreads) {
        const int r = idx / kD;
        const int c = idx - r * kD;
        const long long n = n0 + r;
        sQ[idx] = n < nrows ? to_acc(q_b[rows[n] * strides[2 * kQ] + c * strides[2 * kQ + 1]])
                            : Acc(0);
    }
    long long row_i[kRows];
    Acc row_lse[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const long long n = n0 + warp * kRows + r;
        row_i[r] = n < nrows ? rows[n] : (long long)lq;
        row_lse[r] = n < nrows ? lse[b * lq + row_i[r]] : neg_inf(Acc());
    }

    for (long long j0 = 0; j0 < range.key_end; j0 += kBlockN) {
        // ---- stage the key tile (the barrier keeps the previous one until it is scored)
        __syncthreads();
        stage<kBlockN, kLd>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0, range.key_end);
        __syncthreads();

        Acc s[kRows][kKeys];
        dot_tile(s, sQ, sK, warp, lane);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const long long i = row_i[r];
            if (i >= lq) continue;  // warp-uniform
            const long long n = n0 + warp * kRows + r;
#pragma unroll
            for (int t = 0; t < kKeys; ++t) {
                const long long j = j0 + lane + 32 * t;
                if (j >= range.key_end) continue;
                Acc rel = Acc(0);
                if constexpr (kHasRelQk) rel = pipe.rel_qk_global(i, j, rel_q, rel_k);
                weights[(b * nrows + n) * lk + j] = weight_of(pipe.score(s[r][t], i, j, rel),
                                                              row_lse[r]);
            }
        }
    }
}
