"""The CPU engines' runtime: threads, BLAS's thread count, fork safety, compiled tile kernels.

Shared by the NumPy forward (:mod:`.numpy`), its backward (:mod:`.numpy_backward`) and the
softmax family (:mod:`.softmax`); nothing here knows what a task computes.

* :func:`workers`: the cores this process may run on (the thread count of ``workers=None``);
* :func:`run_tasks`: ``[fn(t) for t in tasks]`` on a shared thread pool, BLAS held to one
  thread meanwhile, results independent of the thread count;
* :func:`tile_kernel`: a compiled kernel of :mod:`._tile_kernels` or :mod:`._task_kernels`
  (numba), or None where it is unavailable (the engines then run their ufunc passes or Python
  loops); ``use_compiled_kernels = False`` forces the ufunc passes and ``compiled_kernels``
  holds what was compiled (tests set both);
* :func:`cache_sizes` and :func:`score_tile`: the caches this machine reports and the tile
  shape they give, so the engines size their tiles for the machine they run on;
* :func:`machine`: what a benchmark figure depends on (CPU model, instruction sets that numba
  and BLAS use, caches), for the benchmarks' preamble.

The pool's threads and BLAS's limit do not survive ``os.fork()``: a child starts afresh.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["workers", "cores_for", "stacks_of", "ElementRun", "run_tasks", "tile_kernel",
           "use_compiled_kernels", "compiled_kernels", "cache_sizes", "score_tile", "machine",
           "blas_libraries", "single_threaded_blas", "cpu_model"]


def workers() -> int:
    """Number of CPU cores this process may run on: the thread count of ``workers=None``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


# A call of fewer multiply-adds than this runs its stacks as one, in the calling thread: waking
# a pool thread and handing it a stack cost 0.1-0.25 ms on machine C's 2-core virtual machine,
# about the time of 2-4 million of a stack's multiply-adds on one core (16-query elements, at
# 2.4 us per 16 x 16 x 128). 64 heads of 16 queries, D 64 (2 million): 0.61-0.63 ms a call
# as two stacks on two threads; 0.32-0.41 ms as one (the stacks' reference counts gone too).
PARALLEL_WORK = 1 << 23


def cores_for(scores, products):
    """The cores a call of ``scores`` score places is cut for (:func:`stacks_of`), each place
    ``products`` multiply-adds (the forward's two products: ``D + Dv``; the backward's five:
    ``2 D + 3 Dv``): all of them (:func:`workers`), or 1 below ``PARALLEL_WORK``
    multiply-adds. A count of the problem, never of a call's ``workers``: a plan, and so the
    results, do not depend on ``workers``."""
    return 1 if scores * products < PARALLEL_WORK else workers()


