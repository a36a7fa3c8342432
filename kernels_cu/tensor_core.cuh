// tensor_core.cuh: one small device helper per tensor-core / async-copy PTX instruction.
//
// Pasted textually after common.cuh (which brings in cuda_fp16.h / cuda_bf16.h under NVRTC and
// whose CUONLINE_FULL_MASK is used here), never reached through -I: see common.cuh for why.
//
// Every helper that stands for one PTX instruction (to_tf32, mma_*, ldmatrix, cp_async_*) is
// declared here for every compiler and defined under #ifdef __CUDA_ARCH__ only, by its inline
// PTX (NVRTC, sm_80 and later). This file is device code only: the CPU emulation
// (cuonline.testing.emulate) force-includes a header that defines the same functions, with the
// same names and signatures, before the kernel text (cuonline/testing/cuda_cpu/tensor_core.h and
// cp_async.h, which follow the fragment layouts below lane by lane). All 32 lanes must call a
// helper together (the .sync.aligned rule).
//
// Fragment conventions (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k8 / m8n8k4").
// lane = linear thread index % 32, g = lane / 4 (groupID), t = lane % 4 (threadID_in_group).
// A 32-bit register holding two 16-bit values keeps the lower column (or row, for B) in its
// low half.
//
//   mma_m16n8k16<T> (T = __half or __nv_bfloat16), D(16x8) = A(16x16) * B(16x8) + C, f32 acc
//     a[0] = A[g  ][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]
//     a[2] = A[g  ][2t+8, 2t+9]  a[3] = A[g+8][2t+8, 2t+9]
//     b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]          (B "col": k pairs)
//     c[0] = C[g][2t]  c[1] = C[g][2t+1]  c[2] = C[g+8][2t]  c[3] = C[g+8][2t+1]   (D alike)
//   mma_m16n8k8_tf32, D(16x8) = A(16x8) * B(8x8) + C, f32 acc; a, b hold tf32 bit patterns
//     (to_tf32), one element per register:
//     a[0] = A[g][t]  a[1] = A[g+8][t]  a[2] = A[g][t+4]  a[3] = A[g+8][t+4]
//     b[0] = B[t][g]  b[1] = B[t+4][g]                         c, d as for m16n8k16
//   mma_m8n8k4_f64, D(8x8) = A(8x4) * B(4x8) + C, f64 acc
//     a = A[g][t]   b = B[t][g]   c[i] = C[g][2t+i], i = 0, 1   (D alike)
//   ldmatrix_xN[_trans]: N 8x8 matrices of 16-bit elements; lane 8i+r supplies the (16-byte
//     aligned, shared-memory) address of row r of matrix i. Register i of lane (g, t) receives
//     M_i[g][2t, 2t+1], or with .trans M_i[2t][g], M_i[2t+1][g].
//     Hence, for m16n8k16: x4 with lane -> (row lane % 16, column 8 * (lane / 16)) of a
//     row-major 16x16 tile gives the A fragment; x2 with lane -> (row n0 + lane % 8, column
//     k0 + 8 * (lane / 8 % 2)) of an (n, k) row-major tile (K, for Q K^T) gives the B fragment
//     without .trans; x2 .trans with lane -> (row k0 + lane % 16, column n0) of a (k, n)
//     row-major tile (V, for P V) gives it with .trans. x4 forms load two n-tiles at once.

namespace cuonline {
namespace tc {

// ---------------------------------------------------------------------------------------------
// Register packing (pure bit manipulation)

// Two 16-bit values in one 32-bit register, `lo` in the low half (the lower column/row index).
__device__ __forceinline__ unsigned pack2(__half lo, __half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}
__device__ __forceinline__ unsigned pack2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}

// Round two floats to T (nearest even) and pack them.
template <class T> __device__ __forceinline__ unsigned pack2_rn(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2_rn<__half>(float lo, float hi) {
    return pack2(__float2half_rn(lo), __float2half_rn(hi));
}
template <> __device__ __forceinline__ unsigned pack2_rn<__nv_bfloat16>(float lo, float hi) {
    return pack2(__float2bfloat16_rn(lo), __float2bfloat16_rn(hi));
}

// The accumulators of two adjacent m16n8 tiles (columns 0-7 in c0, 8-15 in c1) rounded to T
// as the A fragment of the next m16n8k16: the C layout of two n-tiles is the A layout of one
// k-tile, so P = softmax(S) feeds P·V with no shuffle.
template <class T>
__device__ __forceinline__ void acc_to_a_frag(unsigned (&a)[4], const float (&c0)[4],
                                              const float (&c1)[4]) {
    a[0] = pack2_rn<T>(c0[0], c0[1]);
    a[1] = pack2_rn<T>(c0[2], c0[3]);
    a[2] = pack2_rn<T>(c1[0], c1[1]);
    a[3] = pack2_rn<T>(c1[2], c1[3]);
}

// ---------------------------------------------------------------------------------------------
// TF32 conversion: cvt.rna.tf32.f32, round to nearest with ties away from zero to a 10-bit
// mantissa; the result is an f32 bit pattern whose low 13 bits are zero. Finite values that
// round past FLT_MAX become inf; inf stays inf; NaN stays a NaN.

__device__ __forceinline__ unsigned to_tf32(float x);

// ---------------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, T = __half or __nv_bfloat16

template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const float (&c)[4]);

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (operands from to_tf32)
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4],
                                                 const unsigned (&b)[2], const float (&c)[4]);

// mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64
__device__ __forceinline__ void mma_m8n8k4_f64(double (&d)[2], double a, double b,
                                               const double (&c)[2]);

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16 (kNum = 1, 2 or 4)
//
// `row` is this lane's row address (generic pointer into shared memory, 16-byte aligned);
// lanes 0-7 address matrix 0, 8-15 matrix 1, 16-23 matrix 2, 24-31 matrix 3 (x1 reads only
// lanes 0-7, x2 lanes 0-15; the other lanes' addresses are ignored but must be given).
template <int kNum, bool kTrans>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[kNum], const void* row);

// cp.async.cg.shared.global (16 bytes, L2 only), commit_group, wait_group
//
// Copy 16 bytes global -> shared asynchronously; bytes [src_bytes, 16) of the destination are
// zero-filled and never read from `src` (src_bytes in [0, 16]; 0 gives a zero chunk). Both
// addresses must be 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src,
                                            int src_bytes = 16);
// Close the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit();
// Wait until at most kPending (0..7) of the committed groups are still in flight. The copied
// data is visible to this thread only; other threads of the block need a __syncthreads after it.
template <int kPending>
__device__ __forceinline__ void cp_async_wait();
// Commit the open group and wait for all copies (cp.async.wait_all). Retire every copy before
// the kernel exits: the emulation drops a thread's leftover copies when that thread index next
// uses cp.async in another block, but a later launch at the same block index would land them.
__device__ __forceinline__ void cp_async_wait_all();

#ifdef __CUDA_ARCH__
// ---------------------------------------------------------------------------------------------
// The PTX bodies

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const unsigned (&a)[4],
                                                     const unsigned (&b)[2],
                                                     const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4],
                                                            const unsigned (&a)[4],
                                                            const unsigned (&b)[2],
                                                            const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4],
                                                 const unsigned (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void mma_m8n8k4_f64(double (&d)[2], double a, double b,
                                               const double (&c)[2]) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%4, %5};"
        : "=d"(d[0]), "=d"(d[1])
        : "d"(a), "d"(b), "d"(c[0]), "d"(c[1]));
}

template <int kNum, bool kTrans>
__device__ __forceinline__ void ldmatrix(unsigned (&r)[kNum], const void* row) {
    static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
    const unsigned s = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (kNum == 1) {
        if constexpr (kTrans)
            asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                         : "=r"(r[0]) : "r"(s));
        else
            asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
                         : "=r"(r[0]) : "r"(s));
    } else if constexpr (kNum == 2) {
        if constexpr (kTrans)
            asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                         : "=r"(r[0]), "=r"(r[1]) : "r"(s));
        else
            asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                         : "=r"(r[0]), "=r"(r[1]) : "r"(s));
    } else {
        if constexpr (kTrans)
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                         : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
        else
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                         : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
    }
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(s), "l"(gmem_src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    static_assert(kPending >= 0 && kPending <= 7, "cp.async.wait_group takes 0..7");
    asm volatile("cp.async.wait_group %0;" :: "n"(kPending) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}
#endif  // __CUDA_ARCH__

// ---------------------------------------------------------------------------------------------
// ldmatrix forms

__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* row) { ldmatrix<1, false>(r, row); }
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) { ldmatrix<2, false>(r, row); }
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) { ldmatrix<4, false>(r, row); }
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* row) { ldmatrix<1, true>(r, row); }
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) { ldmatrix<2, true>(r, row); }
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { ldmatrix<4, true>(r, row); }

