// One-warp GEMM tiles on mma.m16n8k16 (tests/test_tensor_core.py).
//
// D(16, 32) = A(16, 64) · B(64, 32) in float32 from float16 / bfloat16 inputs, in 4 k-steps:
// A and B go global -> shared through cp_async_16 into swizzled tiles, then shared -> registers
// through ldmatrix, as the attention kernel will do. B is given either as (N, K) row-major ("nk":
// the K operand of Q·K^T, ldmatrix without .trans) or as (K, N) row-major ("kn": the V operand
// of P·V, ldmatrix .trans). Columns k >= k_valid of A are zero-filled by cp.async's src-size.

namespace tcg {

using namespace cuonline::tc;

constexpr int kM = 16, kN = 32, kK = 64;

// Stage a (rows, cols) row-major global matrix into a swizzled shared tile, 16 bytes per copy;
// columns >= col_valid are zero-filled (never read).
template <class T, int kRows, int kCols>
__device__ __forceinline__ void stage(T* s, const T* g, int col_valid) {
    typedef Swizzle<kCols, sizeof(T)> Sw;
    constexpr int kChunks = kRows * Sw::kRowChunks;
    for (int c = threadIdx.x; c < kChunks; c += 32) {
        const int row = c / Sw::kRowChunks, col = (c % Sw::kRowChunks) * Sw::kChunkElems;
        int bytes = (col_valid - col) * int(sizeof(T));
        bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
        cp_async_16(s + Sw::offset(row, col), g + row * kCols + col, bytes);
    }
}

template <class T, bool kBIsKN>
__device__ __forceinline__ void gemm16(const T* a, const T* b, float* d, int k_valid) {
    typedef Swizzle<kK, sizeof(T)> SwA;                       // sA: (kM, kK)
    typedef Swizzle<kBIsKN ? kN : kK, sizeof(T)> SwB;         // sB: (kK, kN) or (kN, kK)
    __shared__ __align__(16) T sA[kM * kK];
    __shared__ __align__(16) T sB[kN * kK];
    const int lane = threadIdx.x;

    stage<T, kM, kK>(sA, a, k_valid);
    cp_async_commit();
    if constexpr (kBIsKN)
        stage<T, kK, kN>(sB, b, kN);
    else
        stage<T, kN, kK>(sB, b, kK);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float acc[kN / 8][4];
    for (int nb = 0; nb < kN / 8; ++nb)
        for (int i = 0; i < 4; ++i) acc[nb][i] = 0.0f;

    for (int ks = 0; ks < kK / 16; ++ks) {
        // A fragment: lane supplies row (lane % 16), columns 8 * (lane / 16) of the k-step.
        unsigned af[4];
        ldmatrix_x4(af, sA + SwA::offset(lane % 16, ks * 16 + (lane / 16) * 8));
        for (int nb = 0; nb < kN / 8; nb += 2) {
            // B fragments of n-tiles nb and nb+1 in one x4: registers {b0, b1} of nb, then nb+1.
            unsigned bf[4];
            if constexpr (kBIsKN) {
                // rows k = ks*16 + (lane % 16), columns n = 8 * (nb + lane / 16)
                ldmatrix_x4_trans(bf, sB + SwB::offset(ks * 16 + lane % 16, (nb + lane / 16) * 8));
            } else {
                // rows n = 8 * (nb + lane / 16) + lane % 8, columns k = ks*16 + 8 * ((lane / 8) % 2)
                ldmatrix_x4(bf, sB + SwB::offset((nb + lane / 16) * 8 + lane % 8,
                                                 ks * 16 + ((lane / 8) % 2) * 8));
            }
            const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
            mma_m16n8k16<T>(acc[nb], af, b0, acc[nb]);
            mma_m16n8k16<T>(acc[nb + 1], af, b1, acc[nb + 1]);
        }
    }

    // D fragment: c[0] = D[g][2t], c[1] = D[g][2t+1], c[2] = D[g+8][2t], c[3] = D[g+8][2t+1]
    const int g = lane / 4, t = lane % 4;
    for (int nb = 0; nb < kN / 8; ++nb) {
        d[g * kN + nb * 8 + 2 * t] = acc[nb][0];
        d[g * kN + nb * 8 + 2 * t + 1] = acc[nb][1];
        d[(g + 8) * kN + nb * 8 + 2 * t] = acc[nb][2];
        d[(g + 8) * kN + nb * 8 + 2 * t + 1] = acc[nb][3];
    }
}

// O(16, 32) = round_T(Q(16, 64) · K(16, 64)^T) · V(16, 32): the score accumulators of two
// n-tiles become the A fragment of the second product through acc_to_a_frag, as P·V will.
template <class T>
__device__ __forceinline__ void chain(const T* q, const T* k, const T* v, float* o) {
    constexpr int kKeys = 16, kDv = 32;
    typedef Swizzle<kK, sizeof(T)> SwQK;
    typedef Swizzle<kDv, sizeof(T)> SwV;
    __shared__ __align__(16) T sQ[kM * kK];
    __shared__ __align__(16) T sK[kKeys * kK];
    __shared__ __align__(16) T sV[kKeys * kDv];
    const int lane = threadIdx.x;
    stage<T, kM, kK>(sQ, q, kK);
    stage<T, kKeys, kK>(sK, k, kK);
    stage<T, kKeys, kDv>(sV, v, kDv);
    cp_async_wait_all();
    __syncthreads();

    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int ks = 0; ks < kK / 16; ++ks) {
        unsigned af[4], bf[4];
        ldmatrix_x4(af, sQ + SwQK::offset(lane % 16, ks * 16 + (lane / 16) * 8));
        ldmatrix_x4(bf, sK + SwQK::offset((lane / 16) * 8 + lane % 8, ks * 16 + ((lane / 8) % 2) * 8));
        const unsigned b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        mma_m16n8k16<T>(s[0], af, b0, s[0]);
        mma_m16n8k16<T>(s[1], af, b1, s[1]);
    }
    unsigned pf[4];
    acc_to_a_frag<T>(pf, s[0], s[1]);
    float acc[kDv / 8][4];
    for (int nb = 0; nb < kDv / 8; ++nb)
        for (int i = 0; i < 4; ++i) acc[nb][i] = 0.0f;
    for (int nb = 0; nb < kDv / 8; ++nb) {
        // x2 .trans: lanes 0-15 supply key rows 0-15 at columns 8 nb (lanes 16-31 repeat them).
        unsigned vf[2];
        ldmatrix_x2_trans(vf, sV + SwV::offset(lane % 16, nb * 8));
        mma_m16n8k16<T>(acc[nb], pf, vf, acc[nb]);
    }
    const int g = lane / 4, t = lane % 4;
    for (int nb = 0; nb < kDv / 8; ++nb) {
        o[g * kDv + nb * 8 + 2 * t] = acc[nb][0];
        o[g * kDv + nb * 8 + 2 * t + 1] = acc[nb][1];
        o[(g + 8) * kDv + nb * 8 + 2 * t] = acc[nb][2];
        o[(g + 8) * kDv + nb * 8 + 2 * t + 1] = acc[nb][3];
    }
}

}  // namespace tcg

extern "C" __global__ void tc_gemm_f16_nk(const __half* a, const __half* b, float* d, int k_valid) {
    tcg::gemm16<__half, false>(a, b, d, k_valid);
}

extern "C" __global__ void tc_gemm_f16_kn(const __half* a, const __half* b, float* d, int k_valid) {
    tcg::gemm16<__half, true>(a, b, d, k_valid);
}

extern "C" __global__ void tc_gemm_bf16_nk(const __nv_bfloat16* a, const __nv_bfloat16* b, float* d,
                                           int k_valid) {
    tcg::gemm16<__nv_bfloat16, false>(a, b, d, k_valid);
}

extern "C" __global__ void tc_gemm_bf16_kn(const __nv_bfloat16* a, const __nv_bfloat16* b, float* d,
                                           int k_valid) {
    tcg::gemm16<__nv_bfloat16, true>(a, b, d, k_valid);
}

extern "C" __global__ void tc_chain_f16(const __half* q, const __half* k, const __half* v, float* o) {
    tcg::chain<__half>(q, k, v, o);
}

extern "C" __global__ void tc_chain_bf16(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                         const __nv_bfloat16* v, float* o) {
    tcg::chain<__nv_bfloat16>(q, k, v, o);
}
