"""Kernel arguments: one builder per kernel family, in signature order, with explicit C types.

CuPy validates nothing and passes a Python ``int`` as ``long long`` and a Python ``float`` as
``double``, so every scalar here is a NumPy scalar of the parameter's C type. Pure functions:
the arrays come from the Problem (NumPy or CuPy, through its own ``xp``); nothing here imports
CuPy or touches a device.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _semantics

__all__ = ["ATTENTION_FWD_SIGNATURE", "COMBINE_SIGNATURE", "OPERANDS", "SOFTMAX_SIGNATURE",
           "UNBOUNDED", "attention_fwd_arguments", "combine_arguments", "cp_async_aligned",
           "softmax_arguments"]

#: Window sides at or beyond this are "unbounded" for the kernel (64-bit arithmetic, no overflow).
UNBOUNDED = 1 << 60
#: Operand order of the kernel's ``offsets`` (nbatch, 5) and ``strides`` (5, 2) arrays.
OPERANDS = ("q", "k", "v", "bias", "mask")
#: cp.async moves 16-byte chunks: rows and data pointers must be aligned to this.
CP_ASYNC_BYTES = 16

#: Parameters of ``cuonline_attention_fwd`` and ``cuonline_attention_mma`` (one signature), in
#: order; the feature table names its kernel arguments among these.
ATTENTION_FWD_SIGNATURE = (
    "q", "k", "v", "bias", "mask", "kv_lengths", "alibi_slopes", "out", "lse", "offsets",
    "strides", "lq", "lk", "diagonal_offset", "scale", "softcap", "window_left", "window_right",
    "split_keys",
)
#: Parameters of ``cuonline_attention_combine``.
COMBINE_SIGNATURE = ("ws_out", "ws_lse", "out", "lse", "nrows", "n_splits")
#: Parameters of ``cuonline_softmax`` (the two segment kernels add the workspace and the
#: segment length after them).
SOFTMAX_SIGNATURE = ("x", "mask", "out", "layout", "row_ndim", "nrows", "n", "x_step",
                     "mask_step", "out_step", "rows_per_block", "scale")


def _element_offsets(x, batch_shape):
    """(nbatch,) int64 element offset of each batch element of view ``x``, or None when a
    stride is not a whole number of elements.

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
    same views :func:`attention_fwd_arguments` passes; a view needing a copy there is
    contiguous)."""
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


def attention_fwd_arguments(p, plan, out, lse):
    """The arguments of ``cuonline_attention_fwd`` and ``cuonline_attention_mma``
    (:data:`ATTENTION_FWD_SIGNATURE`), explicitly typed.

    ``out``/``lse`` are the final outputs, or the split workspaces when ``plan.n_splits > 1``.
    An option the call does not use passes its neutral value (a null pointer, an unbounded
    window side, a softcap of 1): the variant compiled without it never reads it.
    """
    xp = p.xp
    acc = np.dtype(p.acc_dtype).type
    nbatch = p.nbatch
    arrays, offsets, strides = {}, [], []
    for name in OPERANDS:
        x = getattr(p, name)
        if x is None:
            arrays[name] = None
            offsets.append(np.zeros(nbatch, dtype=np.int64))
            strides.append((0, 0))
            continue
        arrays[name], off, st = _operand(xp, x, p.batch_shape)
        offsets.append(off)
        strides.append(st)
    offsets = np.ascontiguousarray(np.stack(offsets, axis=1), dtype=np.int64)  # (nbatch, 5)
    strides = np.asarray(strides, dtype=np.int64).reshape(len(OPERANDS), 2)   # (5, 2)
    if xp is not np:
        offsets, strides = xp.asarray(offsets), xp.asarray(strides)
    if arrays["mask"] is not None and xp is np:
        arrays["mask"] = arrays["mask"].view(np.uint8)  # the kernel reads bytes (unsigned char*)
    # (nbatch,) arrays: with batch shape () these are 0-d (or, for a NumPy minimum, scalars),
    # and the kernel takes a pointer
    kv_lengths, slopes = (None if x is None else xp.ascontiguousarray(xp.reshape(x, (-1,)))
                          for x in (p.kv_lengths, p.alibi_slopes))
    left, right = p.window
    values = dict(
        arrays, kv_lengths=kv_lengths, alibi_slopes=slopes, out=out, lse=lse,
        offsets=offsets, strides=strides, lq=np.int32(p.lq), lk=np.int32(p.lk),
        diagonal_offset=np.int64(p.diagonal_offset),    # clamped to +-2**53 by validation
        scale=acc(p.scale), softcap=acc(p.softcap if p.softcap is not None else 1.0),
        window_left=np.int64(UNBOUNDED if left is None else left),
        window_right=np.int64(UNBOUNDED if right is None else right),
        split_keys=np.int64(plan.split_keys),
    )
    return tuple(values[name] for name in ATTENTION_FWD_SIGNATURE)


def combine_arguments(ws_out, ws_lse, out, lse, nrows, n_splits):
    """The arguments of ``cuonline_attention_combine`` (:data:`COMBINE_SIGNATURE`): the split
    workspaces ``(n_splits, nrows, Dv)`` and ``(n_splits, nrows)``, merged into ``out`` and
    ``lse`` (or None)."""
    return (ws_out, ws_lse, out, lse, np.int64(nrows), np.int32(n_splits))


def softmax_arguments(xp, x, mask, out, plan, scale):
    """The arguments of ``cuonline_softmax`` (:data:`SOFTMAX_SIGNATURE`), explicitly typed (the
    two segment kernels take the workspace and the segment length after them).

    ``x``, ``mask`` (or None) and ``out`` are views of one shape ``rows_shape + (n,)``.
    """
    acc = _semantics.accumulation_dtype(x.dtype).type
    views = (x, mask, out)
    steps = [(0,) * x.ndim if v is None else tuple(s // v.dtype.itemsize for s in v.strides)
             for v in views]
    # (row_ndim, 4): extent, then the x, mask and out element strides of each row dimension;
    # dimensions of extent 1 add nothing. A 1-d x is one row: a single dummy dimension.
    layout = [[extent, *(s[d] for s in steps)] for d, extent in enumerate(x.shape[:-1])
              if extent != 1] or [[1, 0, 0, 0]]
    layout = np.asarray(layout, dtype=np.int64)
    if xp is not np:
        layout = xp.asarray(layout)
    nrows = math.prod(x.shape[:-1])
    return (
        x, mask, out, layout, np.int32(layout.shape[0]), np.int64(nrows),
        np.int64(x.shape[-1]), *(np.int64(s[-1]) for s in steps),
        np.int32(plan.rows_per_block), acc(scale),
    )
