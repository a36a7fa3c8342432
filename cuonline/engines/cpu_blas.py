"""The CPU engines' matrix products: one function, :func:`product`, on the fastest BLAS that
this machine has.

NumPy's ``@`` reaches the BLAS NumPy was built with (OpenBLAS in the PyPI wheels). On some
machines another library is faster on the engines' tile shapes: on the Intel Xeon of
docs/performance.md (machine C), Intel MKL's single-threaded products were 1.2-1.35x
OpenBLAS's, which is the whole gap to torch's fused kernel there, itself built on MKL. So the
products go through CBLAS by ``ctypes`` to one of:

``openblas``
    NumPy's own OpenBLAS (the library threadpoolctl reports; its ``cblas_?gemm`` under the
    symbol names of the build, 64-bit integers where the build has them);
``mkl``
    Intel MKL from the ``mkl`` package (``pip install cuonline[mkl]``), set to its sequential
    layer (the engines run their own threads and hold the other BLAS to one thread each) and
    to conditional numerical reproducibility (``MKL_CBWR_AUTO``), under which a product
    rounds the same from run to run whatever the alignment of its operands (MKL's
    reproducibility conditions: a fixed thread count, here always one), so results stay the
    same for every ``workers``. MKL's *strict* mode adds only independence from the thread
    count, which a sequential product does not need, and cost 15-20% of the ``P v``
    product on machine C (docs/performance.md);
``numpy``
    NumPy's ``@`` itself.

Which one: ``$CUONLINE_CPU_BLAS`` (:func:`cuonline._environment.cpu_blas`) names it, or, by
default (``auto``), the candidates are timed once per machine on the forward tile's two
products, one thread each, CPU time of the calling thread, and the fastest kept (MKL only when
it is at least 5% ahead: both round correctly, and a library not loaded is one less to hold);
the choice is stored in ``$CUONLINE_CACHE_DIR/cpu/blas.json`` under the CPU model and the
libraries' versions, so later processes on the machine take the same library (and round the
same) without timing again. A product CBLAS cannot take as it is (an operand with strides in
both dimensions, an output that is not row-major, mixed dtypes, an empty dimension, an output
that overlaps an operand) goes to NumPy's ``@``: correct, at NumPy's speed.

Every library computes the IEEE products of the same inputs; they differ in the order of
their sums, so results on one machine may differ in the last bits from one library to
another, as they do from one machine to another.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from .. import _environment
from .._cache_files import write_json_atomically
from .cblas import NO_TRANS, ROW_MAJOR, layout_of
from .cpu_runtime import (ElementRun, cache_sizes, cpu_model, score_tile, single_threaded_blas,
                          tile_kernel)

__all__ = ["chosen", "compiled_task", "batch_index", "batch_addresses", "product", "available",
           "describe", "reset"]

# MKL's service functions (mkl_service.h)
_MKL_INTERFACE_LP64, _MKL_THREADING_SEQUENTIAL = 0, 1
_MKL_CBWR_AUTO, _MKL_CBWR_SUCCESS = 2, 0
# MKL must beat OpenBLAS by this much to be chosen over it
_MARGIN = 1.05


class Cblas:
    """``cblas_sgemm`` and ``cblas_dgemm`` of one loaded library, called by ctypes (which
    releases the GIL for the call, so the engines' threads run their products at once)."""

    #: True where the library runs each product on the calling thread alone (MKL's
    #: sequential layer), whatever NumPy's BLAS is held to
    sequential = False

    def __init__(self, name, handle, sgemm, dgemm, int_type, version, sequential=False):
        self.name, self.version = name, version
        self.sequential = sequential
        self._handle = handle                    # keeps the library loaded
        self.path = getattr(handle, "_name", "")
        # the largest size or leading dimension the library's integers hold
        self._int_max = 2 ** (8 * ctypes.sizeof(int_type) - 1) - 1
        self._gemm = {}
        for dtype, fn, real in ((np.float32, sgemm, ctypes.c_float),
                                (np.float64, dgemm, ctypes.c_double)):
            fn.restype = None
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, int_type, int_type,
                           int_type, real, ctypes.c_void_p, int_type, ctypes.c_void_p,
                           int_type, real, ctypes.c_void_p, int_type]
            self._gemm[np.dtype(dtype)] = fn
        # cblas_?gemm_batch_strided (MKL): a stack of products in one call
        self._batch = {}
        for dtype, symbol, real in ((np.float32, "cblas_sgemm_batch_strided", ctypes.c_float),
                                    (np.float64, "cblas_dgemm_batch_strided", ctypes.c_double)):
            fn = getattr(handle, symbol, None) if name == "mkl" else None
            if fn is not None:
                fn.restype = None
                fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, int_type, int_type,
                               int_type, real, ctypes.c_void_p, int_type, int_type,
                               ctypes.c_void_p, int_type, int_type, real, ctypes.c_void_p,
                               int_type, int_type, int_type]
                self._batch[np.dtype(dtype)] = fn

    @property
    def wide(self):
        """True where the library's integers are 64-bit."""
        return self._int_max > 2 ** 31

    def address(self, dtype):
        """The address of ``cblas_?gemm`` for ``dtype`` (compiled callers:
        :mod:`._task_kernels`), or None for another dtype."""
        fn = self._gemm.get(np.dtype(dtype))
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    def reads_rows(self, x, dtype):
        """True when ``x`` is a 2-d ``dtype`` array whose rows this library reads in place
        (compiled callers pass its address and row step): contiguous rows, aligned, a whole
        number of elements apart, no closer than a row's length, within the integers."""
        if x.dtype != dtype or x.ndim != 2 or 0 in x.shape or not x.flags.aligned:
            return False
        size, step = x.itemsize, x.strides[0]
        return ((x.strides[1] == size or x.shape[1] == 1) and step % size == 0
                and step >= x.shape[1] * size and max(step // size, *x.shape) <= self._int_max)

    def gemm(self, a, b, out, add):
        """``out = a @ b`` (``add``: ``out += a @ b``) when CBLAS can take the operands as
        they are; False (nothing done) when it cannot."""
        fn = self._gemm.get(out.dtype)
        if fn is None or a.dtype != out.dtype or b.dtype != out.dtype:
            return False
        m, k = a.shape
        n = b.shape[1]
        if m == 0 or n == 0 or k == 0 or not out.flags.writeable:
            return False
        ta, tb, oc = _layout(a), _layout(b), _layout(out)
        if ta is None or tb is None or oc is None or oc[0] != NO_TRANS:
            return False
        if max(m, n, k, ta[1], tb[1], oc[1]) > self._int_max:
            return False
        if np.may_share_memory(out, a) or np.may_share_memory(out, b):
            return False
        fn(ROW_MAJOR, ta[0], tb[0], m, n, k, 1.0, a.ctypes.data, ta[1], b.ctypes.data,
           tb[1], 1.0 if add else 0.0, out.ctypes.data, oc[1])
        return True


    def gemm_stack(self, a, b, out, add):
        """``out[i] = a[i] @ b[i]`` (``add``: ``+=``) of 3-d arrays in one call, where the
        library has a strided batch and each array steps by whole elements between matrices;
        False (nothing done) otherwise."""
        fn = self._batch.get(out.dtype)
        if fn is None or a.dtype != out.dtype or b.dtype != out.dtype or b.ndim != 3:
            return False
        g, m, k = a.shape
        n = b.shape[2]
        if g == 0 or m == 0 or n == 0 or k == 0 or not out.flags.writeable:
            return False
        layouts = [_layout(x[0]) for x in (a, b, out)]
        strides = [x.strides[0] // x.itemsize for x in (a, b, out)]
        if (any(x is None for x in layouts) or layouts[2][0] != NO_TRANS
                or any(x.strides[0] % x.itemsize or x.strides[0] < 0 for x in (a, b, out))
                or any(x.shape[0] > 1 and x.strides[0] == 0 for x in (a, b, out))
                or max(g, m, n, k, *strides, *(x[1] for x in layouts)) > self._int_max):
            return False
        if np.may_share_memory(out, a) or np.may_share_memory(out, b):
            return False
        (ta, lda), (tb, ldb), (_, ldc) = layouts
        fn(ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, strides[0], b.ctypes.data,
           ldb, strides[1], 1.0 if add else 0.0, out.ctypes.data, ldc, strides[2], g)
        return True


def _layout(x):
    """``(transpose flag, leading dimension)`` of a 2-d array as row-major CBLAS reads it, or
    None when neither of its dimensions is contiguous (or its data is misaligned)."""
    if not x.flags.aligned:
        return None
    flag, ld = layout_of(x.shape[0], x.shape[1], x.strides[0], x.strides[1], x.itemsize)
    return None if flag == 0 else (flag, ld)


def product(a, b, out=None, *, add=False):
    """``a @ b`` of 2-d ``a`` (m, k) and ``b`` (k, n) on the chosen BLAS.

    ``out``: an (m, n) array to write the product into, or (``add=True``) to add it to, in
    one pass (no temporary); returned. Without ``out`` a new C-ordered array of the operands'
    dtype is returned. 3-d operands are a stack of products (MKL's strided batch in one call,
    NumPy's batched matmul where the library is NumPy's own, else one call per element).
    """
    if a.ndim == 3:
        blas = chosen()
        if blas is None or blas.name == "openblas":
            # NumPy's batched matmul calls the same OpenBLAS per element, without a Python
            # call each (which costs as much as a 128 x 64 x 128 product)
            if out is None:
                return np.matmul(a, b)
            if add:
                out += np.matmul(a, b)
            else:
                np.matmul(a, b, out=out)
            return out
        if out is None:
            out = np.empty((a.shape[0], a.shape[1], b.shape[-1]),
                           dtype=np.result_type(a, b))
        if blas.gemm_stack(a, b, out, add):
            return out
        for i in range(a.shape[0]):
            product(a[i], b[i] if b.ndim == 3 else b, out[i], add=add)
        return out
    if out is None:
        if add:
            raise ValueError("product(add=True) needs out= to add to")
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    blas = chosen()
    if blas is not None and blas.gemm(a, b, out, add):
        return out
    if add:
        out += a @ b
    else:
        np.matmul(a, b, out=out)
    return out


# --------------------------------------------------------------------------------------------
# the libraries


def _numpy_openblas():
    """NumPy's OpenBLAS through CBLAS, or None (NumPy on another BLAS, or symbols not found)."""
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415
    except ImportError:
        return None
    found = [info for info in threadpool_info()
             if info.get("internal_api") == "openblas" and info.get("filepath")]
    # NumPy's own copy first: SciPy (numba loads it) may bring another, of another version
    found.sort(key=lambda info: not _is_numpys(info["filepath"]))
    for info in found:
        try:
            handle = ctypes.CDLL(info["filepath"])
        except OSError:
            continue
        # the scipy-openblas wheels prefix every symbol and suffix 64-bit-integer ones
        for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("scipy_", ""), ("", "")):
            try:
                sgemm = getattr(handle, f"{prefix}cblas_sgemm{suffix}")
                dgemm = getattr(handle, f"{prefix}cblas_dgemm{suffix}")
            except AttributeError:
                continue
            wide = suffix == "64_" or _openblas_is_ilp64(handle, prefix, suffix)
            return Cblas("openblas", handle, sgemm, dgemm,
                         ctypes.c_int64 if wide else ctypes.c_int,
                         f"openblas {info.get('version')}")
    return None


def _is_numpys(path):
    """True for a library of NumPy's wheel: in ``numpy.libs`` (Linux, Windows) or in NumPy's
    own folder (``numpy/.dylibs`` on macOS)."""
    path = Path(path).resolve()
    return path.parent.name == "numpy.libs" or Path(np.__file__).resolve().parent in path.parents


def _openblas_is_ilp64(handle, prefix, suffix):
    """True when the OpenBLAS build says it takes 64-bit integers (``USE64BITINT``)."""
    try:
        config = getattr(handle, f"{prefix}openblas_get_config{suffix}")
    except AttributeError:
        return False
    config.restype = ctypes.c_char_p
    return b"USE64BITINT" in (config() or b"")


def _mkl_library_paths():
    """Where ``libmkl_rt`` may be: the environment's ``lib`` (the ``mkl`` wheel puts it
    there), then the loader's own search."""
    names = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so", "libmkl_rt.dylib",
             "mkl_rt.2.dll", "mkl_rt.dll")
    roots = {Path(sys.prefix) / "lib", Path(sys.prefix) / "Library" / "bin",
             Path(sys.base_prefix) / "lib"}
    paths = [str(root / name) for root in roots for name in names if (root / name).exists()]
    found = ctypes.util.find_library("mkl_rt")
    return paths + ([found] if found else [])


def _mkl():
    """Intel MKL, sequential and reproducible, or None (not installed, or already set up
    otherwise by another library in this process)."""
    for path in _mkl_library_paths():
        try:
            handle = ctypes.CDLL(path)
            sgemm, dgemm = handle.cblas_sgemm, handle.cblas_dgemm
            setters = (handle.MKL_Set_Interface_Layer, handle.MKL_Set_Threading_Layer,
                       handle.MKL_CBWR_Set)
        except (OSError, AttributeError):
            continue
        for fn in setters:
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
        # each returns the layer in force: another, when MKL was already in use here
        if (setters[0](_MKL_INTERFACE_LP64) != _MKL_INTERFACE_LP64
                or setters[1](_MKL_THREADING_SEQUENTIAL) != _MKL_THREADING_SEQUENTIAL):
            continue
        if setters[2](_MKL_CBWR_AUTO) != _MKL_CBWR_SUCCESS:
            continue
        return Cblas("mkl", handle, sgemm, dgemm, ctypes.c_int, f"mkl {_mkl_version(handle)}",
                     sequential=True)
    return None


def _mkl_version(handle):
    try:
        fn = handle.mkl_get_version_string
    except AttributeError:
        return "unknown"
    buffer = ctypes.create_string_buffer(256)
    fn.restype, fn.argtypes = None, [ctypes.c_char_p, ctypes.c_int]
    fn(buffer, len(buffer))
    text = buffer.value.decode(errors="replace")
    found = re.search(r"Version (\S+)", text)       # "... Library Version 2026.2-Product ..."
    return found.group(1).split("-")[0] if found else text.strip()


_LOADERS = {"openblas": _numpy_openblas, "mkl": _mkl}
_loaded: dict = {}
_lock = threading.Lock()              # the loaded libraries
_choose_lock = threading.Lock()       # the choice
_choice: list = []        # [Cblas or None] once chosen


def available(name):
    """The library ``name`` (``"openblas"`` or ``"mkl"``) loaded for CBLAS, or None where
    this machine does not have it. Loaded once per process."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _LOADERS[name]()
        return _loaded[name]


def compiled_task(dtype, name, operands):
    """``(library, kernel)`` for a compiled task loop that calls CBLAS itself
    (:mod:`._task_kernels`' ``name``, compiled for ``dtype``) on the 2-d ``operands``, passed
    to it as row-0 addresses and row steps: the chosen library when it is a CBLAS and reads
    every operand's rows in place, and the kernel where it compiles; None otherwise (the
    engines' Python loops then run)."""
    blas = chosen()
    if blas is None or not all(blas.reads_rows(x, dtype) for x in operands):
        return None
    kernel = tile_kernel(dtype, name)
    return None if kernel is None else (blas, kernel)


def batch_index(elements):
    """The batch ``elements`` (index tuples, or a :class:`.cpu_runtime.ElementRun` of them)
    as an int64 array, one row per element."""
    if isinstance(elements, ElementRun):
        return elements.indices()
    return np.array(elements, dtype=np.int64).reshape(len(elements), -1)


def batch_addresses(x, elements):
    """The addresses of the matrices ``x[b]`` of the batch ``elements`` (as
    :func:`batch_index` takes them, or its array) of an array ``x`` of shape ``S + (L, D)``,
    as int64; an axis of ``S`` of length 1 is taken as broadcast (index 0 whatever ``b``
    says: the slot of a gradient buffer)."""
    if isinstance(elements, ElementRun):
        found = elements.addresses(x)
        if found is not None:                   # a run whose batch axes merge: no index
            return found
    index = elements if isinstance(elements, np.ndarray) else batch_index(elements)
    lead = index.shape[1]
    strides = np.array([0 if n == 1 else s for n, s in zip(x.shape[:lead], x.strides[:lead])],
                       dtype=np.int64)
    return x.ctypes.data + index @ strides


def chosen():
    """The library the products go to (a :class:`Cblas`), or None for NumPy's ``@``: by
    ``$CUONLINE_CPU_BLAS``, else measured once per machine (see the module docstring). The
    first call decides, in one thread: the engines' other threads wait for its choice rather
    than time the libraries beside it."""
    if _choice:
        return _choice[0]
    with _choose_lock:
        if not _choice:
            _choice.append(_decide())
        return _choice[0]


def _decide():
    wanted = _environment.cpu_blas()
    if wanted == "numpy":
        return None
    if wanted == "auto":
        return _measured_choice()
    blas = available(wanted)
    if blas is None:
        raise ValueError(
            f"environment variable CUONLINE_CPU_BLAS={wanted!r}: {wanted} is not "
            "available in this process"
            + (" (pip install cuonline[mkl], or mkl from conda)" if wanted == "mkl" else
               " (NumPy here is not built on OpenBLAS)"))
    return blas


def reset():
    """Forget the choice (tests: the next product reads ``$CUONLINE_CPU_BLAS`` again)."""
    with _choose_lock:
        _choice.clear()


def describe():
    """The chosen library and how it was chosen, in one line (``python -m cuonline info``,
    the benchmarks' preamble)."""
    blas = chosen()
    how = _environment.cpu_blas()
    how = "measured on this machine" if how == "auto" else f"CUONLINE_CPU_BLAS={how}"
    if blas is None:
        return f"numpy's matmul ({how})"
    return f"{blas.version} by CBLAS, {blas.path} ({how})"


# --------------------------------------------------------------------------------------------
# the measured choice


def _measured_choice():
    candidates = [b for b in (available("openblas"), available("mkl")) if b is not None]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    # a KVM guest may report a vague model name: its L2 tells more machines apart
    key = {"cpu": cpu_model(), "L2": cache_sizes()["L2"],
           "libraries": sorted(b.version for b in candidates)}
    path = _environment.cache_dir("cpu") / "blas.json"
    stored = _read_choice(path, key)
    if stored is not None:
        return next((b for b in candidates if b.name == stored), None)
    times = {b.name: _seconds(b) for b in candidates}
    best = "mkl" if times["mkl"] * _MARGIN < times["openblas"] else "openblas"
    _store_choice(path, {**key, "choice": best, "seconds": times})
    return next(b for b in candidates if b.name == best)


def _seconds(blas):
    """CPU time of the calling thread for the forward tile's two products (float32, the
    machine's tile, D = 64) on ``blas``, best of three rounds; BLAS held to one thread."""
    rows, keys = score_tile(cache_sizes()["L2"], 4, live_tiles=1)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((rows, 64), dtype=np.float32)
    k = rng.standard_normal((keys, 64), dtype=np.float32)
    s = np.empty((rows, keys), dtype=np.float32)
    o = np.zeros((rows, 64), dtype=np.float32)
    best = float("inf")
    with single_threaded_blas():
        for _ in range(4):                       # the first round warms the library up
            start = time.thread_time()
            for _ in range(3):
                blas.gemm(q, k.T, s, False)
                blas.gemm(s, k, o, True)
            best = min(best, time.thread_time() - start)
    return best


def _read_choice(path, key):
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or any(doc.get(k) != v for k, v in key.items()):
        return None
    return doc.get("choice") if doc.get("choice") in _LOADERS else None


def _store_choice(path, doc):
    """Write the choice for later processes; a cache that cannot be written is skipped with
    a warning (this process keeps its choice)."""
    try:
        write_json_atomically(path, doc)
    except OSError as exc:
        warnings.warn(f"cuonline: could not store the CPU BLAS choice in {path}: {exc}",
                      RuntimeWarning, stacklevel=3)


def _after_fork():
    global _lock, _choose_lock
    _lock, _choose_lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
