// attention_grads.cuh: what the backward families share, one text for both.
//
// Pasted (by cuonline/kernels/source.py, in the order cuonline/kernels/families.py lists) after
// attention_score.cuh into attention_bwd_simt.cu and attention_bwd_mma.cu: their parameter list
// and the two per-place functions of the backward math (docs/algorithm.md, "The backward
// pass"), so that the SIMT and the tensor-core gradients are the same formulas.

namespace cuonline {

// P = exp(s - lse) of logit s (-inf: invisible) in a row of log-sum-exp lse; 0 for an
// invisible place and for a row that sees no key (lse = -inf), whatever the other value.
template <class Acc>
__device__ __forceinline__ Acc backward_weight(Acc s, Acc lse) {
    if (s == neg_inf(Acc()) || lse == neg_inf(Acc())) return Acc(0);
    return exp2_((s - lse) * log2e(Acc()));
}

// The dQ kernels' P, which they also sum per row (row_sums) for the host's check of lse
// (cuonline/_lse_check.py): 0 for an invisible place, whatever lse (a row that sees no key
// has only those), so that an lse of -inf on a row that sees a key gives infinite weights
// and the host refuses it. (backward_weight keeps the dK/dV kernels' registers as they were.)
template <class Acc>
__device__ __forceinline__ Acc summed_weight(Acc s, Acc lse) {
    if (s == neg_inf(Acc())) return Acc(0);
    return exp2_((s - lse) * log2e(Acc()));
}

// From P, dP and Delta at one place: g_bias, the gradient of the loss with respect to the
// place's additive bias term (dS, through the derivative of a soft cap of the whole logit),
// g_content, with respect to the content score scale q·k + rel (through the content score's
// soft cap), and the return value, with respect to the raw q·k (times the scale). s is the
// logit, qk the raw score, rel = rel_q·rel_k (0 without it). A zero weight gives exactly 0.
template <class Acc>
__device__ __forceinline__ Acc logit_grads(Acc p, Acc dp, Acc delta, Acc s, Acc qk, Acc rel,
                                           Acc scale, Acc softcap, Acc& g_bias,
                                           Acc& g_content) {
    if (p == Acc(0)) {  // invisible (s = -inf: no cap derivative to form) or no weight
        g_bias = g_content = Acc(0);
        return Acc(0);
    }
    Acc g = p * (dp - delta);
    if constexpr (kCapLogit) {
        const Acc t = s / softcap;  // s = cap tanh(z / cap): d s / d z = 1 - tanh^2
        g *= Acc(1) - t * t;
    }
    g_bias = g;
    if constexpr (kCapScore) {
        const Acc t = tanh_((qk * scale + rel) / softcap);
        g *= Acc(1) - t * t;
    }
    g_content = g;
    return g * scale;
}

// ---- the block of a dK/dV kernel: the keys [j0, j0 + kBlockR) of batch element b
//      (grid.x = nbatch * n_key_tiles), or, in a packed batch, of the key tile its entry of
//      varlen_key_tiles gives (grid.x = n_key_tiles * nbatch, tile-major, as the forward's
//      varlen_block_range), with its sequence's lengths, diagonal and first rows.
struct KeyBlock {
    long long b;       // batch element
    long long ob;      // its row of the offset table (packed: of its sequence in b)
    long long j0;      // first key of the block (local to the sequence)
    int lq, lk;        // lengths: lq, lk, or the sequence's
    long long diag;    // the key facing query 0
    // the sequence's first query and key rows (0 unpacked): query i's row in the (nbatch, lq)
    // buffers (lse, delta) is b * lq + q_start + i, key j's in the (nbatch, lk) ones (dk, dv)
    // b * lk + k_start + j (formed where used: held, the products cost registers)
    long long q_start, k_start;
};

template <int kBlockR>
__device__ __forceinline__ KeyBlock key_block(int lq, int lk, long long diagonal_offset,
                                              const int* __restrict__ key_tiles,
                                              const long long* __restrict__ seqs,
                                              int n_key_tiles) {
    KeyBlock r;
    if constexpr (kVarlen) {
        const long long nbatch = gridDim.x / n_key_tiles;
        const long long e = blockIdx.x / nbatch;
        r.b = blockIdx.x - e * nbatch;
        const long long s = key_tiles[2 * e];
        const long long* seq = seqs + kSeqCols * s;
        r.ob = s * nbatch + r.b;
        r.j0 = (long long)key_tiles[2 * e + 1] * kBlockR;
        r.lq = int(seq[1]);
        r.lk = int(seq[2]);
        r.diag = seq[3];
        r.q_start = seq[0];
        r.k_start = seq[4];
    } else {
        const long long n_ktiles = (lk + kBlockR - 1) / kBlockR;
        r.b = blockIdx.x / n_ktiles;
        r.ob = r.b;
        r.j0 = (blockIdx.x - r.b * n_ktiles) * kBlockR;
        r.lq = lq;
        r.lk = lk;
        r.diag = diagonal_offset;
        r.q_start = 0;
        r.k_start = 0;
    }
    return r;
}

// ---- the relative gradients of one tile, reduced in the kernel (no (lq, lk) workspace)
//
// The dQ kernels leave a tile's gradients in shared memory (rows: the queries [i0, i0 + kM),
// columns: the keys [j0, j0 + kN), row stride kLd, 0 outside (lq, lk)): sGb the bias-type
// ones (dS: rel_bias, block bias), sGc the content ones (dC). A block owns its query tile's
// slice of the partials, so its key tiles add into it one after another (one thread per
// element between barriers):
// a fixed order, no atomics. The host sums the query tiles' partials (drel_q needs none).

// The columns [c_lo, c_hi] of the tile where query i's distance clamps to entry e of a table of
// radius `radius` (delta = j - i - diag; the end entries take every delta beyond the radius).
template <int kN>
__device__ __forceinline__ void clamped_columns(long long i, long long j0, long long diag,
                                                int radius, int e, int& c_lo, int& c_hi) {
    const long long first = j0 - i - diag;                  // delta of column 0
    const long long far = 1LL << 62;
    long long lo = (e == 0 ? -far : e - radius) - first;
    long long hi = (e == 2 * radius ? far : e - radius) - first;
    lo = lo < 0 ? 0 : (lo > kN ? kN : lo);
    hi = hi > kN - 1 ? kN - 1 : (hi < -1 ? -1 : hi);
    c_lo = int(lo);
    c_hi = int(hi);
}

// part (2 radius + 1) += the tile's dS summed per clamped distance (rel_bias's gradient):
// each entry by one thread, rows then columns in order.
template <int kM, int kN, int kLd, int kThreads, class Acc>
__device__ __forceinline__ void rel_bias_partials(const Acc* sGb, const ScorePipeline<Acc>& pipe,
                                                  long long i0, long long j0, long long diag,
                                                  int radius, Acc* part) {
    const int e_lo = pipe.rel_row(i0 + kM - 1, j0, radius);
    const int e_hi = pipe.rel_row(i0, j0 + kN - 1, radius);
    for (int e = e_lo + int(threadIdx.x); e <= e_hi; e += kThreads) {
        Acc sum = Acc(0);
        for (int r = 0; r < kM; ++r) {
            int c_lo, c_hi;
            clamped_columns<kN>(i0 + r, j0, diag, radius, e, c_lo, c_hi);
            for (int c = c_lo; c <= c_hi; ++c) sum += sGb[r * kLd + c];
        }
        part[e] += sum;
    }
}

// How many slots of partials a block bias of `rows` rows per block needs so that two query
// tiles of kM rows sharing a slot never share a block row (tile t writes slot t % slots): one
// where the blocks tile the query tiles, else one more than the tiles a block row may span.
template <int kM>
__host__ __device__ __forceinline__ int block_bias_slots(int rows, int n_tiles) {
    const int slots = (rows <= kM && kM % rows == 0) ? 1 : (rows - 1) / kM + 2;
    return slots < n_tiles ? slots : n_tiles;
}

// part (ceil(lq / r), ceil(lk / c)), this block's slot, += the tile's dS summed over each
// (r, c) block it meets (a block bias's gradient): each block by one thread, in row order.
template <int kM, int kN, int kLd, int kThreads, class Acc>
__device__ __forceinline__ void block_bias_partials(const Acc* sGb, int lq, int lk, long long i0,
                                                    long long j0, int r, int c, Acc* part) {
    const long long i_end = i0 + kM < lq ? i0 + kM : lq;
    const long long j_end = j0 + kN < lk ? j0 + kN : lk;
    if (i0 >= i_end || j0 >= j_end) return;
    const long long row0 = i0 / r, col0 = j0 / c;
    const int n_rows = int((i_end - 1) / r - row0 + 1), n_cols = int((j_end - 1) / c - col0 + 1);
    const long long cols = (lk + (long long)c - 1) / c;   // the gradient's row length
    for (int idx = threadIdx.x; idx < n_rows * n_cols; idx += kThreads) {
        const long long br = row0 + idx / n_cols, bc = col0 + idx % n_cols;
        const long long r_lo = br * r > i0 ? br * r : i0;
        const long long r_hi = (br + 1) * r < i_end ? (br + 1) * r : i_end;
        const long long c_lo = bc * c > j0 ? bc * c : j0;
        const long long c_hi = (bc + 1) * c < j_end ? (bc + 1) * c : j_end;
        Acc sum = Acc(0);
        for (int rr = int(r_lo - i0); rr < int(r_hi - i0); ++rr)
            for (int cc = int(c_lo - j0); cc < int(c_hi - j0); ++cc) sum += sGb[rr * kLd + cc];
        part[br * cols + bc] += sum;
    }
}

// The rel_q / rel_k gradients of the tile from its dC (sGc) and the staged sRq (the block's
// rel_q rows from i0) and sRk (the band of rel_k from row band_lo): drel_q (the block's rows
// from i0, (kM, kDr) at row stride kDr) += dC rel_k[row], part_k (2, kDr) += dC rel_q[i] at
// the clamped distances, rel_k's end rows 0 and 2 radius (one row where the radius is 0);
// the exact distances between are rel_k_rows's. A zero gradient adds exactly 0 (a table row
// no visible place uses may hold NaN or inf).
template <int kM, int kN, int kLd, int kThreads, class Acc>
__device__ __forceinline__ void rel_qk_partials(const Acc* sGc, const Acc* sRq, const Acc* sRk,
                                                const ScorePipeline<Acc>& pipe, int lq,
                                                long long i0, long long j0, long long diag,
                                                int radius, int band_lo, int band_count,
                                                Acc* drel_q, Acc* part_k) {
    for (int idx = threadIdx.x; idx < kM * kDr; idx += kThreads) {
        const int r = idx / kDr, d = idx - r * kDr;
        if (i0 + r >= lq) continue;
        Acc sum = Acc(0);
        for (int c = 0; c < kN; ++c) {
            const Acc g = sGc[r * kLd + c];
            if (g != Acc(0))
                sum += g * sRk[(pipe.rel_row(i0 + r, j0 + c, radius) - band_lo) * kLdRel + d];
        }
        drel_q[r * kDr + d] += sum;
    }
    for (int idx = threadIdx.x; idx < 2 * kDr; idx += kThreads) {
        const int end = idx / kDr, d = idx % kDr;
        const int e = end * 2 * radius;
        if ((end == 1 && radius == 0) || e < band_lo || e >= band_lo + band_count) continue;
        // each row's dC summed first, then times its rel_q: two short sums, not one of up to
        // kM * kN terms (whose rounding grew past a naive float32 computation's)
        Acc sum = Acc(0);
        for (int r = 0; r < kM; ++r) {
            int c_lo, c_hi;
            clamped_columns<kN>(i0 + r, j0, diag, radius, e, c_lo, c_hi);
            Acc row = Acc(0);
            for (int c = c_lo; c <= c_hi; ++c) row += sGc[r * kLd + c];
            if (row != Acc(0)) sum += row * sRq[r * kLdRel + d];
        }
        part_k[end * kDr + d] += sum;
    }
}

// Every in-kernel reduction of the dQ kernel's tile (query tile i0 / kM of batch element b,
// keys from j0), after the barrier that publishes sGb and sGc: a block bias's into its slot of
// ds, rel_bias's into the tile's partials, rel_q's into its rows, rel_k's end rows into the
// tile's partials (the rel_k band of the tile staged in sRk). lq, lk, diag: the block's
// problem's (a packed batch: its sequence's); q_row0: the row of its query 0 in the
// (nbatch, lq) buffers; slot: a packed batch's slot for the block in the per-query-tile
// partials (one per entry of its table, BlockRange::slot).
template <int kM, int kN, int kLd, int kThreads, class Acc>
__device__ __forceinline__ void tile_partials(
    const Acc* sGb, const Acc* sGc, const Acc* sRq, const Acc* sRk,
    const ScorePipeline<Acc>& pipe, long long b, long long i0, long long j0, int lq, int lk,
    long long diag, int bias_rows, int bias_cols, int rel_bias_radius, int rel_k_radius,
    Acc* ds, Acc* drel_bias, Acc* drel_q, Acc* drel_k, long long q_row0, long long slot) {
    const int n_tiles = int((lq + (long long)kM - 1) / kM);
    const long long tile = kVarlen ? slot : b * n_tiles + i0 / kM;
    if constexpr (kHasBiasBlock) {
        const int slots = block_bias_slots<kM>(bias_rows, n_tiles);
        const long long grad = ((lq + (long long)bias_rows - 1) / bias_rows) *
                               ((lk + (long long)bias_cols - 1) / bias_cols);
        block_bias_partials<kM, kN, kLd, kThreads>(sGb, lq, lk, i0, j0, bias_rows, bias_cols,
                                                   ds + (b * slots + (i0 / kM) % slots) * grad);
    }
    if constexpr (kHasRelBias)
        rel_bias_partials<kM, kN, kLd, kThreads>(sGb, pipe, i0, j0, diag, rel_bias_radius,
                                                 drel_bias + tile * (2 * rel_bias_radius + 1));
    if constexpr (kHasRelQk) {
        int band_lo, band_count;
        pipe.rel_k_band(i0, kM, j0, kN, band_lo, band_count);
        rel_qk_partials<kM, kN, kLd, kThreads>(sGc, sRq, sRk, pipe, lq, i0, j0, diag,
                                               rel_k_radius, band_lo, band_count,
                                               drel_q + (q_row0 + i0) * kDr,
                                               drel_k + tile * 2 * kDr);
    }
}

}  // namespace cuonline

