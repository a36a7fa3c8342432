// Kernels that break CUDA's rules; the emulation must say so instead of hanging or guessing.

// Threads 0-15 wait at __syncthreads while lanes 16-31 of the same warp wait at __syncwarp:
// deadlock (launch with one block of 64 threads).
extern "C" __global__ void divergent_barrier(int* out) {
    const int t = threadIdx.x;
    if (t < 16) __syncthreads();
    else __syncwarp();
    out[t] = t;
}

// A shuffle with a partial mask, which the emulation refuses.
extern "C" __global__ void partial_mask(int* out) {
    const int t = threadIdx.x;
    out[t] = __shfl_xor_sync(0x0000ffffu, t, 1);
}

// A width that is not a power of two.
extern "C" __global__ void bad_width(int* out) {
    const int t = threadIdx.x;
    out[t] = __shfl_down_sync(0xffffffffu, t, 1, 12);
}

// Lanes of the upper half-warp return before the shuffle: the lower half reads exited lanes.
extern "C" __global__ void shuffle_after_exit(int* out) {
    const int t = threadIdx.x;
    if (t % 32 >= 16) return;
    out[t] = __shfl_down_sync(0xffffffffu, t, 8);
}
