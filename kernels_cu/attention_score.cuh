// attention_score.cuh: the score pipeline of every attention family.
//
// Pasted (by cuonline/kernels/source.py, in the order cuonline/kernels/families.py lists) after
// common.cuh into each attention family's text, so that all of them answer two questions with
// one text:
//   which keys a query may see    the block's key range (key tail or kv_lengths, the causal /
//                                 window band, the split's slice), the row's band, the mask;
//   how a raw score becomes a     q·k scaled plus rel_q·rel_k[delta], or soft-capped, plus the
//   logit                         additive (or block) bias and rel_bias[delta], minus the ALiBi
//                                 penalty (or all of it soft-capped), in natural units.
// The variant's option defines become the compile-time constants below, here and nowhere else;
// kernels branch on them with `if constexpr`, so every branch is compiled (type-checked) in
// every variant and a disabled one costs nothing.
//
// To add a score term: its flag below, its constant in ScorePipeline (the constructor) and its
// line in ScorePipeline::logit; on the Python side its feature-table row
// (cuonline/kernels/features.py), its validation rule and its NumPy term.

#ifndef CUONLINE_SPLIT
#error "attention families need the CUONLINE_* variant defines (cuonline/kernels/features.py)"
#endif

namespace cuonline {

// ---------------------------------------------------------------------------------------------
// the variant's options: the defines of cuonline/kernels/features.py, each 0 or 1

constexpr bool kHasWindow = CUONLINE_HAS_WINDOW != 0;         // causal or sliding-window band
constexpr bool kHasBias = CUONLINE_HAS_BIAS != 0;             // additive (lq, lk) bias
// ... coarse: (ceil(lq / r), ceil(lk / c)), score (i, j) reads element (i / r, j / c)
constexpr bool kHasBiasBlock = CUONLINE_HAS_BIAS_BLOCK != 0;
constexpr bool kHasRelBias = CUONLINE_HAS_REL_BIAS != 0;      // Toeplitz rel_bias[delta]
constexpr bool kHasRelQk = CUONLINE_HAS_REL_QK != 0;          // rel_q[i] · rel_k[delta]
// Width of rel_q and rel_k (compile-time, like D; 1 where unused), and the row stride of their
// shared-memory copies: odd (in 4-byte words for float), so that lanes reading different rows
// at one column hit different banks.
constexpr int kDr = CUONLINE_DR > 0 ? CUONLINE_DR : 1;
constexpr int kLdRel = kDr + 1;
constexpr bool kHasMask = CUONLINE_HAS_MASK != 0;             // boolean (lq, lk) mask, True keeps
constexpr bool kHasKvLengths = CUONLINE_HAS_KV_LENGTHS != 0;  // keys per batch element
constexpr bool kHasAlibi = CUONLINE_HAS_ALIBI != 0;           // ALiBi slope per batch element
constexpr bool kHasSoftcap = CUONLINE_HAS_SOFTCAP != 0;       // cap tanh(x / cap)
// ... of the whole logit (after bias and ALiBi) instead of the content score scale q·k alone
constexpr bool kSoftcapBias = CUONLINE_SOFTCAP_BIAS != 0;
constexpr bool kCapScore = kHasSoftcap && !kSoftcapBias;
constexpr bool kCapLogit = kHasSoftcap && kSoftcapBias;
constexpr bool kReturnLse = CUONLINE_RETURN_LSE != 0;
constexpr bool kSplit = CUONLINE_SPLIT != 0;                  // keys split across grid.z
// A split writes each part's lse for the combine, whether or not the caller asked for it.
constexpr bool kWritesLse = kSplit || kReturnLse;
// A packed variable-length batch (cu_seqlens): each block runs one query tile of one sequence,
// found in a host-built table; lengths, diagonal and rows are that sequence's (local indices).
constexpr bool kVarlen = CUONLINE_VARLEN != 0;
static_assert(!(kVarlen && kSplit), "packed batches are not split across grid.z");
// Columns of a packed batch's sequence table (varlen_seqs, cuonline/kernels/varlen.py): first
// query row, query length, key length, diagonal offset, first key row.
constexpr int kSeqCols = 5;

// Operands in the per-batch offset table (offsets[b * kCount + op]) and in strides[2 op]
// (row stride), strides[2 op + 1] (column stride), in elements.
namespace operand {
// rel_bias is one row (1, Rb) per batch element.
enum : int {
    kQ = 0, kK = 1, kV = 2, kBias = 3, kMask = 4, kRelBias = 5, kRelQ = 6, kRelK = 7, kCount = 8
};
}

// The parameters of every attention forward kernel, in the order cuonline/kernels/arguments.py
// passes them (one argument tuple serves every family); OutT is the family's output element
// type (T, or Acc for the per-split partial outputs).
#define CUONLINE_ATTENTION_PARAMS(OutT)                                                        \
    const CUONLINE_T* __restrict__ q,             /* per batch: (lq, D) */                    \
        const CUONLINE_T* __restrict__ k,         /* per batch: (lk, D) */                    \
        const CUONLINE_T* __restrict__ v,         /* per batch: (lk, Dv) */                   \
        const CUONLINE_ACC* __restrict__ bias,    /* per batch: (lq, lk) or null */           \
        const unsigned char* __restrict__ mask,   /* per batch: (lq, lk) or null */           \
        const long long* __restrict__ kv_lengths, /* (nbatch,) or null */                     \
        const CUONLINE_ACC* __restrict__ alibi,   /* (nbatch,) or null */                     \
        const CUONLINE_ACC* __restrict__ rel_bias, /* per batch: (1, Rb) or null */           \
        const CUONLINE_ACC* __restrict__ rel_q,   /* per batch: (lq, Dr) or null */           \
        const CUONLINE_ACC* __restrict__ rel_k,   /* per batch: (Rk, Dr) or null */           \
        OutT* __restrict__ out,                   /* ([nsplit,] nbatch, lq, Dv) */            \
        CUONLINE_ACC* __restrict__ lse,           /* ([nsplit,] nbatch, lq) or null */        \
        const long long* __restrict__ offsets,    /* (nbatch, 8) */                           \
        const long long* __restrict__ strides,    /* (8, 2) */                                \
        int lq, int lk,                                                                       \
        long long diagonal_offset,        /* q_offset - k_offset: query i faces key i + it */ \
        CUONLINE_ACC scale, CUONLINE_ACC softcap,                                             \
        long long window_left, long long window_right, /* >= 2^60: unbounded */              \
        long long split_keys,                          /* keys per grid.z slice */           \
        int bias_block_rows, int bias_block_cols,      /* (r, c) of a block bias, else 1 */  \
        int rel_bias_radius, int rel_k_radius,         /* (Rb - 1) / 2, (Rk - 1) / 2 */  \
        const int* __restrict__ varlen_tiles,  /* packed: (n_tiles, 2) sequence, query tile */ \
        const long long* __restrict__ varlen_seqs, /* packed: (B, kSeqCols) */               \
        int varlen_n_tiles                     /* packed: rows of varlen_tiles */

// The output element type of a family whose final element type is T: a split writes partial,
// already normalised outputs into an accumulation-type workspace, merged by the combine.
template <class T, class Acc>
using AttentionOut = typename Select<kSplit, Acc, T>::type;

// ---------------------------------------------------------------------------------------------
// the block: which queries one thread block covers, and the keys that may be visible to them

struct BlockRange {
    long long b;        // flattened batch element
    long long ob;       // its row of the offset table (packed: of its sequence in b)
    int lq, lk;         // the block's problem's lengths: lq, lk, or its sequence's (packed)
    long long q_start;  // packed: its sequence's first query row (0 otherwise): query i's row
                        // in the contiguous (nbatch, lq) buffers (out, lse, ...) is
                        // b * lq + q_start + i
    long long slot;     // packed: the block's slot in per-query-tile partials, b * n_tiles + e
    long long i0;       // queries [i0, i_end) of this block
    long long i_end;
    long long diag;     // key facing query 0: q_offset - k_offset (|diag| <= 2^53)
    long long key_end;  // keys at or past this (kv_lengths or Lk) are never read
    long long j_lo;     // keys [j_lo, j_hi) may be visible to some query of the block;
    long long j_hi;     // tiles outside it are never touched
};

// grid.x = nbatch * n_query_tiles, grid.z = key splits. The heaviest causal query tiles (the
// last ones) are scheduled first.
template <int kBlockM>
__device__ __forceinline__ BlockRange block_range(int lq, int lk, long long diagonal_offset,
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
    r.ob = r.b;
    r.lq = lq;
    r.lk = lk;
    r.q_start = 0;
    r.slot = 0;     // unused: the partials' slot follows from b and the tile
    r.diag = diagonal_offset;

    r.key_end = lk;
    if constexpr (kHasKvLengths) r.key_end = kv_lengths[r.b];  // clipped to [0, lk] on the host
    r.j_lo = 0;
    r.j_hi = r.key_end;
    if constexpr (kHasWindow) {
        if (r.i0 + r.diag - window_left > r.j_lo) r.j_lo = r.i0 + r.diag - window_left;
        if (r.i_end + r.diag + window_right < r.j_hi) r.j_hi = r.i_end + r.diag + window_right;
    }
    if constexpr (kSplit) {
        const long long split = blockIdx.z;
        if (split * split_keys > r.j_lo) r.j_lo = split * split_keys;
        if ((split + 1) * split_keys < r.j_hi) r.j_hi = (split + 1) * split_keys;
    }
    return r;
}

// A packed batch: grid.x = n_tiles * nbatch, tile-major, so that the table's order (the
// heaviest tiles first, cuonline/kernels/varlen.py) is the launch order across the batch.
// Tile e is (sequence s, query tile t); the offset table has a row per (s, b), row s * nbatch
// + b, with q and rel_q moved to the sequence's first query and k and v to its first key.
template <int kBlockM>
__device__ __forceinline__ BlockRange varlen_block_range(int lq, const int* __restrict__ tiles,
                                                         const long long* __restrict__ seqs,
                                                         int n_tiles, long long window_left,
                                                         long long window_right) {
    BlockRange r;
    const long long nbatch = gridDim.x / n_tiles;
    const long long e = blockIdx.x / nbatch;
    r.b = blockIdx.x - e * nbatch;
    const long long s = tiles[2 * e];
    const long long* seq = seqs + kSeqCols * s;
    r.ob = s * nbatch + r.b;
    r.lq = int(seq[1]);
    r.lk = int(seq[2]);
    r.q_start = seq[0];
    r.slot = r.b * n_tiles + e;
    r.i0 = (long long)tiles[2 * e + 1] * kBlockM;
    r.i_end = r.i0 + kBlockM < r.lq ? r.i0 + kBlockM : r.lq;
    r.diag = seq[3];
    r.key_end = seq[2];
    r.j_lo = 0;
    r.j_hi = r.key_end;
    if constexpr (kHasWindow) {
        if (r.i0 + r.diag - window_left > r.j_lo) r.j_lo = r.i0 + r.diag - window_left;
        if (r.i_end + r.diag + window_right < r.j_hi) r.j_hi = r.i_end + r.diag + window_right;
    }
    return r;
}

// The block of a forward kernel: from the grid, or from the table of a packed batch.
template <int kBlockM>
__device__ __forceinline__ BlockRange forward_block_range(
    int lq, int lk, long long diagonal_offset, const long long* __restrict__ kv_lengths,
    long long window_left, long long window_right, long long split_keys,
    const int* __restrict__ varlen_tiles, const long long* __restrict__ varlen_seqs,
    int varlen_n_tiles) {
    if constexpr (kVarlen)
        return varlen_block_range<kBlockM>(lq, varlen_tiles, varlen_seqs, varlen_n_tiles,
                                           window_left, window_right);
    else
        return block_range<kBlockM>(lq, lk, diagonal_offset, kv_lengths, window_left,
                                    window_right, split_keys);
}

// Row of (batch element b, query i) in out and lse, contiguous ([nsplit,] nbatch, lq). Derived
// from the grid where it is written, so that no register carries it through the key loop
// (packed: the sequence's first row, from the block's table entry, plus the local i).
template <int kBlockM>
__device__ __forceinline__ long long output_row(const BlockRange& range, long long i, int lq) {
    const long long b = range.b;
    if constexpr (kVarlen) {
        return b * lq + range.q_start + i;
    } else if constexpr (kSplit) {
        const long long nbatch = gridDim.x / ((lq + kBlockM - 1) / kBlockM);
        return ((long long)blockIdx.z * nbatch + b) * lq + i;
    } else {
        return b * lq + i;
    }
}

// ---------------------------------------------------------------------------------------------
// The score pipeline of one block: raw score q·k of (query i, key j) -> the score the online
// softmax sees, its logit or -inf where j is invisible to i.
//
// Natural units keep every finite score representable: folding log2(e) into the scale
// (FlashAttention's FFMA) overflows scores above FLT_MAX / 1.44 to inf (issue 10, item 8);
// log2(e) multiplies only s - m <= 0, where overflow gives -inf, i.e. weight 0
// (SoftmaxState::weight). The constants are folded once per block (the ALiBi slope is the
// batch element's); the members of a disabled option are never read and cost no register.
template <class Acc>
class ScorePipeline {
  public:
    // Mask and bias at one place (i, j): the elements of that row are dj column strides away.
    // A block bias points at column 0 of the coarse row i / r instead: along a row its element
    // (j / c) is not linear in dj, so it is found from j. Formed for any place, dereferenced
    // only where the place is in range (inside the operand).
    struct Row {
        const unsigned char* mask;
        const Acc* bias;
    };