// The parameters of every backward kernel, in the order cuonline/kernels/arguments.py passes
// them (ATTENTION_BWD_SIGNATURE).
#define CUONLINE_ATTENTION_BWD_PARAMS                                                          \
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
        const CUONLINE_T* __restrict__ dout,      /* per batch: (lq, Dv) */                   \
        const CUONLINE_ACC* __restrict__ lse,     /* (nbatch, lq) */                          \
        const CUONLINE_ACC* __restrict__ delta,   /* (nbatch, lq) */                          \
        CUONLINE_ACC* __restrict__ dq,            /* (nbatch, lq, D) */                       \
        CUONLINE_ACC* __restrict__ dk,            /* (nbatch, lk, D) */                       \
        CUONLINE_ACC* __restrict__ dv,            /* (nbatch, lk, Dv) */                      \
        CUONLINE_ACC* __restrict__ ds,            /* (nbatch, lq, lk): a bias's dS, added; a \
                                                     block bias's (nbatch, slots, ceil(lq / r),     \
                                                     ceil(lk / c)) partials; or null */       \
        CUONLINE_ACC* __restrict__ drel_bias,     /* (nbatch, n_qtiles, Rb) or null */        \
        CUONLINE_ACC* __restrict__ drel_q,        /* (nbatch, lq, Dr) or null */              \
        CUONLINE_ACC* __restrict__ drel_k,        /* dQ: (nbatch, n_qtiles, 2, Dr), rel_k:   \
                                                     (nbatch, Rk, Dr); or null */             \
        CUONLINE_ACC* __restrict__ row_sums,      /* (nbatch, lq): each row's sum of P */     \
        const long long* __restrict__ offsets,    /* (nbatch, kCount + 1) */                  \
        const long long* __restrict__ strides,    /* (kCount + 1, 2) */                       \
        int lq, int lk, long long diagonal_offset, CUONLINE_ACC scale, CUONLINE_ACC softcap,  \
        long long window_left, long long window_right, /* >= 2^60: unbounded */              \
        int bias_block_rows, int bias_block_cols,      /* (r, c) of a block bias, else 1 */  \
        int rel_bias_radius, int rel_k_radius, /* (Rb - 1) / 2, (Rk - 1) / 2 */              \
        const int* __restrict__ varlen_tiles,     /* packed: (n, 2) sequence, query tile */   \
        const int* __restrict__ varlen_key_tiles, /* packed: (n_k, 2) sequence, key tile */   \
        const long long* __restrict__ varlen_seqs, /* packed: (B, kSeqCols) */               \
        int varlen_n_tiles, int varlen_n_key_tiles /* packed: rows of the two tables */

