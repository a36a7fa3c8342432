// attention_combine.cuh: the split-key combine, shared by the attention families.
//
// Pasted (by cuonline/kernels/source.py) after common.cuh into the source of every attention
// family that splits keys across grid.z (attention_fwd_simt.cu, attention_fwd_mma.cu); it reads only the
// variant defines CUONLINE_T, CUONLINE_ACC and CUONLINE_DV, so both families compile the same
// text and the same math.
//
// One warp per (batch, query) row, lane owns columns lane + 32 c. ws_out: (nsplit, nrows, Dv),
// ws_lse: (nsplit, nrows) in Acc; out: (nrows, Dv) in T; lse: (nrows,) or null. Same math as
// cuonline.merge: m = max lse_i, w_i = exp(lse_i - m), out = sum w_i out_i / sum w_i,
// lse = m + log sum w_i; all parts empty gives 0 and -inf.

namespace cuonline {
namespace combine {

typedef CUONLINE_T T;
typedef CUONLINE_ACC Acc;
constexpr int kDv = CUONLINE_DV;
constexpr int kCols = (kDv + 31) / 32;  // output columns per lane
constexpr int kWarps = 4;               // COMBINE_WARPS in cuonline/engines/cuda.py

}  // namespace combine
}  // namespace cuonline

extern "C" __global__ void __launch_bounds__(32 * cuonline::combine::kWarps)
cuonline_attention_combine(const CUONLINE_ACC* __restrict__ ws_out,
                           const CUONLINE_ACC* __restrict__ ws_lse,
                           CUONLINE_T* __restrict__ out, CUONLINE_ACC* __restrict__ lse,
                           long long nrows, int nsplit)
{
    using namespace cuonline;
    using namespace cuonline::combine;

    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * kWarps + threadIdx.x / 32;
    if (row >= nrows) return;  // whole warps leave together: no shuffles below

    SoftmaxState<Acc, kCols> state;
    state.init();
    for (int z = 0; z < nsplit; ++z) {
        const long long part = z * nrows + row;
        Acc part_out[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
            const int col = lane + 32 * c;
            part_out[c] = col < kDv ? ws_out[part * kDv + col] : Acc(0);
        }
        state.merge(ws_lse[part], part_out);
    }
    const Acc row_lse = state.finalize(state.l);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
        const int col = lane + 32 * c;
        if (col < kDv) out[row * kDv + col] = FromAcc<T>::cvt(state.o[c]);
    }
    if (lse != nullptr && lane == 0) lse[row] = row_lse;
}