def stacks_of(count, most, cores):
    """``[(start, stop), ...]``: ``count`` equal elements cut into runs of at most ``most``
    (at least 1) and at least as many runs as ``cores``, their lengths differing by at most
    one; as few runs as a multiple of ``cores`` allows, so that every core gets the same share
    (64 elements, at most 21 a run, 2 cores: 4 runs of 16, not 21, 21, 21 and 1), unless that
    would leave runs of one element (no stack at all): then the fewest runs."""
    most = max(1, min(most, -(-count // cores)))
    fewest = -(-count // most)
    shared = -(-fewest // cores) * cores
    runs = max(1, shared if count >= 2 * shared else fewest)
    bounds = [count * i // runs for i in range(runs + 1)]
    return [(a, z) for a, z in zip(bounds, bounds[1:]) if z > a]


class ElementRun(Sequence):
    """The batch elements ``start`` to ``stop`` (in C order) of a batch of ``shape``, read as
    the list of their index tuples (``list(np.ndindex(*shape))[start:stop]``) without making
    it: a batch of a thousand short sequences took about 80 us to list, and NumPy 130 us more
    to read the list back as an array. :meth:`indices` gives them as one array, for
    :func:`.cpu_blas.batch_addresses`."""

    __slots__ = ("shape", "start", "stop")

    def __init__(self, shape, start, stop):
        self.shape, self.start, self.stop = tuple(shape), start, max(start, stop)

    def __len__(self):
        return self.stop - self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, z, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(a, z, step)]
            return ElementRun(self.shape, self.start + a, self.start + z)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("element index out of range")
        flat, index = self.start + i, []
        for n in reversed(self.shape):
            flat, j = divmod(flat, n)
            index.append(j)
        return tuple(index[::-1])

    def __iter__(self):
        return itertools.islice(itertools.product(*map(range, self.shape)), self.start,
                                self.stop)

    def __eq__(self, other):
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self):
        return f"ElementRun({self.shape}, {self.start}, {self.stop})"

    def step(self, x, tail=2):
        """The step in bytes from one element's part of ``x`` to the next (batch axes
        ``shape``, or broadcast to it, then ``tail`` more), or None where the batch axes do
        not merge into one axis without a copy."""
        # one loop, no generators: a stack's three arrays are stepped through on every call
        shape, strides = x.shape, x.strides
        extra = x.ndim - tail - len(self.shape)        # x's batch axes end where shape's do
        merge, outer = True, None        # the step of the last batch axis longer than 1 so far
        for i, n in enumerate(self.shape):
            length = shape[extra + i] if extra + i >= 0 else 1
            if length != 1 and length != n:
                raise ValueError(f"an array of shape {x.shape} does not broadcast to the "
                                 f"batch {self.shape} (then {tail} more axes)")
            if n != 1:
                step = 0 if length == 1 else strides[extra + i]
                merge = merge and (outer is None or outer == step * n)
                outer = step
        if not merge:
            return None
        return 0 if outer is None else outer

    def view(self, x, tail=2):
        """The elements of ``x`` (batch axes ``shape``, or broadcast to it, then ``tail``
        more) as one slice, a view of shape ``(len(self),) + x.shape[-tail:]`` (writeable
        where ``x`` is and needs no broadcast); None where the batch axes do not merge into
        one without a copy."""
        step = self.step(x, tail)
        if step is None:
            return None
        rest = x.shape[x.ndim - tail:]
        if x.shape[:x.ndim - tail] == self.shape:     # the axes merge: reshape makes a view
            merged = x.reshape((math.prod(self.shape),) + rest)
        else:
            merged = np.lib.stride_tricks.as_strided(
                x, (math.prod(self.shape),) + rest, (step,) + x.strides[x.ndim - tail:],
                writeable=False)
        return merged[self.start:self.stop]

    def addresses(self, x, tail=2):
        """The address of each element's part of ``x`` (as :meth:`view` takes it), int64;
        None where the batch axes do not merge."""
        step = self.step(x, tail)
        if step is None:
            return None
        return x.ctypes.data + np.arange(self.start, self.stop, dtype=np.int64) * step

    def indices(self):
        """The elements' indices, an int64 array of shape ``(len(self), len(shape))``."""
        flat = np.arange(self.start, self.stop, dtype=np.int64)
        if not self.shape:
            return np.zeros((len(flat), 0), dtype=np.int64)
        return np.stack(np.unravel_index(flat, self.shape), axis=-1).astype(np.int64,
                                                                              copy=False)


def run_tasks(tasks, fn, n_workers, cost=None, hold_blas=True):
    """``[fn(t) for t in tasks]`` on ``min(n_workers, len(tasks))`` threads.

    ``cost``: a function of a task giving its relative amount of work. The threads then take
    the tasks in decreasing order of it (the longest first, so that no thread is left alone
    with a long task at the end: the rows of causal attention see more keys the further down
    they are), the results still in the order of ``tasks``. Without it, in the given order.

    A single task runs in the calling thread with BLAS as the user set it (its matrix products
    are the only parallel work there is). Several tasks run with BLAS held to one thread, on
    any number of workers alike, so results do not depend on ``n_workers``: one worker runs
    them in the calling thread; ``n`` workers are the calling thread and ``n - 1`` threads of
    the shared pool, pulling tasks from one queue. The caller always works too, so a call
    progresses even while concurrent calls fill the pool, and each call runs on at most ``n``
    threads whatever the pool's size.

    ``hold_blas``: False where the tasks call no BLAS that runs threads of its own (the
    compiled stacks, whose products go to MKL's sequential layer): the hold and its release
    then are not made (they took 0.04 ms of each call with a pool thread on machine C).
    """
    if len(tasks) < 2:
        return [fn(t) for t in tasks]
    n = min(n_workers, len(tasks))
    order = (range(len(tasks)) if cost is None
             else sorted(range(len(tasks)), key=lambda i: -cost(tasks[i])))
    with single_threaded_blas() if hold_blas else contextlib.nullcontext():
        if n == 1:
            results = [None] * len(tasks)
            for i in order:
                results[i] = fn(tasks[i])
            return results
        batch = _Batch(tasks, fn, order)
        _submit(batch.drain, n - 1)
        try:
            batch.drain()
            batch.done.wait()
        finally:
            batch.stop()                       # interrupted: the pool takes no further task
    if batch.error is not None:
        raise batch.error
    return batch.results


class _Batch:
    """The tasks of one call, handed out one at a time in ``order`` (indices into ``tasks``)
    to whichever thread asks first."""

    def __init__(self, tasks, fn, order):
        self.tasks, self.fn, self.order = tasks, fn, list(order)
        self.results = [None] * len(tasks)
        self.error = None
        self.done = threading.Event()          # set when no task is left or running
        self._lock = threading.Lock()
        self._next = 0
        self._running = 0

    def stop(self):
        with self._lock:
            self._next = len(self.tasks)

    def drain(self):
        while True:
            with self._lock:
                if self.error is not None or self._next == len(self.tasks):
                    if self._running == 0:
                        self.done.set()
                    return
                i = self.order[self._next]
                self._next += 1
                self._running += 1
            try:
                self.results[i] = self.fn(self.tasks[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                with self._lock:
                    self.error = self.error or exc
            with self._lock:
                self._running -= 1


# The pool is shared by all calls and grows to the largest thread count asked for. Its threads
# do not survive os.fork(), so a child starts with none (see _after_fork).
_pool = None
_pool_size = 0
_pool_lock = threading.Lock()


def _submit(job, count):
    """Run ``job`` on ``count`` pool threads (without waiting for it)."""
    global _pool, _pool_size
    # submitting under the lock: a pool being replaced by a larger one is shut down, and a
    # shut-down pool refuses new jobs (its queued and running jobs still finish)
    with _pool_lock:
        if _pool is None or _pool_size < count:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="cuonline")
            _pool_size = count
            if old is not None:
                old.shutdown(wait=False)
        for _ in range(count):
            _pool.submit(job)


# BLAS holds one process-wide thread count. Each call entering and leaving its own
# threadpool_limits would interleave (A saves N and sets 1, B saves 1, A restores N, B
# "restores" 1: the user's N is lost), so calls share one limit: the first call in sets it,
# the last one out restores it, each on its own thread. threadpoolctl (3.8+) lets one thread
# at a time set OpenBLAS's count (the first to set it, until it lets go), so the thread that
# changes it lets go at once (_release_openblas) and the last one out, whichever it is, can
# restore it. (A helper thread that did both cost two thread hand-offs a call: 0.9 ms on a
# 2-core virtual machine whose idle cores took 0.1-0.4 ms to wake, 9% of an 8.7 ms call.)
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter = None


@contextlib.contextmanager
def single_threaded_blas():
    """Hold NumPy's BLAS to one thread within (shared by concurrent holders; the last one
    out gives the user's count back)."""
    _blas_enter()
    try:
        yield
    finally:
        _blas_exit()


def _blas_enter():
    global _blas_users, _blas_limiter
    with _blas_lock:
        if _blas_users == 0:
            _blas_limiter = _limit_blas()
        _blas_users += 1


def _blas_exit():
    global _blas_users, _blas_limiter
    with _blas_lock:
        _blas_users -= 1
        if _blas_users == 0:
            limiter, _blas_limiter = _blas_limiter, None
            _restore_blas(limiter)


_blas_libraries = None


def _limit_blas():
    """Every BLAS library loaded here held to one thread; returns what :func:`_restore_blas`
    gives back: ``[(library, its count), ...]`` for those that had another count. Each
    library's own calls (threadpoolctl's controllers, found once), without threadpoolctl's
    ``limit``, which read every library's whole description each time (a limit and its
    restore: 13.6 us in a loop on machine C, 6.6 us this way)."""
    global _blas_libraries
    if _blas_libraries is None:
        # found once: a ThreadpoolController scans the loaded libraries (about 1 ms)
        from threadpoolctl import ThreadpoolController

        _blas_libraries = ThreadpoolController().select(user_api="blas").lib_controllers
    held = []
    try:
        for library in _blas_libraries:
            count = library.get_num_threads()
            if count is not None and count != 1:
                library.set_num_threads(1)
                held.append((library, count))
    finally:
        _release_openblas()
    return held


def _restore_blas(held):
    try:
        for library, count in held:
            library.set_num_threads(count)
    finally:
        _release_openblas()


def _release_openblas():
    """Let go of threadpoolctl's hold on OpenBLAS's thread count where this thread has it
    (threadpoolctl 3.8+; a thread that does not hold it changes nothing; earlier versions
    hold nothing). Called after _limit_blas has imported threadpoolctl."""
    import threadpoolctl

    controller = getattr(threadpoolctl, "OpenBLASController", None)
    release = getattr(controller, "clear_controlling_thread", None)
    if release is not None:
        release()


def _after_fork():
    """In a child of os.fork(): forget the parent's threads and locks (they are not copied; a
    pool that believes it has idle threads would wait for them forever)."""
    global _pool, _pool_size, _pool_lock, _blas_lock, _blas_users, _blas_limiter
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()
    limiter = _blas_limiter
    _blas_lock, _blas_users, _blas_limiter = threading.Lock(), 0, None
    if limiter is not None:
        # forked while a call in another thread held BLAS at one thread: give the child the
        # user's count back
        _restore_blas(limiter)


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork)


# The compiled kernels (numba) by (name, dtype): the kernel, or None where numba is missing or
# the kernel does not compile here (the engines then run their ufunc passes, after one warning).
compiled_kernels: dict = {}
_kernels_lock = threading.Lock()
# False forces the ufunc passes (tests compare the two)
use_compiled_kernels = True


def tile_kernel(dtype, name="online_softmax_tile"):
    """The compiled kernel ``name`` of :mod:`._tile_kernels` for ``dtype``, or None.

    Imported and compiled on first use (so ``import cuonline`` imports no numba, about 0.3 s;
    compiled code is cached on disk by numba across processes).
    """
    if not use_compiled_kernels:
        return None
    key = (name, np.dtype(dtype))
    kernel = compiled_kernels.get(key, False)
    if kernel is False:
        with _kernels_lock:
            if key not in compiled_kernels:
                compiled_kernels[key] = _compile(*key)
            kernel = compiled_kernels[key]
    return kernel


# the kernels of ._task_kernels (the others are ._tile_kernels')
TASK_KERNELS = ("forward_stack", "backward_block", "backward_stack")


def _compile(name, dtype):
    try:
        if name in TASK_KERNELS:
            from . import _task_kernels as module
        else:
            from . import _tile_kernels as module

        return module.compile_for(name, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure to import or compile: the ufuncs
        import warnings

        warnings.warn(f"cuonline: the compiled kernel {name} for {dtype} is unavailable "
                      f"({type(exc).__name__}: {exc}); the NumPy engine runs its ufunc passes "
                      f"instead (slower, same results)", RuntimeWarning, stacklevel=3)
        return None


# --------------------------------------------------------------------------------------------
# the machine's caches and the tile shapes they give

# What a machine that reports nothing is assumed to have (a common per-core L2 of recent x86).
DEFAULT_CACHES = {"L1d": 32 * 1024, "L2": 1024 * 1024, "L3": 32 * 1024 * 1024}
_caches = None


def cache_sizes():
    """``{"L1d": bytes, "L2": bytes, "L3": bytes}``: the data caches of the first core, as
    Linux reports them (``/sys/devices/system/cpu/cpu0/cache``), else ``os.sysconf``, else
    :data:`DEFAULT_CACHES` for what neither gives. Read once per process."""
    global _caches
    if _caches is None:
        found = _sysfs_caches() or _sysconf_caches()
        _caches = {**DEFAULT_CACHES, **{k: v for k, v in found.items() if v > 0}}
    return dict(_caches)


def _sysfs_caches(root="/sys/devices/system/cpu/cpu0/cache"):
    out = {}
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return out
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(root, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, entry, "size")) as f:
                size = _parse_size(f.read().strip())
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        out["L1d" if level == "1" else f"L{level}"] = size
    return out


def _parse_size(text):
    """Bytes of a size as sysfs writes it: ``48K``, ``1024K``, ``32M`` or a plain count."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def _sysconf_caches():
    names = {"L1d": "SC_LEVEL1_DCACHE_SIZE", "L2": "SC_LEVEL2_CACHE_SIZE",
             "L3": "SC_LEVEL3_CACHE_SIZE"}
    out = {}
    for key, name in names.items():
        try:
            out[key] = int(os.sysconf(name))
        except (ValueError, OSError, AttributeError):
            continue
    return out


def _floor_pow2(x):
    return 1 << (max(int(x), 1).bit_length() - 1)


# The most of a core's L2 the live score tiles take (score_tile).
TILE_L2_BYTES = 1 << 20


def score_tile(l2_bytes, itemsize, live_tiles=1):
    """``(rows, keys)`` of the score tile for a core with ``l2_bytes`` of L2 cache, when
    ``live_tiles`` tiles of ``itemsize``-byte scores are alive at once (the forward keeps one
    score tile, the backward P and dS).

    The live tiles fill the L2, up to :data:`TILE_L2_BYTES` of it: the matrix products and
    the softmax sweeps then stream over a tile that stays there. Within that budget the rows
    come first, up to 512 while the tile keeps at least 256 keys: each block of rows reads the
    keys and values once, and taller blocks give BLAS taller products (512 x 512 float32 ran
    5-11% faster than 256 x 512 on a 1 MiB-L2 core). Past 1 MiB a larger tile gains nothing:
    on a 2 MiB-L2 Intel core 1 MiB forward tiles ran 2-5% faster than tiles filling the L2,
    in float32 and float64 (docs/performance.md, machine C); the tile's products then pack
    and stream a score tile that leaves the keys, values and outputs no room. Keys are a
    power of two in [128, 1024].
    """
    l2_bytes = min(int(l2_bytes), TILE_L2_BYTES)
    budget = max(l2_bytes // (int(itemsize) * max(int(live_tiles), 1)), 1)
    rows = 512
    while rows > 64 and rows * 256 > budget:
        rows //= 2
    keys = min(max(_floor_pow2(budget // rows), 128), 1024)
    return rows, keys


# --------------------------------------------------------------------------------------------
# what a measured figure depends on


def machine():
    """A description of this machine for a benchmark's preamble: ``{"cpu": model name,
    "cores": count, "numba": target CPU and its widest vector instruction sets, "blas": library,
    version and kernel architecture per BLAS, "caches": cache_sizes()}``. Imports numba and
    threadpoolctl (benchmarks only; the engines never call this)."""
    return {"cpu": cpu_model(), "cores": workers(), "numba": _numba_target(),
            "blas": _blas_kernels(), "caches": cache_sizes()}


def cpu_model():
    """The CPU's model name (``/proc/cpuinfo``, else ``platform``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def _numba_target():
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return "numba not installed"
    features = set()
    for flag in llvm.get_host_cpu_features().flatten().split(","):
        if flag.startswith("+"):
            features.add(flag[1:])
    wanted = ["avx512f", "avx512bf16", "avx512fp16", "avx2", "fma", "neon", "sve"]
    present = [f for f in wanted if f in features]
    return f"{llvm.get_host_cpu_name()} ({', '.join(present) or 'no wide SIMD'})"


def blas_libraries() -> list[str]:
    """One line per BLAS library loaded (threadpoolctl): implementation, version, kernel set
    (the CPU architecture it chose), threads and its file (which package's copy it is)."""
    from threadpoolctl import threadpool_info

    return [f"{lib.get('internal_api')} {lib.get('version')} "
            f"({lib.get('architecture') or 'unknown'} kernels, {lib.get('num_threads')} "
            f"threads; {_short_path(lib.get('filepath'))})"
            for lib in threadpool_info() if lib.get("user_api") == "blas"]


def _short_path(path):
    """The file and its folder: which package's copy of a library it is (numpy.libs/...)."""
    if not path:
        return "unknown file"
    return "/".join(path.replace("\\", "/").split("/")[-2:])


def _blas_kernels():
    pinned = os.environ.get("OPENBLAS_CORETYPE")
    return "; ".join(blas_libraries()) + (f"; OPENBLAS_CORETYPE={pinned}" if pinned else "")
