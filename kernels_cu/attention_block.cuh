// attention_block.cuh: which queries and keys one thread block of an attention family covers.
//
// Pasted (by cuonline/kernels/source.py) after common.cuh into both attention families
// (attention_fwd.cu, attention_mma.cu), so that they share one reading of the grid and one
// definition of the visible key range. It reads the variant defines CUONLINE_HAS_KV_LENGTHS,
// CUONLINE_HAS_WINDOW and CUONLINE_SPLIT.

namespace cuonline {

struct BlockRange {
    long long b;        // flattened batch element
    long long i0;       // queries [i0, i_end) of this block
    long long i_end;
    long long diag;     // key aligned with query 0: Lk - Lq (bottom-right causal alignment)
    long long key_end;  // keys at or past this (kv_lengths or Lk) are never read
    long long j_lo;     // keys [j_lo, j_hi) may be visible to some query of the block;
    long long j_hi;     // tiles outside it are never touched
};

// grid.x = nbatch * n_query_tiles, grid.z = key splits. The heaviest causal query tiles (the
// last ones) are scheduled first.
template <int kBlockM>
__device__ __forceinline__ BlockRange block_range(int lq, int lk,
                                                  const long long* __restrict__ kv_lengths,
                                                  long long window_left,
                                                  long long window_right,
                                                  long long split_keys) {
    BlockRange r;
    const long long n_qtiles = (lq + kBlockM - 1) / kBlockM;
    r.b = blockIdx.x / n_qtiles;
    const long long qtile = n_qtiles - 1 - (blockIdx.x - r.b * n_qtiles);
    r.i0 = qtile * kBlockM;
    r.i_end = r.i0 + kBlockM < lq ? r.i0 + kBlockM : lq;
    r.diag = (long long)lk - lq;

    r.key_end = lk;
#if CUONLINE_HAS_KV_LENGTHS
    r.key_end = kv_lengths[r.b];  // clipped to [0, lk] on the host
#endif
    r.j_lo = 0;
    r.j_hi = r.key_end;
#if CUONLINE_HAS_WINDOW
    if (r.i0 + r.diag - window_left > r.j_lo) r.j_lo = r.i0 + r.diag - window_left;
    if (r.i_end + r.diag + window_right < r.j_hi) r.j_hi = r.i_end + r.diag + window_right;
#endif
#if CUONLINE_SPLIT
    const long long split = blockIdx.z;
    if (split * split_keys > r.j_lo) r.j_lo = split * split_keys;
    if ((split + 1) * split_keys < r.j_hi) r.j_hi = (split + 1) * split_keys;
#endif
    return r;
}

// The parameters of both attention kernels, in the order cuonline/engines/cuda.py passes
// them (one argument tuple serves either family); OutT is the family's output element type
// (T, or Acc for the per-split partial outputs).
#define CUONLINE_ATTENTION_PARAMS(OutT)                                                        \
    const CUONLINE_T* __restrict__ q,             /* per batch: (lq, D) */                    \
        const CUONLINE_T* __restrict__ k,         /* per batch: (lk, D) */                    \
        const CUONLINE_T* __restrict__ v,         /* per batch: (lk, Dv) */                   \
        const CUONLINE_ACC* __restrict__ bias,    /* per batch: (lq, lk) or null */           \
        const unsigned char* __restrict__ mask,   /* per batch: (lq, lk) or null */           \
        const long long* __restrict__ kv_lengths, /* (nbatch,) or null */                     \
        const CUONLINE_ACC* __restrict__ alibi,   /* (nbatch,) or null */                     \
        OutT* __restrict__ out,                   /* ([nsplit,] nbatch, lq, Dv) */            \
        CUONLINE_ACC* __restrict__ lse,           /* ([nsplit,] nbatch, lq) or null */        \
        const long long* __restrict__ offsets,    /* (nbatch, 5) */                           \
        const long long* __restrict__ strides,    /* (5, 2) */                                \
        int lq, int lk, CUONLINE_ACC scale, CUONLINE_ACC softcap,                             \
        long long window_left, long long window_right, /* >= 2^60: unbounded */              \
        long long split_keys                           /* keys per grid.z slice */

// Raw score q·k -> the score in natural units: scaled, or soft-capped
// (cap tanh(scale q·k / cap)), plus the additive bias, minus the ALiBi penalty. Natural units
// keep every finite score representable: folding log2(e) into the scale (FlashAttention's
// FFMA) overflows scores above FLT_MAX / 1.44 to inf (issue 10, item 8); log2(e) multiplies
// only s - m <= 0, where overflow gives -inf, i.e. weight 0 (SoftmaxState::weight). The
// constants are folded once per block (the ALiBi slope is the batch element's).
template <class Acc>
struct ScoreMap {
#if CUONLINE_HAS_SOFTCAP
    Acc scale_over_cap, cap;
#else
    Acc scale_;
#endif
#if CUONLINE_HAS_ALIBI
    Acc slope;
#endif

    __device__ __forceinline__ ScoreMap(Acc scale, Acc softcap, const Acc* alibi, long long b) {
#if CUONLINE_HAS_SOFTCAP
        scale_over_cap = scale / softcap;
        cap = softcap;
#else
        (void)softcap;
        scale_ = scale;
#endif
#if CUONLINE_HAS_ALIBI
        slope = alibi[b];
#else
        (void)alibi;
        (void)b;
#endif
    }
    __device__ __forceinline__ Acc scaled(Acc qk) const {
#if CUONLINE_HAS_SOFTCAP
        return cap * tanh_(qk * scale_over_cap);
#else
        return qk * scale_;
#endif
    }
    __device__ __forceinline__ Acc bias(Acc value) const { return value; }
    // the ALiBi term of query i (diagonal-aligned: key i + diag) and key j
    __device__ __forceinline__ Acc alibi(long long i_diag, long long j) const {
#if CUONLINE_HAS_ALIBI
        const long long dist = i_diag - j;
        return slope * Acc(dist < 0 ? -dist : dist);
#else
        (void)i_diag;
        (void)j;
        return Acc(0);
#endif
    }
};

// Row of (batch element b, query i) in out and lse, contiguous ([nsplit,] nbatch, lq). Derived
// from the grid where it is written, so that no register carries it through the key loop.
template <int kBlockM>
__device__ __forceinline__ long long output_row(long long b, long long i, int lq) {
#if CUONLINE_SPLIT
    const long long nbatch = gridDim.x / ((lq + kBlockM - 1) / kBlockM);
    return ((long long)blockIdx.z * nbatch + b) * lq + i;
#else
    return b * lq + i;
#endif
}

}  // namespace cuonline
