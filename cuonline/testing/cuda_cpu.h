// cuda_cpu.h: run CUDA C kernel text on a CPU, faithfully enough that kernel bugs show up.
//
// Force-included by cuonline.testing.emulate (g++ -std=c++20 -include cuda_cpu.h -x c++ k.cu).
// The kernel text is the exact string that cupy.RawModule compiles; nothing here defines
// __CUDACC__ or __CUDA_ARCH__, so the kernel text's `#ifdef __CUDACC__` / `#ifdef __CUDA_ARCH__`
// blocks (cuda_fp16.h, the inline-PTX bodies of its helpers) are skipped and this header stands
// in for them: the kernel text declares each such helper, a part below defines it for the CPU.
// CUONLINE_EMULATION is defined instead.
//
// Execution model (one launch):
//   * blocks run one after another, so `__shared__` can be `static`; every such variable
//     registers itself (see SharedVar) and, with the dynamic shared buffer, is filled with 0xFF
//     before every block, so reads of never-written shared memory give NaN / -1.
//   * CUEMU_MODE_FIBERS: every CUDA thread of a block is a user-space context on the launching OS
//     thread; contexts switch only at __syncthreads, __syncwarp, shuffles and votes.  Deadlocks
//     and misuse are reported as a launch error (a Python exception), not an abort.  Warps do
//     not advance together: one warp runs as far as it can (to a __syncthreads or its end)
//     before the next starts, in an order that changes from block to block, so a kernel that
//     counts on warps being in step between two barriers reads poison or stale data.
//   * CUEMU_MODE_THREADS: one OS thread per CUDA thread, created once per launch and walking the
//     grid block by block; barriers are futex-based.  This is the mode for ThreadSanitizer.
//     Misuse aborts the process with a message; a watchdog aborts a barrier stuck for
//     $CUONLINE_EMULATE_WATCHDOG_S seconds (default 20).
//   * Warp collectives follow the PTX shfl.sync rules through a per-warp exchange buffer.  A lane
//     that exited (or does not exist in a partial last warp) reads as all-ones bits (NaN / -1).
//
// This file is the one entry point: it includes the parts below, one role each, in the order
// they build on one another. emulate.py hashes every header of cuda_cpu/ into the key of its
// build cache, and copies them all into each build.
//   cuda_cpu/system.h          the standard and Linux headers, all before any CUDA macro
//   cuda_cpu/types.h           qualifiers, built-in vector types, threadIdx & co.
//   cuda_cpu/runtime.h         per-thread record, launch error text (both modes)
//   cuda_cpu/shared_memory.h   __shared__ as static, dynamic shared buffer, poisoning
//   cuda_cpu/mode.h            picks fibers.h (default) or threads.h (ThreadSanitizer):
//                              launch of a grid, block and warp barriers, watchdog
//   cuda_cpu/warp.h            __syncthreads, __syncwarp, fences, __trap, shuffles, votes
//   cuda_cpu/atomics.h         atomic functions, __ldg
//   cuda_cpu/math_functions.h  math functions and intrinsics, bit casts; common.cuh's exp2_weight
//   cuda_cpu/fp16.h            __half, __nv_bfloat16 and their conversions
//   cuda_cpu/tensor_core.h     tensor_core.cuh's mma, ldmatrix and to_tf32 helpers
//   cuda_cpu/cp_async.h        tensor_core.cuh's cp.async helpers (deferred copies)
//   cuda_cpu/launch.h          launch entry and signature codes for emulate.py's glue
#pragma once

#define CUONLINE_EMULATION 1

#include "cuda_cpu/system.h"
#include "cuda_cpu/types.h"
#include "cuda_cpu/runtime.h"
#include "cuda_cpu/shared_memory.h"
#include "cuda_cpu/mode.h"
#include "cuda_cpu/warp.h"
#include "cuda_cpu/atomics.h"
#include "cuda_cpu/math_functions.h"
#include "cuda_cpu/fp16.h"
#include "cuda_cpu/tensor_core.h"
#include "cuda_cpu/cp_async.h"
#include "cuda_cpu/launch.h"