    // `off`: the batch element's row of the offset table (offsets + b * operand::kCount)
    // `bias_rows`, `bias_cols`: the block of a block bias; `rel_*`: the relative terms' tables
    // (per batch element through the offset table) and radii.
    __device__ __forceinline__ ScorePipeline(const BlockRange& r, int lq, long long window_left,
                                             long long window_right, Acc scale, Acc softcap,
                                             const Acc* alibi, const Acc* bias,
                                             const unsigned char* mask, const long long* off,
                                             const long long* strides, int bias_rows,
                                             int bias_cols, const Acc* rel_bias,
                                             int rel_bias_radius, const Acc* rel_q,
                                             const Acc* rel_k, int rel_k_radius)
        : lq_(lq), bias_rows_(bias_rows), bias_cols_(bias_cols), rb_(rel_bias_radius),
          rk_(rel_k_radius), key_end_(r.key_end), j_lo_(r.j_lo), j_hi_(r.j_hi), diag_(r.diag),
          window_left_(window_left), window_right_(window_right), mask_(mask),
          bias_(bias), rel_bias_(kHasRelBias ? rel_bias + off[operand::kRelBias] : rel_bias),
          rel_q_(rel_q),
          rel_k_(rel_k), off_(off),
          strides_(strides) {
        // scaled(qk) = qk * scale, or cap * tanh(qk * scale / cap); a capped logit x becomes
        // cap * tanh(x * inv_cap); the relative content rel joins the capped score as rel / cap
        scale_ = kCapScore ? scale / softcap : scale;
        cap_ = kHasSoftcap ? softcap : Acc(0);
        inv_cap_ = kHasSoftcap ? Acc(1) / softcap : Acc(0);
        slope_ = Acc(0);
        if constexpr (kHasAlibi) slope_ = alibi[r.b];
    }

