// __shared__ inside templates (comdat sections), at namespace scope, and in a __device__ helper
// that calls __syncthreads; entry points specialize templates, as the cuonline kernels do.
__shared__ int g_counter_slot[4];

template <int kThreads, class T>
__device__ __forceinline__ T block_reduce(T v) {
    __shared__ T warp_partials[kThreads / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) warp_partials[warp] = v;
    __syncthreads();
    T total = 0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < kThreads / 32; ++w) total += warp_partials[w];
    }
    return total;
}

template <int kThreads, class T>
__device__ void row_sums(const T* __restrict__ x, T* __restrict__ out, int cols) {
    T acc = 0;
    for (int c = threadIdx.x; c < cols; c += kThreads) acc += x[(long long)blockIdx.x * cols + c];
    const T total = block_reduce<kThreads>(acc);
    if (threadIdx.x == 0) {
        g_counter_slot[0] = 1;
        out[blockIdx.x] = total;
    }
}

extern "C" __global__ void __launch_bounds__(64) row_sums_f32_t64(const float* __restrict__ x,
                                                                 float* __restrict__ out, int cols) {
    row_sums<64>(x, out, cols);
}
extern "C" __global__ void row_sums_f64_t128(const double* __restrict__ x, double* __restrict__ out,
                                             int cols) {
    row_sums<128>(x, out, cols);
}

// Poison must reach shared memory declared in templates and in inline helpers too.
template <class T>
__device__ __forceinline__ T read_half_written(int t) {
    __shared__ T slots[64];
    if (t % 2 == 0) slots[t] = T(1);
    __syncthreads();
    return slots[t];
}
__device__ __forceinline__ int read_half_written_int(int t) {
    __shared__ int islots[64];
    if (t % 2 == 0) islots[t] = 5;
    __syncthreads();
    return islots[t];
}
extern "C" __global__ void template_poison(float* __restrict__ out, int* __restrict__ iout) {
    const int t = threadIdx.x;
    out[blockIdx.x * blockDim.x + t] = read_half_written<float>(t);
    iout[blockIdx.x * blockDim.x + t] = read_half_written_int(t);
}

// extern __shared__ (rewritten by the emulation to the launch's dynamic buffer).
extern "C" __global__ void extern_dynamic(float* __restrict__ out) {
    extern __shared__ __align__(16) float dyn[];
    dyn[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = dyn[blockDim.x - 1 - threadIdx.x];
}

// Parameters passed by value: a struct (as a ctypes.Structure) and a __half (as np.float16).
struct Params { int n; float scale; double shift; };
extern "C" __global__ void by_value(Params p, __half h, float* __restrict__ out) {
    const int i = threadIdx.x;
    if (i < p.n) out[i] = i * p.scale + (float)p.shift + __half2float(h);
}
