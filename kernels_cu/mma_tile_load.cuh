// mma_tile_load.cuh: global -> shared tile loads of the tensor-core family.
//
// Pasted (by cuonline/kernels/source.py, in the order cuonline/kernels/families.py lists) after
// tensor_core.cuh (cp_async_16, SmemTile layouts, to_tf32) into the tensor-core family's text.
// Every shape is a template parameter: the file reads no variant define.

namespace cuonline {
namespace mma {

using namespace cuonline::tc;

// The 16-byte chunks of a (kRows, kPadCols) tile that this thread moves. The first kLoaders
// threads (whole rows of chunks: all of them for power-of-two widths, 120 of 128 for the 12
// chunks of D = 96) each keep one chunk column and step down the rows kRowStep at a time: its
// column, its first shared-memory offset and its global address are worked out once per tile,
// and each further chunk is one constant step away in both (fully unrolled; see TileLoader::load).
// Rows wider than the block (f64 D = 128 on one warp) take a plain strided loop.
template <int kThreads, class E, int kRows, int kPadCols>
struct OwnChunks {
    static constexpr int kChunk = 16 / int(sizeof(E));  // elements per 16-byte chunk
    static constexpr int kRowChunks = kPadCols / kChunk;
    static constexpr int kLoaders = kThreads / kRowChunks * kRowChunks;
    static constexpr bool kOneColumn = kLoaders > 0;
    static constexpr int kRowStep = kOneColumn ? kLoaders / kRowChunks : 1;
    static constexpr int kSteps = (kRows + kRowStep - 1) / kRowStep;  // kOneColumn only

    // f(r, col) for every chunk (r, col) of this thread
    template <class F>
    __device__ __forceinline__ static void for_each(F&& f) {
        if constexpr (kOneColumn) {
            if (kLoaders < kThreads && int(threadIdx.x) >= kLoaders) return;
            const int col = int(threadIdx.x) % kRowChunks * kChunk;
            const int r_first = int(threadIdx.x) / kRowChunks;
#pragma unroll
            for (int k = 0; k < kSteps; ++k) {
                const int r = r_first + k * kRowStep;
                if (kRows % kRowStep == 0 || r < kRows) f(r, col);
            }
        } else {
            for (int idx = threadIdx.x; idx < kRows * kRowChunks; idx += kThreads) {
                const int r = idx / kRowChunks;
                f(r, (idx - r * kRowChunks) * kChunk);
            }
        }
    }
};

// The tile loads of a block of kThreads threads; kCpAsync: q/k/v rows are 16-byte aligned
// with unit column stride (checked on the host) and go global -> shared by cp.async, else
// element by element through both strides into the same layout.
template <int kThreads, bool kCpAsync>
struct TileLoader {
    // Stage rows [r0, r0 + kRows) x columns [0, kCols) of a (rows, cols) operand into a tile of
    // layout L whose padded width is L's; rows at or past row_end and columns past kCols are zero
    // and never read from global memory. cp.async moves whole 16-byte chunks (host-checked
    // alignment); the fallback reads elements through both strides.
    template <class L, int kRows, int kCols, int kPadCols, class T>
    __device__ __forceinline__ static void load(T* s, const T* base, long long row_stride,
                                                long long col_stride, long long r0,
                                                long long row_end) {
        typedef OwnChunks<kThreads, T, kRows, kPadCols> Own;
        constexpr int kChunk = Own::kChunk;
        // rows of the tile that exist in the operand, in [0, kRows]
        const long long left = row_end - r0;
        const int rows = left <= 0 ? 0 : (left >= kRows ? kRows : int(left));
        const T* tile = base + r0 * row_stride;
        if constexpr (kCpAsync && Own::kOneColumn) {
            // The lean path: per chunk, one 64-bit pointer step, a row test and the copy. When
            // kRowStep is a multiple of the layout's row period (8 for the swizzle, 1 for padded
            // rows) the shared offsets are compile-time steps from the first one.
            if (Own::kLoaders < kThreads && int(threadIdx.x) >= Own::kLoaders) return;
            const int col = int(threadIdx.x) % Own::kRowChunks * kChunk;
            const int r_first = int(threadIdx.x) / Own::kRowChunks;
            // bytes of this thread's column that lie inside kCols (16 unless D is padded)
            int col_bytes = 16;
            if constexpr (kCols < kPadCols) {
                col_bytes = (kCols - col) * int(sizeof(T));
                col_bytes = col_bytes < 0 ? 0 : (col_bytes > 16 ? 16 : col_bytes);
            }
            // A chunk past `rows` copies 0 bytes and zero-fills: its address is formed, never read
            // (cp.async with src-size 0). The pointer steps by src_step rather than being
            // recomputed as src + k src_step: ptxas then keeps one pointer live, not one per chunk
            // (f16 D = 64: 168 registers against 178).
            const T* src = tile + r_first * row_stride + col;
            const long long src_step = Own::kRowStep * row_stride;
            T* const dst = s + L::offset(r_first, col);
#pragma unroll
            for (int k = 0; k < Own::kSteps; ++k, src += src_step) {
                const int r = r_first + k * Own::kRowStep;
                if (kRows % Own::kRowStep != 0 && r >= kRows) break;
                T* d = Own::kRowStep % L::kRowPeriod == 0 ? dst + k * Own::kRowStep * L::kStride
                                                          : s + L::offset(r, col);
                cp_async_16(d, src, r < rows ? col_bytes : 0);
            }
        } else if constexpr (kCpAsync) {
            Own::for_each([&](int r, int col) {  // rows wider than the block
                int bytes = r < rows ? (kCols - col) * int(sizeof(T)) : 0;
                bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
                cp_async_16(s + L::offset(r, col), tile + r * row_stride + col, bytes);
            });
        } else {
            Own::for_each([&](int r, int col) {
                T* dst = s + L::offset(r, col);
                const T* src = tile + r * row_stride + col * col_stride;
#pragma unroll
                for (int e = 0; e < kChunk; ++e)
                    dst[e] = r < rows && col + e < kCols ? src[e * col_stride]
                                                         : FromAcc<T>::cvt(0.0f);
            });
        }
    }

    // tf32 (Ops<float>::kRoundTiles): round this thread's chunks of a staged tile in place. Called
    // after this thread's copies landed and before the barrier that hands the tile to all warps.
    template <class L, int kRows, int kPadCols, class T>
    __device__ __forceinline__ static void round(T* s) {
        typedef OwnChunks<kThreads, T, kRows, kPadCols> Own;
        Own::for_each([&](int r, int col) {
            T* chunk = s + L::offset(r, col);
#pragma unroll
            for (int e = 0; e < Own::kChunk; ++e) chunk[e] = __uint_as_float(to_tf32(chunk[e]));
        });
    }
};

}  // namespace mma
}  // namespace cuonline