    // ---- visibility

    // j lies in query i's key range: a real query, a key before the tail (Lk or kv_lengths),
    // inside the block's range (band, split) and inside i's band. The mask is `keeps`.
    __device__ __forceinline__ bool in_range(long long i, long long j) const {
        bool in = i < lq_ && j < key_end_ && j >= j_lo_ && j < j_hi_;
        if constexpr (kHasWindow)
            in = in && j >= i + diag_ - window_left_ && j <= i + diag_ + window_right_;
        return in;
    }

    // Every (i, j) of [i_first, i_last) x [j_first, j_last) is in range: one block-uniform
    // test instead of one per element. [j_lo, j_hi) lies inside [0, key_end).
    __device__ __forceinline__ bool covers(long long i_first, long long i_last, long long j_first,
                                           long long j_last) const {
        bool in = i_last <= lq_ && j_first >= j_lo_ && j_last <= j_hi_;
        if constexpr (kHasWindow)
            in = in && j_first >= i_last - 1 + diag_ - window_left_ &&
                 j_last - 1 <= i_first + diag_ + window_right_;
        return in;
    }

    // The keys [j_first, j_last) of query i (i < lq): the block's range cut to i's band.
    __device__ __forceinline__ void row_keys(long long i, long long& j_first,
                                             long long& j_last) const {
        j_first = j_lo_;
        j_last = j_hi_;
        if constexpr (kHasWindow) {
            if (i + diag_ - window_left_ > j_first) j_first = i + diag_ - window_left_;
            if (i + diag_ + window_right_ + 1 < j_last) j_last = i + diag_ + window_right_ + 1;
        }
    }

