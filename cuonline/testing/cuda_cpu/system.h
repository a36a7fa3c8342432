// system.h: the standard and Linux headers that the parts of cuda_cpu.h use, all of them.
//
// Every part includes this file first and no part includes a system header itself: the CUDA
// qualifiers of types.h are macros (`__noinline__`, `__device__`...), and libstdc++ spells
// `__noinline__` in its own attributes, so a system header read after them would not compile.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cassert>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
