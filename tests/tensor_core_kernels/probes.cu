// Small probes of single helpers (tests/test_tensor_core.py): ldmatrix's lane <-> element map,
// to_tf32's rounding, the swizzle's offsets, cp.async's zero-fill and group semantics.

namespace tcp {
using namespace cuonline::tc;

// The probe's shared tile: 32 rows of 8 16-bit values (16 bytes each).
template <int kNum, bool kTrans>
__device__ __forceinline__ void probe(const unsigned short* sm, const int* rows, unsigned* out) {
    unsigned r[kNum];
    ldmatrix<kNum, kTrans>(r, sm + 8 * rows[threadIdx.x]);
    for (int i = 0; i < kNum; ++i) out[threadIdx.x * 4 + i] = r[i];
}
}  // namespace tcp

// src: (32, 8) 16-bit values; rows[lane]: the tile row whose address lane supplies;
// out: (6, 32, 4) registers of x1, x2, x4, x1.trans, x2.trans, x4.trans (unused slots untouched).
extern "C" __global__ void tc_ldmatrix_probe(const unsigned short* src, const int* rows,
                                             unsigned* out) {
    __shared__ __align__(16) unsigned short sm[32 * 8];
    for (int i = threadIdx.x; i < 32 * 8; i += 32) sm[i] = src[i];
    __syncthreads();
    tcp::probe<1, false>(sm, rows, out + 0 * 128);
    tcp::probe<2, false>(sm, rows, out + 1 * 128);
    tcp::probe<4, false>(sm, rows, out + 2 * 128);
    tcp::probe<1, true>(sm, rows, out + 3 * 128);
    tcp::probe<2, true>(sm, rows, out + 4 * 128);
    tcp::probe<4, true>(sm, rows, out + 5 * 128);
}

extern "C" __global__ void tc_to_tf32(const float* x, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = cuonline::tc::to_tf32(x[i]);
}

// out[(c * 16 + row) * 256 + col] = L::offset(row, col) for 16 rows of each layout c (columns
// past its width untouched), stride[c] = L::kStride and period[c] = L::kRowPeriod, for the
// layouts listed in the test;
// split[...] the same offset through split_offset, cut where the kernels cut it (a row block
// of 8, a column block of 8 elements, the rest lane-dependent).
template <class L, int kCols>
__device__ __forceinline__ void layout_probe(int* out, int* split, int* stride, int* period,
                                             int c) {
    for (int i = threadIdx.x; i < 16 * kCols; i += blockDim.x) {
        const int row = i / kCols, col = i % kCols, at = c * 4096 + row * 256 + col;
        out[at] = L::offset(row, col);
        split[at] = cuonline::tc::split_offset<L>(row - row % 8, col - col % 8, row % 8, col % 8);
    }
    if (threadIdx.x == 0) {
        stride[c] = L::kStride;
        period[c] = L::kRowPeriod;
    }
}

extern "C" __global__ void tc_swizzle_offsets(int* out, int* split, int* stride, int* period) {
    using cuonline::tc::SmemTile;
    using cuonline::tc::Swizzle;
    layout_probe<Swizzle<8, 2>, 8>(out, split, stride, period, 0);
    layout_probe<Swizzle<16, 2>, 16>(out, split, stride, period, 1);
    layout_probe<Swizzle<32, 2>, 32>(out, split, stride, period, 2);
    layout_probe<Swizzle<64, 2>, 64>(out, split, stride, period, 3);
    layout_probe<Swizzle<128, 2>, 128>(out, split, stride, period, 4);
    layout_probe<Swizzle<256, 2>, 256>(out, split, stride, period, 5);
    layout_probe<Swizzle<32, 4>, 32>(out, split, stride, period, 6);
    layout_probe<Swizzle<16, 8>, 16>(out, split, stride, period, 7);
    layout_probe<SmemTile<96, 2>, 96>(out, split, stride, period, 8);   // padded: 12 chunks -> stride 13
    layout_probe<SmemTile<40, 2>, 40>(out, split, stride, period, 9);   // padded: 5 chunks, already odd
    layout_probe<SmemTile<24, 4>, 24>(out, split, stride, period, 10);  // padded: 6 chunks -> stride 7
    layout_probe<SmemTile<64, 2>, 64>(out, split, stride, period, 11);  // a power of two: the swizzle
}

// Lane l copies 16 bytes from src + 16 l with src-size l % 17 into shared memory; out gets the
// shared bytes after cp_async_wait_all and a barrier.
extern "C" __global__ void tc_cp_async_zfill(const unsigned char* src, unsigned char* out) {
    __shared__ __align__(16) unsigned char sm[32 * 16];
    const int l = threadIdx.x;
    cuonline::tc::cp_async_16(sm + 16 * l, src + 16 * l, l % 17);
    cuonline::tc::cp_async_wait_all();
    __syncthreads();
    for (int i = 0; i < 16; ++i) out[16 * l + i] = sm[16 * l + i];
}

// Two groups (stage 0: src[0:128], stage 1: src[128:256]); after wait_group 1 and a barrier
// stage 0 is complete and is written to out[0:128]. `read_early`: stage 1 is also read then,
// before its wait (a race on the GPU; NaN under the emulation); otherwise after wait_group 0.
extern "C" __global__ void tc_cp_async_groups(const float* src, float* out, int read_early) {
    __shared__ __align__(16) float s0[128];
    __shared__ __align__(16) float s1[128];
    const int l = threadIdx.x;
    cuonline::tc::cp_async_16(s0 + 4 * l, src + 4 * l);
    cuonline::tc::cp_async_commit();
    cuonline::tc::cp_async_16(s1 + 4 * l, src + 128 + 4 * l);
    cuonline::tc::cp_async_commit();
    cuonline::tc::cp_async_wait<1>();
    __syncthreads();
    for (int i = l; i < 128; i += 32) out[i] = s0[i];
    if (!read_early) {
        cuonline::tc::cp_async_wait<0>();
        __syncthreads();
    }
    for (int i = l; i < 128; i += 32) out[128 + i] = s1[i];
    __syncthreads();                    // every lane has read s1 before any copy lands
    cuonline::tc::cp_async_wait<0>();  // leave no copy in flight (see cp_async_wait_all)
}

// Row addresses 2 bytes past 16-byte alignment: a fault on the GPU, a __trap in the emulation.
extern "C" __global__ void tc_ldmatrix_misaligned(unsigned* out) {
    __shared__ __align__(16) unsigned short sm[32 * 8 + 8];
    for (int i = threadIdx.x; i < 32 * 8 + 8; i += 32) sm[i] = (unsigned short)i;
    __syncthreads();
    unsigned r[1];
    cuonline::tc::ldmatrix_x1(r, sm + 8 * threadIdx.x + 1);
    out[threadIdx.x] = r[0];
}