namespace cuonline {

// ---- rel_k's gradient at the exact distances: a third launch, one warp per table row
//
// Row e of drel_k (0 < e < 2 radius: delta = e - radius exactly) sums dC(i, i + diag + delta)
// rel_q[i] over the query rows: one place per row, on one diagonal. A warp owns a row and walks
// its diagonal in query order (lanes split each dot product, a fixed butterfly sums it),
// recomputing P, dP and dC there: the extra memory is the gradient's own (nbatch, Rk, Dr), not
// one partial per query tile. Rows 0 and 2 radius (every delta beyond the radius) are the dQ
// kernel's (tile_partials). No shared memory and no block barrier: a warp past the table exits.
constexpr int kRelkWarps = 4;  // cuonline/kernels/heuristics.py REL_K_THREADS = 32 kRelkWarps

// One diagonal of rel_k's row e (distance dist) over the queries of one batch element or, in
// a packed batch, of one sequence: acc (the lane's columns of Dr) += dC(i, i + diag + dist)
// rel_q[i] for its queries i in order. ob: the row of the offset table; lq, lk, diag: the
// element's or the sequence's; row0: the row of its query 0 in lse and delta.
template <class T, class Acc, int kD, int kDv, int kCols>
__device__ __forceinline__ void rel_k_diagonal(
    Acc (&acc)[kCols], const T* q, const T* k, const T* v, const Acc* bias,
    const unsigned char* mask, const Acc* alibi, const Acc* rel_bias, const Acc* rel_q,
    const Acc* rel_k, const T* dout, const Acc* lse, const Acc* delta,
    const long long* offsets, const long long* strides, long long b, long long ob, int lq,
    int lk, long long key_end, long long diag, long long row0, long long e, Acc scale,
    Acc softcap,
    long long window_left, long long window_right, int bias_rows, int bias_cols,
    int rel_bias_radius, int radius) {
    const int lane = threadIdx.x % 32;
    const long long dist = e - radius;
    BlockRange range;
    range.b = b;
    range.ob = ob;
    range.lq = lq;
    range.lk = lk;
    range.q_start = 0;
    range.slot = 0;
    range.i0 = 0;
    range.i_end = lq;
    range.diag = diag;
    range.key_end = key_end;
    range.j_lo = 0;
    range.j_hi = key_end;
    const long long* off = offsets + ob * (operand::kCount + 1);
    const ScorePipeline<Acc> pipe(range, lq, window_left, window_right, scale, softcap, alibi,
                                  bias, mask, off, strides, bias_rows, bias_cols, rel_bias,
                                  rel_bias_radius, rel_q, rel_k, radius);
    const long long* st = strides;
    const T* q_b = q + off[operand::kQ];
    const T* k_b = k + off[operand::kK];
    const T* v_b = v + off[operand::kV];
    const T* do_b = dout + off[operand::kCount];
    const Acc* rq_b = rel_q + off[operand::kRelQ];
    const Acc* rk_e = rel_k + off[operand::kRelK] + e * st[2 * operand::kRelK];
    const long long rq_rs = st[2 * operand::kRelQ], rq_cs = st[2 * operand::kRelQ + 1];
    const long long rk_cs = st[2 * operand::kRelK + 1];
    // the queries whose key i + diag + dist lies in [0, key_end), in order
    const long long first = -diag - dist > 0 ? -diag - dist : 0;
    const long long last = key_end - diag - dist < lq ? key_end - diag - dist : lq;
    for (long long i = first; i < last; ++i) {
        const long long j = i + diag + dist;
        if (!pipe.in_range(i, j)) continue;          // warp-uniform
        // q·k, dO·v and rel_q[i]·rel_k[e], each lane a strided share, then summed
        Acc qk = Acc(0), dp = Acc(0), rel = Acc(0);
        for (int c = lane; c < kD; c += 32)
            qk += to_acc(q_b[i * st[2 * operand::kQ] + c * st[2 * operand::kQ + 1]]) *
                  to_acc(k_b[j * st[2 * operand::kK] + c * st[2 * operand::kK + 1]]);
        for (int c = lane; c < kDv; c += 32)
            dp += to_acc(do_b[i * st[2 * operand::kCount] + c * st[2 * operand::kCount + 1]]) *
                  to_acc(v_b[j * st[2 * operand::kV] + c * st[2 * operand::kV + 1]]);
        for (int c = lane; c < kDr; c += 32) rel += rq_b[i * rq_rs + c * rq_cs] * rk_e[c * rk_cs];
        qk = warp_sum(qk);
        dp = warp_sum(dp);
        rel = warp_sum(rel);
        const Acc x = pipe.score(qk, i, j, rel);
        const Acc p = backward_weight(x, lse[row0 + i]);
        Acc g_bias, g_content;
        logit_grads(p, dp, delta[row0 + i], x, qk, rel, scale, softcap, g_bias, g_content);
        if (g_content != Acc(0)) {
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const int d = lane + 32 * c;
                if (d < kDr) acc[c] += g_content * rq_b[i * rq_rs + d * rq_cs];
            }
        }
    }
}

