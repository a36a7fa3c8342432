// mode.h: the execution mode, chosen at compile time: -DCUEMU_MODE_FIBERS=1 (the default) or
// -DCUEMU_MODE_THREADS=1 (ThreadSanitizer). Each mode's header defines the same runtime
// interface: block_barrier, warp_barrier, warp_generation, warp_slots, fail and launch_impl.
#pragma once

#if !defined(CUEMU_MODE_FIBERS) && !defined(CUEMU_MODE_THREADS)
#define CUEMU_MODE_FIBERS 1
#endif

#if defined(CUEMU_MODE_FIBERS)
#include "fibers.h"
#else
#include "threads.h"
#endif
