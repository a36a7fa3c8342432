// MUTANT of block_sum in basic.cu: the __syncthreads inside the tree reduction is removed.
// The emulation must expose it: a wrong sum in fibers mode, a data race under ThreadSanitizer.
extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[1024];
    const int t = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + t;
    partial[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if (t < s) partial[t] += partial[t + s];
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}
