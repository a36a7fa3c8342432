"""The CUDA engine: our kernels on CuPy arrays (``backend="cupy"``) or emulated on the CPU with
NumPy arrays (``backend="emulate"``).

One code path for both: plan (pure heuristics) -> a kernel spec
(:class:`~cuonline.kernels.specs.KernelSpec` for the SIMT family,
:class:`~cuonline.kernels.specs.MmaSpec` for the tensor-core family; both take the same
arguments) -> source text -> module -> typed arguments -> launch. Only the module differs: a
``cupy.RawModule`` compiled by NVRTC (memoized per device and spec; no ``name_expressions`` so
CuPy's on-disk cache applies) or :func:`cuonline.testing.emulate.compile_module` of the very
same text. CuPy is imported lazily: ``import cuonline`` never imports it.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np

from ..kernels import heuristics, source, tuning
from ..kernels.specs import MAX_HEAD_DIM

__all__ = ["attention"]

#: Window sides at or beyond this are "unbounded" for the kernel (64-bit arithmetic, no overflow).
UNBOUNDED = 1 << 60
#: Operand order of the kernel's ``offsets`` (nbatch, 5) and ``strides`` (5, 2) arrays.
OPERANDS = ("q", "k", "v", "bias", "mask")
COMBINE_WARPS = 4  # kWarps in attention_combine.cuh
#: cp.async moves 16-byte chunks: rows and data pointers must be aligned to this.
CP_ASYNC_BYTES = 16

_modules = {}
_modules_lock = threading.Lock()


def attention(problem, *, num_sms=None, n_splits=None, kernel_sources=None,
              emulate_options=None, family=None, arch=None, tuned=None):
    """Run :class:`cuonline._validate.Problem` ``problem``; return ``(out, lse or None)``.

    ``out`` has the dtype of the inputs and shape ``batch_shape + (lq, dv)``; ``lse`` the
    accumulation dtype and shape ``batch_shape + (lq,)``. The keyword arguments are seams for
    tests: ``num_sms`` and ``n_splits`` steer the planner, ``kernel_sources`` maps kernel file
    names to replacement texts (deliberately broken copies), ``emulate_options`` are passed to
    :func:`cuonline.testing.emulate.compile_module` (``mode``, ``tsan``), ``family`` forces
    ``"attention_fwd"`` (SIMT) or ``"attention_mma"`` (tensor cores) and ``arch`` the tile
    table (default: the current GPU's, ``"sm_90"`` under the emulation). ``tuned`` maps
    ``(family, dtype, D bucket)`` to tiles (see :func:`cuonline.kernels.heuristics.tuned_tiles`):
    ``python -m cuonline tune`` forces each candidate through it; None takes the winners stored
    for the current GPU (``backend="cupy"``; the emulation keeps the built-in tiles) and ``{}``
    the built-in tiles.
    """
    p = problem
    if p.backend not in ("cupy", "emulate"):
        raise ValueError(f"the CUDA engine runs backend 'cupy' or 'emulate', got {p.backend!r}")
    xp = p.xp
    out_shape = p.batch_shape + (p.lq, p.dv)
    lse_shape = p.batch_shape + (p.lq,)
    if p.nbatch == 0 or p.lq == 0 or p.lk == 0 or (p.dv == 0 and not p.return_lse):
        # Nothing to launch: no keys means every row is fully masked (out 0, lse -inf).
        out = xp.zeros(out_shape, dtype=p.dtype)
        lse = xp.full(lse_shape, -np.inf, dtype=p.acc_dtype)
        return out, (lse if p.return_lse else None)
    if p.d == 0 or p.dv == 0:
        # No kernel takes an empty head, and the contract needs no special case: D = 0 makes
        # every q·k exactly 0, as one column of zeros in q and k does; Dv = 0 still has an lse,
        # which one column of zeros in v leaves unchanged (that out column is dropped). The
        # zeros are broadcast views: nothing of the batch size is allocated.
        def zeros(rows):
            return xp.broadcast_to(xp.zeros((1, 1), dtype=p.dtype), p.batch_shape + (rows, 1))

        padded = p
        if p.d == 0:
            padded = dataclasses.replace(padded, d=1, q=zeros(p.lq), k=zeros(p.lk))
        if p.dv == 0:
            padded = dataclasses.replace(padded, dv=1, v=zeros(p.lk))
        out, lse = attention(padded, num_sms=num_sms, n_splits=n_splits,
                             kernel_sources=kernel_sources, emulate_options=emulate_options,
                             family=family, arch=arch, tuned=tuned)
        return (out[..., :0] if p.dv == 0 else out), lse
    if max(p.d, p.dv) > MAX_HEAD_DIM:
        raise ValueError(
            f"the CUDA engine supports head dimensions up to {MAX_HEAD_DIM}, got D = {p.d}, "
            f"Dv = {p.dv}; use backend='numpy' or split the head dimension"
        )
    if max(p.lq, p.lk) >= 2**31:
        raise ValueError(f"Lq and Lk must be below 2**31, got Lq = {p.lq}, Lk = {p.lk}")

    if num_sms is None:
        num_sms = _num_sms() if p.backend == "cupy" else heuristics.DEFAULT_NUM_SMS
    if arch is None:
        arch = _arch() if p.backend == "cupy" else heuristics.DEFAULT_ARCH
    if tuned is None:
        tuned = tuning.current_device_winners() if p.backend == "cupy" else {}
    plan = heuristics.plan_attention(p, num_sms=num_sms, n_splits=n_splits, arch=arch,
                                     cp_async=cp_async_aligned(p), family=family, tuned=tuned)
    module = _module(plan.spec, p.backend, kernel_sources, emulate_options)
    return _launch(p, plan, module)


# --------------------------------------------------------------------------------------------
# modules


def _module(spec, backend, kernel_sources, emulate_options):
    text = source.build_source(spec, overrides=kernel_sources)
    if backend == "emulate":
        from ..testing import emulate  # noqa: PLC0415 - g++ only when asked for

        return emulate.compile_module(text, **(emulate_options or {}))
    import cupy  # noqa: PLC0415

    key = (cupy.cuda.Device().id, spec.key, hash(text) if kernel_sources else None)
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            # Compiled lazily at the first get_function; no name_expressions, so CuPy's on-disk
            # cache (keyed by the text and options) serves later processes.
            module = cupy.RawModule(code=text, options=_cupy_options())
            _modules[key] = module
    return module


def _cupy_options():
    from ..kernels.nvrtc import cuda_include_dir  # noqa: PLC0415

    options = ["-std=c++17"]
    include = cuda_include_dir()
    if include is not None:
        options.append(f"-I{include}")
    return tuple(options)


def _arch():
    import cupy  # noqa: PLC0415

    return f"sm_{cupy.cuda.Device().compute_capability}"


def _num_sms():
    import cupy  # noqa: PLC0415

    device = cupy.cuda.Device()
    return int(device.attributes["MultiProcessorCount"])


# --------------------------------------------------------------------------------------------
# arguments and launch


def _element_offsets(x, batch_shape):
    """(nbatch,) int64 element offset of each batch element of view ``x``, and whether usable.

    ``x`` is a view broadcast to ``batch_shape + (rows, cols)``: its byte strides (zero where
    broadcast, negative for reversed views) turn into element offsets from its first element.
    """
    itemsize = x.dtype.itemsize
    strides = x.strides
    if any(s % itemsize for s in strides):
        return None
    offsets = np.zeros(batch_shape, dtype=np.int64)
    for axis, (n, stride) in enumerate(zip(batch_shape, strides)):
        shape = [1] * len(batch_shape)
        shape[axis] = n
        offsets = offsets + (np.arange(n, dtype=np.int64) * (stride // itemsize)).reshape(shape)
    return offsets.reshape(-1)


def _operand(xp, x, batch_shape):
    """Return ``(array, offsets, (row_stride, col_stride))`` for the kernel, copying only
    when a stride is not a whole number of elements."""
    offsets = _element_offsets(x, batch_shape)
    if offsets is None:
        x = xp.ascontiguousarray(x)
        offsets = _element_offsets(x, batch_shape)
    itemsize = x.dtype.itemsize
    return x, offsets, (x.strides[-2] // itemsize, x.strides[-1] // itemsize)


def _data_address(x) -> int:
    if isinstance(x, np.ndarray):
        return x.ctypes.data
    return int(x.data.ptr)  # cupy


def cp_async_aligned(p) -> bool:
    """Whether q, k and v can go global -> shared by 16-byte cp.async: unit column stride, and
    the data pointer, every batch offset and the row stride whole multiples of 16 bytes (the
    same views :func:`kernel_arguments` passes; a view needing a copy there is contiguous)."""
    for name in ("q", "k", "v"):
        x = getattr(p, name)
        itemsize = x.dtype.itemsize
        offsets = _element_offsets(x, p.batch_shape)
        if offsets is None or x.strides[-1] != itemsize:
            return False
        chunk = CP_ASYNC_BYTES // itemsize
        if _data_address(x) % CP_ASYNC_BYTES or (x.strides[-2] // itemsize) % chunk:
            return False
        if offsets.size and np.any(offsets % chunk):
            return False
    return True


def kernel_arguments(p, plan, out, lse):
    """The argument tuple of ``cuonline_attention_fwd`` (and of ``cuonline_attention_mma``, which
    has the same signature), in signature order, explicitly typed.

    ``out``/``lse`` are the final outputs, or the split workspaces when ``plan.n_splits > 1``.
    """
    xp = p.xp
    acc = np.dtype(p.acc_dtype).type
    nbatch = p.nbatch
    arrays, offsets, strides = [], [], []
    for name in OPERANDS:
        x = getattr(p, name)
        if x is None:
            arrays.append(None)
            offsets.append(np.zeros(nbatch, dtype=np.int64))
            strides.append((0, 0))
            continue
        x, off, st = _operand(xp, x, p.batch_shape)
        arrays.append(x)
        offsets.append(off)
        strides.append(st)
    offsets = np.ascontiguousarray(np.stack(offsets, axis=1), dtype=np.int64)  # (nbatch, 5)
    strides = np.asarray(strides, dtype=np.int64).reshape(len(OPERANDS), 2)   # (5, 2)
    if xp is not np:
        offsets, strides = xp.asarray(offsets), xp.asarray(strides)
    left, right = p.window
    q, k, v, bias, mask = arrays
    if mask is not None and xp is np:
        mask = mask.view(np.uint8)  # the kernel reads bytes (unsigned char*)
    # (nbatch,) arrays: with batch shape () these are 0-d (or, for a NumPy minimum, scalars),
    # and the kernel takes a pointer
    kv_lengths, slopes = (None if x is None else xp.ascontiguousarray(xp.reshape(x, (-1,)))
                          for x in (p.kv_lengths, p.alibi_slopes))
    return (
        q, k, v, bias, mask, kv_lengths, slopes, out, lse, offsets, strides,
        np.int32(p.lq), np.int32(p.lk),
        acc(p.scale), acc(p.softcap if p.softcap is not None else 1.0),
        np.int64(UNBOUNDED if left is None else left),
        np.int64(UNBOUNDED if right is None else right),
        np.int64(plan.split_keys),
    )


def _launch(p, plan, module):
    xp = p.xp
    spec = plan.spec
    out_shape = p.batch_shape + (p.lq, p.dv)
    lse_shape = p.batch_shape + (p.lq,)
    out = xp.empty(out_shape, dtype=p.dtype)
    lse = xp.empty(lse_shape, dtype=p.acc_dtype) if p.return_lse else None
    if plan.n_splits > 1:
        # Partial, already normalised (out, lse) per split, merged by the combine kernel.
        ws_out = xp.empty((plan.n_splits, p.nbatch, p.lq, p.dv), dtype=p.acc_dtype)
        ws_lse = xp.empty((plan.n_splits, p.nbatch, p.lq), dtype=p.acc_dtype)
        args = kernel_arguments(p, plan, ws_out, ws_lse)
    else:
        args = kernel_arguments(p, plan, out, lse)

    fwd = module.get_function(spec.entry)
    if plan.shared_bytes > heuristics.SMEM_NO_OPT_IN:
        fwd.max_dynamic_shared_size_bytes = plan.shared_bytes
    fwd(plan.grid, plan.block, args, shared_mem=plan.shared_bytes)

    if plan.n_splits > 1:
        nrows = p.nbatch * p.lq
        combine = module.get_function(spec.combine_entry)
        combine((math.ceil(nrows / COMBINE_WARPS), 1, 1), (32 * COMBINE_WARPS, 1, 1),
                (ws_out, ws_lse, out, lse, np.int64(nrows), np.int32(plan.n_splits)))
    return out, lse
