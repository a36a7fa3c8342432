// Small kernels that exercise the CUDA-emulation runtime (tests/test_emulation_runtime.py).

// y[i] = a * x[i * stride] + y[i]: a grid tail handled by an early return.
extern "C" __global__ void strided_axpy(const float* __restrict__ x, float* __restrict__ y,
                                        float a, int n, int stride) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = a * x[(long long)i * stride] + y[i];
}

// out[block] = sum of x over the block's slice; blockDim.x must be a power of two <= 1024.
extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[1024];
    const int t = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + t;
    partial[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if (t < s) partial[t] += partial[t + s];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}

// Every thread applies one shuffle kind to its lane value; out has one entry per thread.
// kind: 0 idx, 1 up, 2 down, 3 xor.
extern "C" __global__ void shuffle_probe(const int* __restrict__ in, int* __restrict__ out,
                                         int kind, int b, int width) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int v = in[t];
    int r;
    switch (kind) {
        case 0: r = __shfl_sync(0xffffffffu, v, b, width); break;
        case 1: r = __shfl_up_sync(0xffffffffu, v, b, width); break;
        case 2: r = __shfl_down_sync(0xffffffffu, v, b, width); break;
        default: r = __shfl_xor_sync(0xffffffffu, v, b, width); break;
    }
    out[t] = r;
}

// Shuffles of 8-byte and 2-byte types and templated helpers: a butterfly sum per warp segment.
template <class T>
__device__ __forceinline__ T segment_sum(T v, int width) {
    for (int off = width / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off, width);
    return v;
}
extern "C" __global__ void warp_sums(const double* __restrict__ xd, const long long* __restrict__ xl,
                                     double* __restrict__ od, long long* __restrict__ ol, int width) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    od[t] = segment_sum(xd[t], width);
    ol[t] = segment_sum(xl[t], width);
}

// out[t] = ballot / any / all of (in[t] != 0) over the warp.
extern "C" __global__ void votes(const int* __restrict__ in, unsigned* __restrict__ ballot,
                                 int* __restrict__ any, int* __restrict__ all) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int p = in[t] != 0;
    ballot[t] = __ballot_sync(0xffffffffu, p);
    any[t] = __any_sync(0xffffffffu, p);
    all[t] = __all_sync(0xffffffffu, p);
}

// Reads shared memory that only even threads wrote: odd threads must see the poison.
extern "C" __global__ void read_unwritten_shared(float* __restrict__ out, int* __restrict__ iout) {
    __shared__ float sf[256];
    __shared__ int si[256];
    const int t = threadIdx.x;
    if (t % 2 == 0) { sf[t] = 1.0f; si[t] = 7; }
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = sf[t];
    iout[blockIdx.x * blockDim.x + t] = si[t];
}

// Reverses each block's slice through dynamic shared memory; odd blocks read one slot beyond
// what they wrote when `overread` is set (poison must show).
extern "C" __global__ void reverse_dynamic(const float* __restrict__ x, float* __restrict__ y,
                                           int overread) {
    CUONLINE_DYNAMIC_SHARED(float, buf);
    const int t = threadIdx.x, n = blockDim.x;
    const int base = blockIdx.x * n;
    buf[t] = x[base + t];
    __syncthreads();
    y[base + t] = buf[n - 1 - t + (overread && t == 0 ? n : 0)];
}

// half / bfloat16 conversions of every bit pattern and of arbitrary floats.
extern "C" __global__ void convert16(const unsigned short* __restrict__ bits,
                                     float* __restrict__ from_half, float* __restrict__ from_bf16,
                                     const float* __restrict__ f, __half* __restrict__ to_half,
                                     __nv_bfloat16* __restrict__ to_bf16, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    __half h;
    h = __ushort_as_half(bits[i]);
    from_half[i] = __half2float(h);
    from_bf16[i] = __bfloat162float(__ushort_as_bfloat16(bits[i]));
    to_half[i] = __float2half_rn(f[i]);
    to_bf16[i] = __float2bfloat16_rn(f[i]);
}

// Atomics from every thread of every block.
extern "C" __global__ void atomics(int* __restrict__ icount, float* __restrict__ fsum,
                                   double* __restrict__ dsum, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(icount, 1);
    atomicAdd(fsum, 1.0f);
    atomicAdd(dsum, (double)i);
}

// Math intrinsics spot check: one output per function.
extern "C" __global__ void math_probe(const float* __restrict__ x, float* __restrict__ out) {
    const float v = x[0];
    int k = 0;
    out[k++] = exp2f(v);
    out[k++] = __expf(v);
    out[k++] = rsqrtf(v);
    out[k++] = fmaxf(v, 1.5f);
    out[k++] = min(v, 0.25f);
    out[k++] = (float)max(3, 7);
    out[k++] = __int_as_float(0xff800000);
    out[k++] = __fdividef(1.0f, v);
    out[k++] = tanhf(v);
    out[k++] = isnan(__int_as_float(0x7fc00000)) ? 1.0f : 0.0f;
}

// 2-D grid and block; each thread writes its coordinates.
extern "C" __global__ void coords(int* __restrict__ out) {
    const int bx = blockIdx.x, by = blockIdx.y, tx = threadIdx.x, ty = threadIdx.y;
    const int gx = bx * blockDim.x + tx, gy = by * blockDim.y + ty;
    const int w = gridDim.x * blockDim.x;
    int* o = out + 4 * (gy * w + gx);
    o[0] = bx; o[1] = by; o[2] = tx; o[3] = ty;
}

// Barrier cost probe: `rounds` __syncthreads with a little shared traffic.
extern "C" __global__ void barrier_loop(float* __restrict__ out, int rounds) {
    __shared__ float s[1024];
    const int t = threadIdx.x;
    float acc = 0.0f;
    for (int r = 0; r < rounds; ++r) {
        s[t] = (float)(t + r);
        __syncthreads();
        acc += s[(t + 1) % blockDim.x];
        __syncthreads();
    }
    out[blockIdx.x * blockDim.x + t] = acc;
}

// A double passed by value.
extern "C" __global__ void scale_double(double* __restrict__ x, double a) {
    x[threadIdx.x] *= a;
}