    // Mask and bias at (i, j), for a run of places along the row (the tensor-core fragments).
    __device__ __forceinline__ Row row(long long i, long long j) const {
        Row at{nullptr, nullptr};
        if constexpr (kHasMask) at.mask = mask_ + offset(operand::kMask, i, j);
        if constexpr (kHasBiasBlock) at.bias = bias_ + bias_offset(i, 0);
        else if constexpr (kHasBias) at.bias = bias_ + offset(operand::kBias, i, j);
        return at;
    }

    // The mask keeps (i, j) (always, without a mask); (i, j) in range.
    __device__ __forceinline__ bool keeps(long long i, long long j) const {
        if constexpr (kHasMask) return mask_[offset(operand::kMask, i, j)] != 0;
        else return true;
    }

    // ---- the relative terms: delta = key position - query position = j - i - diag, clamped

    // Row of a relative table of radius `radius` that (i, j) reads: radius + clip(delta).
    __device__ __forceinline__ int rel_row(long long i, long long j, int radius) const {
        return clamp_delta(j - i - diag_, radius) + radius;
    }

    // The rows [lo, lo + count) of rel_k (as rel_row gives them) that the queries
    // [i_first, i_first + m) and keys [j_first, j_first + n) of one tile read: distances are
    // monotone in j - i, so one band of at most m + n - 1 rows (fewer where clamped).
    __device__ __forceinline__ void rel_k_band(long long i_first, int m, long long j_first, int n,
                                               int& lo, int& count) const {
        lo = rel_row(i_first + m - 1, j_first, rk_);
        count = rel_row(i_first, j_first + n - 1, rk_) - lo + 1;
    }

