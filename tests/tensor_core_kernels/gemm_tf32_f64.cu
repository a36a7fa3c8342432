// One-warp GEMM tiles on mma.m16n8k8 (tf32) and mma.m8n8k4 (f64) (tests/test_tensor_core.py).
//
// Fragments are loaded straight from global memory by each lane, following the PTX layouts
// written out in tensor_core.cuh (g = lane / 4, t = lane % 4), so these kernels check the
// helpers' layouts independently of ldmatrix.

namespace tcs {

using namespace cuonline::tc;

// D(16, 16) = tf32(A(16, 32)) · tf32(B(32, 16)) in float32, 4 k-steps of 8.
constexpr int kTfM = 16, kTfN = 16, kTfK = 32;

// D(8, 16) = A(8, 16) · B(16, 16) in float64, 4 k-steps of 4.
constexpr int kF64M = 8, kF64N = 16, kF64K = 16;

}  // namespace tcs

extern "C" __global__ void tc_gemm_tf32(const float* a, const float* b, float* d) {
    using namespace tcs;
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    float acc[kTfN / 8][4];
    for (int nb = 0; nb < kTfN / 8; ++nb)
        for (int i = 0; i < 4; ++i) acc[nb][i] = 0.0f;
    for (int k0 = 0; k0 < kTfK; k0 += 8) {
        // a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4]
        const unsigned af[4] = {
            to_tf32(a[g * kTfK + k0 + t]), to_tf32(a[(g + 8) * kTfK + k0 + t]),
            to_tf32(a[g * kTfK + k0 + t + 4]), to_tf32(a[(g + 8) * kTfK + k0 + t + 4])};
        for (int nb = 0; nb < kTfN / 8; ++nb) {
            // b[0] = B[t][g], b[1] = B[t+4][g]
            const unsigned bf[2] = {to_tf32(b[(k0 + t) * kTfN + nb * 8 + g]),
                                    to_tf32(b[(k0 + t + 4) * kTfN + nb * 8 + g])};
            mma_m16n8k8_tf32(acc[nb], af, bf, acc[nb]);
        }
    }
    for (int nb = 0; nb < kTfN / 8; ++nb) {
        d[g * kTfN + nb * 8 + 2 * t] = acc[nb][0];
        d[g * kTfN + nb * 8 + 2 * t + 1] = acc[nb][1];
        d[(g + 8) * kTfN + nb * 8 + 2 * t] = acc[nb][2];
        d[(g + 8) * kTfN + nb * 8 + 2 * t + 1] = acc[nb][3];
    }
}

extern "C" __global__ void tc_gemm_f64(const double* a, const double* b, double* d) {
    using namespace tcs;
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    double acc[kF64N / 8][2];
    for (int nb = 0; nb < kF64N / 8; ++nb) acc[nb][0] = acc[nb][1] = 0.0;
    for (int k0 = 0; k0 < kF64K; k0 += 4) {
        const double af = a[g * kF64K + k0 + t];                  // A[g][t]
        for (int nb = 0; nb < kF64N / 8; ++nb) {
            const double bf = b[(k0 + t) * kF64N + nb * 8 + g];   // B[t][g]
            mma_m8n8k4_f64(acc[nb], af, bf, acc[nb]);
        }
    }
    for (int nb = 0; nb < kF64N / 8; ++nb) {                     // c[i] = C[g][2t + i]
        d[g * kF64N + nb * 8 + 2 * t] = acc[nb][0];
        d[g * kF64N + nb * 8 + 2 * t + 1] = acc[nb][1];
    }
}
