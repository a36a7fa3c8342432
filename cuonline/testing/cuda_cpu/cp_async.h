// cp_async.h: C++ bodies of the cp.async helpers of kernels_cu/tensor_core.cuh (cp_async_16,
// cp_async_commit, cp_async_wait, cp_async_wait_all) for the host compiler; as in
// tensor_core.h, the kernel text declares them and defines them under #ifdef __CUDA_ARCH__ only.
//
// A copy is *deferred*, not performed at issue. At issue the 16 destination bytes are poisoned
// (0xFF: NaN / -1) and the source bytes are captured; the data lands when a wait_group retires
// the copy's group. A kernel that reads a stage before waiting for it (and a barrier), or that
// issues a copy into a buffer other threads still read, then reads NaN, which the tests see; a
// synchronous copy would hide both races.
#pragma once

#include "warp.h"

namespace cuonline {
namespace tc {
namespace emu {

struct PendingCopy {
    unsigned char* dst;
    unsigned char data[16];
    long long group;
};

// The copies issued by one CUDA thread and not yet retired. The emulation runs one block at a
// time, so a slot per thread of the block (linear index) is private to that thread; `block`
// tags the owner so that copies a block never waited for are dropped, not applied to the next.
struct CopyQueue {
    std::vector<PendingCopy> pending;
    long long committed = 0;  // groups committed so far; uncommitted copies carry this index
    unsigned block[6] = {~0u, ~0u, ~0u, ~0u, ~0u, ~0u};
};

__device__ __forceinline__ CopyQueue& copy_queue() {
    static CopyQueue queues[1024];
    const unsigned tid = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    CopyQueue& q = queues[tid];
    const unsigned here[6] = {blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z};
    if (std::memcmp(q.block, here, sizeof here) != 0) {
        q.pending.clear();
        q.committed = 0;
        std::memcpy(q.block, here, sizeof here);
    }
    return q;
}

// Store 16 bytes as two 8-byte words. A plain memset/memcpy would do, but GCC's
// ThreadSanitizer does not instrument an inlined 16-byte memset: the poison store of a racing
// copy would go unreported.
typedef unsigned long long __attribute__((may_alias)) Word;
__device__ __forceinline__ void store16(void* dst, const unsigned char (&src)[16]) {
    Word w[2];
    std::memcpy(w, src, 16);
    static_cast<Word*>(dst)[0] = w[0];
    static_cast<Word*>(dst)[1] = w[1];
}

// Land every copy of a group older than `newest_pending` of the committed ones.
__device__ __forceinline__ void retire(CopyQueue& q, long long newest_pending) {
    const long long limit = q.committed - newest_pending;  // groups [0, limit) complete
    size_t keep = 0;
    for (size_t i = 0; i < q.pending.size(); ++i) {
        PendingCopy& c = q.pending[i];
        if (c.group < limit)
            store16(c.dst, c.data);
        else
            q.pending[keep++] = c;
    }
    q.pending.resize(keep);
}

}  // namespace emu

// cp.async.cg.shared.global, 16 bytes: both addresses 16-byte aligned, src_bytes in [0, 16]
// (the kernel text's declaration gives its default, 16).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
    if ((((unsigned long long)smem_dst) | ((unsigned long long)gmem_src)) & 15u) __trap();
    if (src_bytes < 0 || src_bytes > 16) __trap();
    emu::CopyQueue& q = emu::copy_queue();
    emu::PendingCopy c;
    c.dst = static_cast<unsigned char*>(smem_dst);
    c.group = q.committed;
    std::memset(c.data, 0, 16);
    if (src_bytes > 0) std::memcpy(c.data, gmem_src, size_t(src_bytes));
    static constexpr unsigned char kPoison16[16] = {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
                                                    0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
                                                    0xFF, 0xFF, 0xFF, 0xFF};
    emu::store16(smem_dst, kPoison16);
    q.pending.push_back(c);
}

// cp.async.commit_group
__device__ __forceinline__ void cp_async_commit() { ++emu::copy_queue().committed; }

// cp.async.wait_group kPending
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    static_assert(kPending >= 0 && kPending <= 7, "cp.async.wait_group takes 0..7");
    emu::retire(emu::copy_queue(), kPending);
}

// cp.async.wait_all: commit the open group and land every copy. A thread's leftover copies are
// dropped when its thread index next uses cp.async in another block, but a later launch at the
// same block index would land them: kernels retire every copy before they exit.
__device__ __forceinline__ void cp_async_wait_all() {
    emu::CopyQueue& q = emu::copy_queue();
    ++q.committed;
    emu::retire(q, 0);
}

}  // namespace tc
}  // namespace cuonline
