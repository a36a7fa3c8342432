// softmax.cu: softmax, log_softmax and logsumexp along one axis, with the online normalizer of
// Milakov & Gimelshein (2018): one pass for the row statistics (m, l), one pass to write.
//
// Variant selection: source.py prepends #define lines (see SoftmaxSpec in
// cuonline/kernels/specs.py) and common.cuh. Required defines:
//   CUONLINE_T, CUONLINE_ACC   element type (float, double, __half, __nv_bfloat16) and
//                              accumulation type (float, or double for double inputs)
//   CUONLINE_SOFTMAX_MODE      0 softmax, 1 log_softmax, 2 logsumexp
//   CUONLINE_HAS_MASK          0 or 1: a bool mask (True = keep) read through its own strides
//
// Rows and columns
//   A row is one position of every axis but the reduced one; its n values are the "columns".
//   The host passes the rows' dimensions as `layout` (row_ndim, 4): per dimension its extent
//   and the element strides of x, mask and out along it; row r is decomposed over them (last
//   dimension fastest). Column j of a row is at row offset + j * col_stride. Strides are in
//   elements, any sign, 0 for broadcast dimensions (a broadcast mask is never expanded).
//   out: same shape as x for softmax/log_softmax, one value per row for logsumexp.
//
// Work decomposition
//   block = rows_per_block groups of warps_per_row warps; group g owns row
//   blockIdx.x * rows_per_block + g, then every gridDim.x * rows_per_block rows after it (the
//   loop is uniform over the block, so rows past nrows still reach the barriers).
//   Statistics: thread t of a row visits columns t, t + T, ... (T = threads of the row), in
//   chunks of kChunk values: one rescale of l per chunk, one exp2 per value. The per-thread
//   states are merged by a warp butterfly, then across the row's warps through shared memory.
//   Write: the same threads visit the same columns again (x is read twice; the second read of
//   a row that fits in L2 mostly hits it).
//
// Long rows, few of them: one row per block group would leave most of the GPU idle, so the
//   host may cut every row into gridDim.y segments of seg_len columns (blockIdx.y: the
//   segment) and launch twice: cuonline_softmax_partial writes each segment's (m, l) to
//   `partial` ((nrows, gridDim.y, 2), accumulation type), then cuonline_softmax_finish merges
//   a row's partial states (every thread alike, in segment order) and writes its segment.
//   cuonline_softmax is the single launch over whole rows.

#ifndef CUONLINE_SOFTMAX_MODE
#error "softmax.cu needs the CUONLINE_* variant defines (see cuonline/kernels/specs.py)"
#endif