    // Stage rel_q of queries [i0, i0 + m) into s (m, kLdRel); rows past lq are zero.
    template <int kThreads>
    __device__ __forceinline__ void stage_rel_q(Acc* s, long long i0, int m) const {
        const long long rs = strides_[2 * operand::kRelQ], cs = strides_[2 * operand::kRelQ + 1];
        const Acc* base = rel_q_ + off_[operand::kRelQ];
        for (int idx = threadIdx.x; idx < m * kDr; idx += kThreads) {
            const int r = idx / kDr, c = idx - r * kDr;
            const long long i = i0 + r;
            s[r * kLdRel + c] = i < lq_ ? base[i * rs + c * cs] : Acc(0);
        }
    }

    // Stage the rel_k band [lo, lo + count) (rel_k_band) into s (count, kLdRel).
    template <int kThreads>
    __device__ __forceinline__ void stage_rel_k(Acc* s, int lo, int count) const {
        const long long rs = strides_[2 * operand::kRelK], cs = strides_[2 * operand::kRelK + 1];
        const Acc* base = rel_k_ + off_[operand::kRelK] + lo * rs;
        for (int idx = threadIdx.x; idx < count * kDr; idx += kThreads) {
            const int r = idx / kDr, c = idx - r * kDr;
            s[r * kLdRel + c] = base[r * rs + c * cs];
        }
    }