// ---------------------------------------------------------------------------------------------
// Swizzled shared-memory tiles (pure index math)
//
// A (rows, kCols) row-major tile of kElemBytes-byte elements, stored without padding, is cut
// into 16-byte chunks; the chunk index within a row is XORed with a function of the row so that
// the 8 rows an ldmatrix phase (or a warp's 16-byte loads) touch at one logical chunk land in 8
// different 16-byte bank groups of a 128-byte line. A chunk stays contiguous and 16-byte
// aligned, so cp_async_16 and ldmatrix rows address it whole.
//   kRowChunks = kCols * kElemBytes / 16 must be a power of two (16-bit elements: kCols in
//   8, 16, 32, 64, 128, 256). Other widths (D = 96) take PaddedRows (below); SmemTile picks.
template <int kCols, int kElemBytes>
struct Swizzle {
    static constexpr int kChunkElems = 16 / kElemBytes;
    static constexpr int kRowChunks = kCols / kChunkElems;
    static_assert(kCols % kChunkElems == 0, "a row must be whole 16-byte chunks");
    static_assert(kRowChunks > 0 && (kRowChunks & (kRowChunks - 1)) == 0,
                  "swizzled rows must hold a power-of-two number of 16-byte chunks");
    // Rows that share one 128-byte line, and the XOR mask (at most 3 bits: 8 bank groups).
    static constexpr int kRowsPerLine = kRowChunks >= 8 ? 1 : 8 / kRowChunks;
    static constexpr int kMask = (kRowChunks >= 8 ? 8 : kRowChunks) - 1;
    static constexpr int kStride = kCols;  // elements per stored row (no padding)
    // Columns one XOR pattern spans: offsets are additive in whole spans (see split_offset).
    static constexpr int kSpan = kChunkElems * (kMask + 1);
    // Rows after which the XOR pattern repeats: offset(r + kRowPeriod m, c) = offset(r, c) +
    // kRowPeriod m kStride (kRowsPerLine (kMask + 1) = 8 for every width).
    static constexpr int kRowPeriod = kRowsPerLine * (kMask + 1);

    // Physical chunk of logical chunk `chunk` in row `row`.
    __device__ __forceinline__ static int chunk(int row, int chunk) {
        return chunk ^ ((row / kRowsPerLine) & kMask);
    }
    // Element offset of logical element (row, col).
    __device__ __forceinline__ static int offset(int row, int col) {
        return row * kCols + chunk(row, col / kChunkElems) * kChunkElems + col % kChunkElems;
    }
};

// Rows padded to an odd number of 16-byte chunks: the same 8-rows-in-8-bank-groups property for
// widths the swizzle cannot take (D = 96: 12 chunks -> a 13-chunk stride). Costs the padding.
template <int kCols, int kElemBytes>
struct PaddedRows {
    static constexpr int kChunkElems = 16 / kElemBytes;
    static constexpr int kRowChunks = kCols / kChunkElems;
    static_assert(kCols % kChunkElems == 0, "a row must be whole 16-byte chunks");
    static constexpr int kStride = (kRowChunks | 1) * kChunkElems;  // elements per stored row
    static constexpr int kSpan = 1;       // offsets are additive in any column
    static constexpr int kRowPeriod = 1;  // and in any row

    __device__ __forceinline__ static int offset(int row, int col) { return row * kStride + col; }
};

namespace detail {
template <bool kFirst, class A, class B> struct Select { typedef A type; };
template <class A, class B> struct Select<false, A, B> { typedef B type; };
__host__ __device__ constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }
}  // namespace detail

// The conflict-free layout of a (rows, kCols) tile: swizzled when the row is a power-of-two
// number of chunks, else padded. Both give offset(row, col) and kStride (elements per row).
template <int kCols, int kElemBytes>
using SmemTile = typename detail::Select<detail::is_pow2(kCols * kElemBytes / 16),
                                         Swizzle<kCols, kElemBytes>,
                                         PaddedRows<kCols, kElemBytes>>::type;

// L::offset(r0 + r, c0 + c), split into a block-uniform part and a part that depends on the
// lane (r, c) and on c0 % L::kSpan only. Fragment loads pass compile-time or uniform (r0, c0)
// and lane-dependent (r, c): the lane part then takes at most kSpan / step distinct values per
// lane, which the compiler keeps in registers across key tiles instead of redoing the XOR for
// every ldmatrix. Exact when r0 % 8 == 0 (the swizzle repeats every 8 rows) and
// c0 % L::kSpan + c < L::kSpan (the XOR stays inside the span).
template <class L>
__device__ __forceinline__ int split_offset(int r0, int c0, int r, int c) {
    return r0 * L::kStride + (c0 / L::kSpan) * L::kSpan + L::offset(r, c0 % L::kSpan + c);
}

}  // namespace tc
}  // namespace cuonline