namespace cuonline {
namespace smx {

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;

// The variant's options, as compile-time constants (every branch compiles in every variant).
enum Mode { kSoftmax = 0, kLogSoftmax = 1, kLogSumExp = 2 };
constexpr Mode kMode = Mode(CUONLINE_SOFTMAX_MODE);
constexpr bool kHasMask = CUONLINE_HAS_MASK != 0;
static_assert(kMode == kSoftmax || kMode == kLogSoftmax || kMode == kLogSumExp,
              "CUONLINE_SOFTMAX_MODE: 0 softmax, 1 log_softmax, 2 logsumexp");

// Block size limit: larger bounds spilled the float64 variants (docs/kernels.md, "Launch
// bounds"); eight warps per row already give each lane only 32 values at 8192 columns.
constexpr int kMaxThreads = 256;
constexpr int kMaxWarps = kMaxThreads / 32;
// Values loaded per thread before one rescale: four independent loads in flight, and the
// rescale's exp2 amortised over four values.
constexpr int kChunk = 4;
// Columns of `layout`.
enum LayoutColumn { kExtent = 0, kXStride = 1, kMaskStride = 2, kOutStride = 3, kLayoutCols = 4 };

// Value j of the row in the accumulation type; masked and out-of-row values are -inf, which
// the normalizer counts as weight 0.
__device__ __forceinline__ Acc load(const T* __restrict__ x, const unsigned char* __restrict__ mask,
                                    long long j, long long n_row, long long x_off,
                                    long long x_col_stride, long long mask_off,
                                    long long mask_col_stride) {
    if (j >= n_row) return neg_inf(Acc());
    if constexpr (kHasMask) {
        if (mask[mask_off + j * mask_col_stride] == 0) return neg_inf(Acc());
    }
    return to_acc(x[x_off + j * x_col_stride]);
}

// The rows of one launch; kPhase 0 (cuonline_softmax), 1 (cuonline_softmax_partial) or 2
// (cuonline_softmax_finish), see "Long rows" above. A template, not a runtime flag: the
// single-launch kernel keeps the registers it had before segments existed.
template <int kPhase>
__device__ __forceinline__ void softmax_rows(const T* __restrict__ x,
                                             const unsigned char* __restrict__ mask,
                                             T* __restrict__ out,
                                             const long long* __restrict__ layout, int row_ndim,
                                             long long nrows, long long n,
                                             long long x_col_stride, long long mask_col_stride,
                                             long long out_col_stride, int rows_per_block,
                                             Acc scale, Acc* __restrict__ partial,
                                             long long seg_len) {
    // one partial state per warp, for the merge across the warps of a row
    __shared__ Acc s_m[kMaxWarps];
    __shared__ Acc s_l[kMaxWarps];

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int warps_per_row = (blockDim.x / 32) / rows_per_block;
    const int threads_per_row = 32 * warps_per_row;
    const int first_warp = (warp / warps_per_row) * warps_per_row;  // of this thread's row
    const int tid = threadIdx.x - 32 * first_warp;                   // rank within the row
    const long long row_step = (long long)gridDim.x * rows_per_block;
    const long long chunk_step = (long long)kChunk * threads_per_row;
    const Acc scale_log2 = scale * log2e(Acc());

    const int seg = blockIdx.y, nseg = gridDim.y;

    for (long long base = (long long)blockIdx.x * rows_per_block; base < nrows; base += row_step) {
        const long long row = base + warp / warps_per_row;
        // this block's columns of the row, [j_lo, j_hi); a row past the end loads nothing
        const long long j_lo = kPhase == 0 ? 0 : seg * seg_len;
        const long long j_end = kPhase == 0 ? n : (j_lo + seg_len < n ? j_lo + seg_len : n);
        const long long j_hi = row < nrows ? j_end : 0;
        const long long n_row = j_hi;  // loads return -inf at and past it

        // ---- element offsets of the row
        long long x_off = 0, mask_off = 0, out_off = 0;
        if (row < nrows) {
            // 32-bit division: the host keeps nrows below 2^31 per launch. A 64-bit one is a
            // subroutine call in SASS, around which sm_90's ptxas spilled the float64 variants.
            unsigned rest = (unsigned)row;
            for (int d = row_ndim - 1; d >= 0; --d) {
                const long long* dim = layout + d * kLayoutCols;
                const unsigned extent = (unsigned)dim[kExtent];
                const unsigned next = rest / extent;
                const long long i = rest - next * extent;
                rest = next;
                x_off += i * dim[kXStride];
                mask_off += i * dim[kMaskStride];
                out_off += i * dim[kOutStride];
            }
        }

        OnlineNormalizer<Acc> state;
        state.init();
        if constexpr (kPhase == 2) {
            // ---- the row's statistics from its segments' partial states, in segment order
            if (row < nrows)
                for (int y = 0; y < nseg; ++y)
                    state.merge(partial[2 * (row * nseg + y)], partial[2 * (row * nseg + y) + 1],
                                scale_log2);
        } else {
            // ---- statistics of columns [j_lo, j_hi): running (m, l) per thread, a chunk at a
            //      time
            for (long long j0 = j_lo + tid; j0 < n_row; j0 += chunk_step) {
                Acc v[kChunk];
                Acc chunk_max = neg_inf(Acc());
#pragma unroll
                for (int c = 0; c < kChunk; ++c) {
                    v[c] = load(x, mask, j0 + (long long)c * threads_per_row, n_row, x_off,
                                x_col_stride, mask_off, mask_col_stride);
                    chunk_max = max_(chunk_max, v[c]);
                }
                const Acc m_use = state.rescale_to(chunk_max, scale_log2);
#pragma unroll
                for (int c = 0; c < kChunk; ++c) state.l += exp2_((v[c] - m_use) * scale_log2);
            }

            // ---- merge: lanes of a warp, then the warps of the row (the same order in every
            //      thread, so all threads of the row hold bit-identical statistics)
            state.warp_merge(scale_log2);
            if (warps_per_row > 1) {  // the same for the whole block: the barriers are uniform
                __syncthreads();      // the previous row's reads of s_m/s_l are done
                if (lane == 0) {
                    s_m[warp] = state.m;
                    s_l[warp] = state.l;
                }
                __syncthreads();
                state.init();
                for (int w = 0; w < warps_per_row; ++w)
                    state.merge(s_m[first_warp + w], s_l[first_warp + w], scale_log2);
            }
        }
        if constexpr (kPhase == 1) {  // this segment's state, for phase 2; no output yet
            if (row < nrows && tid == 0) {
                partial[2 * (row * nseg + seg)] = state.m;
                partial[2 * (row * nseg + seg) + 1] = state.l;
            }
            continue;
        }

        if constexpr (kMode == kLogSumExp) {
            // ---- logsumexp: one value per row
            if (row < nrows && seg == 0 && tid == 0)
                out[out_off] = FromAcc<T>::cvt(state.lse(scale));
        } else {
            // ---- write pass. An empty row (l == 0: all masked or -inf) gives 0 / -inf without
            //      forming (-inf) - (-inf); a NaN l (NaN or +inf in the row) reaches every value.
            const bool empty = state.l == Acc(0);
            // softmax: 1 / l; log_softmax: log l
            const Acc norm = empty ? Acc(0)
                             : kMode == kSoftmax ? Acc(1) / state.l
                                                 : log2_(state.l) * ln2(Acc());
            for (long long j = j_lo + tid; j < n_row; j += threads_per_row) {
                const Acc v =
                    load(x, mask, j, n_row, x_off, x_col_stride, mask_off, mask_col_stride);
                Acc y;
                if constexpr (kMode == kSoftmax) {
                    y = empty ? Acc(0) : exp2_((v - state.m) * scale_log2) * norm;
                } else {
                    // (x - m) * scale - log l: x - m is exact for nearby values, unlike x - lse
                    y = empty ? neg_inf(Acc()) : (v - state.m) * scale - norm;
                }
                out[out_off + j * out_col_stride] = FromAcc<T>::cvt(y);
            }
        }
    }
}

}  // namespace smx
}  // namespace cuonline