    // rel_q[i] · rel_k[rel_row(i, j)] from the staged copies: sRq holds the queries from i0,
    // sRk the band from row lo; (i, j) in the tile the band was staged for.
    __device__ __forceinline__ Acc rel_qk(const Acc* sRq, const Acc* sRk, long long i0, int lo,
                                          long long i, long long j) const {
        const Acc* a = sRq + int(i - i0) * kLdRel;
        const Acc* b = sRk + (rel_row(i, j, rk_) - lo) * kLdRel;
        Acc dot = Acc(0);
#pragma unroll 8
        for (int d = 0; d < kDr; ++d) dot += a[d] * b[d];
        return dot;
    }

    // The same dot from global memory (i < lq): for a kernel's rare recomputed rows. The
    // tables come in again as `rel_q`, `rel_k` (the kernel's parameters, possibly opaque).
    __device__ __forceinline__ Acc rel_qk_global(long long i, long long j, const Acc* rel_q,
                                                 const Acc* rel_k) const {
        const long long* st = strides_;
        const Acc* a = rel_q + off_[operand::kRelQ] + i * st[2 * operand::kRelQ];
        const Acc* b = rel_k + off_[operand::kRelK] + rel_row(i, j, rk_) * st[2 * operand::kRelK];
        const long long ca = st[2 * operand::kRelQ + 1], cb = st[2 * operand::kRelK + 1];
        Acc dot = Acc(0);
#pragma unroll 4
        for (int d = 0; d < kDr; ++d) dot += a[d * ca] * b[d * cb];
        return dot;
    }

    // ---- the score transform

    // The logit of raw score qk at (i, j), in natural units; `rel` is rel_q[i] · rel_k[delta]
    // (0 without rel_qk). `bias_at()` reads the bias there; called only where `readable` (the
    // place is in range and kept: inside the operand).
    template <class BiasAt>
    __device__ __forceinline__ Acc logit(Acc qk, long long i, long long j, bool readable,
                                         const BiasAt& bias_at, Acc rel = Acc(0)) const {
        // content score scale q·k + rel, capped unless the whole logit is
        Acc x = qk * scale_;
        if constexpr (kHasRelQk) x += kCapScore ? rel * inv_cap_ : rel;
        if constexpr (kCapScore) x = cap_ * tanh_(x);
        if constexpr (kHasBias) {
            if (readable) x += bias_at();
        }
        if constexpr (kHasRelBias) {
            // the row is clamped into the table: read for any place
            x += rel_bias_[rel_row(i, j, rb_)];
        }
        if constexpr (kHasAlibi) {
            // |delta|, delta = key position - query position = j - (i + diag)
            const long long dist = i + diag_ - j;
            x -= slope_ * Acc(dist < 0 ? -dist : dist);
        }
        if constexpr (kCapLogit) x = cap_ * tanh_(x * inv_cap_);
        return x;
    }
    __device__ __forceinline__ Acc logit(Acc qk, long long i, long long j,
                                         Acc rel = Acc(0)) const {
        return logit(qk, i, j, true, [&] { return bias_[bias_offset(i, j)]; }, rel);
    }