template <class T, class Acc, int kD, int kDv>
__device__ __forceinline__ void rel_k_rows(
    const T* q, const T* k, const T* v, const Acc* bias, const unsigned char* mask,
    const long long* kv_lengths, const Acc* alibi, const Acc* rel_bias, const Acc* rel_q,
    const Acc* rel_k, const T* dout, const Acc* lse, const Acc* delta, Acc* drel_k,
    const long long* offsets, const long long* strides, int lq, int lk, long long diag,
    Acc scale, Acc softcap, long long window_left, long long window_right, int bias_rows,
    int bias_cols, int rel_bias_radius, int radius, const int* varlen_tiles,
    const long long* varlen_seqs, int varlen_n_tiles) {
    if constexpr (kHasRelQk) {
        constexpr int kCols = (kDr + 31) / 32;           // columns of Dr per lane
        const int lane = threadIdx.x % 32;
        const long long rows = 2LL * radius - 1;         // the table rows 1 .. 2 radius - 1
        const long long per_batch = (rows + kRelkWarps - 1) / kRelkWarps;
        const long long b = blockIdx.x / per_batch;
        const long long e = 1 + (blockIdx.x - b * per_batch) * kRelkWarps + threadIdx.x / 32;
        if (e > rows) return;

        Acc acc[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[c] = Acc(0);
        if constexpr (kVarlen) {
            // every sequence with queries once (its first query tile's entry of the dQ table),
            // in the table's fixed order; its offset-table row as varlen_block_range's
            const long long nbatch = gridDim.x / per_batch;
            for (int t = 0; t < varlen_n_tiles; ++t) {
                if (varlen_tiles[2 * t + 1] != 0) continue;
                const long long s = varlen_tiles[2 * t];
                const long long* seq = varlen_seqs + kSeqCols * s;
                rel_k_diagonal<T, Acc, kD, kDv, kCols>(
                    acc, q, k, v, bias, mask, alibi, rel_bias, rel_q, rel_k, dout, lse, delta,
                    offsets, strides, b, s * nbatch + b, int(seq[1]), int(seq[2]), seq[2],
                    seq[3], b * lq + seq[0], e, scale, softcap, window_left, window_right,
                    bias_rows, bias_cols, rel_bias_radius, radius);
            }
        } else {
            long long key_end = lk;
            if constexpr (kHasKvLengths) key_end = kv_lengths[b];  // clipped to [0, lk]
            rel_k_diagonal<T, Acc, kD, kDv, kCols>(
                acc, q, k, v, bias, mask, alibi, rel_bias, rel_q, rel_k, dout, lse, delta,
                offsets, strides, b, b, lq, lk, key_end, diag, b * lq, e, scale, softcap,
                window_left, window_right, bias_rows, bias_cols, rel_bias_radius, radius);
        }
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
            const int d = lane + 32 * c;
            if (d < kDr) drel_k[(b * (2LL * radius + 1) + e) * kDr + d] = acc[c];
        }
    }
}

}  // namespace cuonline

// The body of a backward family's rel_k kernel (rel_k_rows; empty without rel_qk), on its
// parameters (CUONLINE_ATTENTION_BWD_PARAMS).
#define CUONLINE_ATTENTION_BWD_REL_K_BODY                                                      \
    cuonline::rel_k_rows<CUONLINE_T, CUONLINE_ACC, CUONLINE_D, CUONLINE_DV>(                   \
        q, k, v, bias, mask, kv_lengths, alibi, rel_bias, rel_q, rel_k, dout, lse, delta,      \
        drel_k, offsets, strides, lq, lk, diagonal_offset, scale, softcap, window_left,        \
        window_right, bias_block_rows, bias_block_cols, rel_bias_radius, rel_k_radius,         \
        varlen_tiles, varlen_seqs, varlen_n_tiles)