#define CUONLINE_SOFTMAX_PARAMS                                                               \
    const CUONLINE_T* __restrict__ x,                                                        \
        const unsigned char* __restrict__ mask, /* null without CUONLINE_HAS_MASK */         \
        CUONLINE_T* __restrict__ out,                                                        \
        const long long* __restrict__ layout, /* (row_ndim, 4), see above */                 \
        int row_ndim, long long nrows, long long n, /* nrows < 2^31 */                       \
        long long x_col_stride, long long mask_col_stride, long long out_col_stride,         \
        int rows_per_block, CUONLINE_ACC scale /* > 0, multiplies x */
#define CUONLINE_SOFTMAX_ARGS \
    x, mask, out, layout, row_ndim, nrows, n, x_col_stride, mask_col_stride, out_col_stride, \
        rows_per_block, scale

// One launch: every row whole.
extern "C" __global__ void __launch_bounds__(cuonline::smx::kMaxThreads)
cuonline_softmax(CUONLINE_SOFTMAX_PARAMS) {
    cuonline::smx::softmax_rows<0>(CUONLINE_SOFTMAX_ARGS, nullptr, n);
}

// Long rows, first launch: the (m, l) of every segment of seg_len columns into `partial`
// ((nrows, gridDim.y, 2)). The host sizes their grid to about two blocks per SM (see
// cuda_softmax.py), so "1 block per SM" costs no occupancy it would use, and lets ptxas take
// the registers it needs (the default bounds spilled: docs/kernels.md, "Launch bounds").
extern "C" __global__ void __launch_bounds__(cuonline::smx::kMaxThreads, 1)
cuonline_softmax_partial(CUONLINE_SOFTMAX_PARAMS, CUONLINE_ACC* __restrict__ partial,
                         long long seg_len) {
    cuonline::smx::softmax_rows<1>(CUONLINE_SOFTMAX_ARGS, partial, seg_len);
}

// Long rows, second launch: merge each row's partial states and write its segment.
extern "C" __global__ void __launch_bounds__(cuonline::smx::kMaxThreads, 1)
cuonline_softmax_finish(CUONLINE_SOFTMAX_PARAMS, CUONLINE_ACC* __restrict__ partial,
                        long long seg_len) {
    cuonline::smx::softmax_rows<2>(CUONLINE_SOFTMAX_ARGS, partial, seg_len);
}