    // What the softmax sees of raw score qk at (i, j): its logit, or -inf where j is invisible
    // to i. Here `at` is row(i, j - dj) and `in_range` is in_range(i, j), or true inside a tile
    // that `covers` says is in range. The two overloads are the same function written as each
    // family's code generation likes it best: the tensor-core kernel's fragments as a select
    // on `visible`, the SIMT kernel's scalar loop with an early return for a masked key
    // (docs/kernels.md, "The score pipeline" gives the measurements).
    __device__ __forceinline__ Acc score(Acc qk, long long i, long long j, bool in_range,
                                         const Row& at, int dj, Acc rel = Acc(0)) const {
        bool visible = in_range;
        if constexpr (kHasMask) {
            if (visible) visible = at.mask[dj * strides_[2 * operand::kMask + 1]] != 0;
        }
        const Acc x = logit(qk, i, j, visible, [&] {
            const long long col = kHasBiasBlock ? (long long)(int(j) / bias_cols_) : dj;
            return at.bias[col * strides_[2 * operand::kBias + 1]];
        }, rel);
        return visible ? x : neg_inf(Acc());
    }
    __device__ __forceinline__ Acc score(Acc qk, long long i, long long j,
                                         Acc rel = Acc(0)) const {
        const bool in = in_range(i, j);
        if constexpr (kHasMask) {
            if (in && mask_[offset(operand::kMask, i, j)] == 0) return neg_inf(Acc());
        }
        const Acc x = logit(qk, i, j, in, [&] { return bias_[bias_offset(i, j)]; }, rel);
        return in ? x : neg_inf(Acc());
    }

    // The same pipeline, reading the offset table and the strides through other pointers to
    // the same tables: the tensor-core kernel's slow path passes opaque copies, so that values
    // loaded before its loop are loaded again rather than held in registers through it.
    __device__ __forceinline__ ScorePipeline rebased(const long long* off,
                                                     const long long* strides) const {
        ScorePipeline p = *this;
        p.off_ = off;
        p.strides_ = strides;
        return p;
    }

  private:
    // Element (i, j) of operand op of this batch element. The offset table and the strides are
    // read where they are used (not held in members): ptxas then keeps or reloads them as it
    // likes (members for them cost registers: docs/kernels.md).
    __device__ __forceinline__ long long offset(int op, long long i, long long j) const {
        return off_[op] + i * strides_[2 * op] + j * strides_[2 * op + 1];
    }
    // The bias element of (i, j): (i / r, j / c) of a block bias. Places are below 2^31 (lq, lk
    // are int): 32-bit divisions.
    __device__ __forceinline__ long long bias_offset(long long i, long long j) const {
        if constexpr (kHasBiasBlock)
            return offset(operand::kBias, int(i) / bias_rows_, int(j) / bias_cols_);
        else return offset(operand::kBias, i, j);
    }
    // delta clipped to [-radius, radius] (radius < 2^30, so that rows up to 2 radius fit an
    // int: the host checks)
    __device__ __forceinline__ static int clamp_delta(long long delta, int radius) {
        return delta < -radius ? -radius : (delta > radius ? radius : int(delta));
    }

    int lq_;
    int bias_rows_, bias_cols_;  // the block of a block bias
    int rb_, rk_;                // radii of rel_bias and rel_k
    long long key_end_, j_lo_, j_hi_, diag_, window_left_, window_right_;
    Acc scale_;  // scale, or scale / softcap (kCapScore)
    Acc cap_;
    Acc inv_cap_;  // 1 / softcap (kCapLogit)
    Acc slope_;
    const unsigned char* mask_;  // (lq, lk) per batch element, through offsets and strides
    const Acc* bias_;
    // (Rb,): this batch element's row, unit column stride (the argument builder sees to it):
    // one pointer, rather than an offset and a stride reloaded or held per score
    const Acc* rel_bias_;
    const Acc* rel_q_;           // (lq, Dr) per batch element
    const Acc* rel_k_;           // (Rk, Dr) per batch element
    const long long* off_;       // the batch element's row of the offset table
    const long long* strides_;   // (8, 2)
};

}  // namespace cuonline
