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
from . import varlen

__all__ = ["ATTENTION_BWD_SIGNATURE", "ATTENTION_FWD_SIGNATURE", "BWD_BUFFERS", "COMBINE_BUFFERS",
           "COMBINE_SIGNATURE", "FWD_BUFFERS", "OPERANDS", "SOFTMAX_BUFFERS", "SOFTMAX_SIGNATURE",
           "UNBOUNDED", "attention_bwd_arguments", "attention_fwd_arguments", "buffers_of",
           "combine_arguments", "cp_async_aligned", "score_arguments", "softmax_arguments",
           "view_cp_async_aligned"]

#: Window sides at or beyond this are "unbounded" for the kernel (64-bit arithmetic, no overflow).
UNBOUNDED = 1 << 60
#: Operand order of the kernel's ``offsets`` (nbatch, 8) and ``strides`` (8, 2) arrays
#: (``operand::`` in attention_score.cuh). ``rel_bias`` goes as one row: (1, R) per batch element.
OPERANDS = ("q", "k", "v", "bias", "mask", "rel_bias", "rel_q", "rel_k")
#: cp.async moves 16-byte chunks: rows and data pointers must be aligned to this.
CP_ASYNC_BYTES = 16

#: Parameters of ``cuonline_attention_fwd`` and ``cuonline_attention_mma`` (one signature), in
#: order; the feature table names its kernel arguments among these.
ATTENTION_FWD_SIGNATURE = (
    "q", "k", "v", "bias", "mask", "kv_lengths", "alibi_slopes", "rel_bias", "rel_q", "rel_k",
    "out", "lse", "offsets", "strides", "lq", "lk", "diagonal_offset", "scale", "softcap",
    "window_left", "window_right", "split_keys", "bias_block_rows", "bias_block_cols",
    "rel_bias_radius", "rel_k_radius", "varlen_tiles", "varlen_seqs", "varlen_n_tiles",
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
    return all(view_cp_async_aligned(getattr(p, name), p.batch_shape) for name in ("q", "k", "v"))


def view_cp_async_aligned(x, batch_shape) -> bool:
    """Whether view ``x`` (broadcast to ``batch_shape + (rows, cols)``) can go global ->
    shared by 16-byte cp.async (see :func:`cp_async_aligned`; the backward asks it of dout
    too)."""
    itemsize = x.dtype.itemsize
    strides = x.strides
    if any(s % itemsize for s in strides) or strides[-1] != itemsize:
        return False
    chunk = CP_ASYNC_BYTES // itemsize
    if _data_address(x) % CP_ASYNC_BYTES or (strides[-2] // itemsize) % chunk:
        return False
    # every batch offset (a sum of multiples of the batch strides) is a whole number of
    # chunks iff the stride of each batch axis of more than one element is: no offset table
    # is built here (the argument builder builds it once)
    if 0 in batch_shape:
        return True
    return all((s // itemsize) % chunk == 0 for n, s in zip(batch_shape, strides) if n > 1)


#: The kernels index the relative tables in 32 bits (row = radius + clipped delta <= 2 radius):
#: radius (R - 1) / 2 below 2**30.
MAX_REL_RADIUS = 2**30 - 1


def _radius(radius, name):
    if radius > MAX_REL_RADIUS:
        raise ValueError(f"`{name}` must have at most {2 * MAX_REL_RADIUS + 1} relative "
                         f"positions on the CUDA engine, got {2 * radius + 1}")
    return np.int32(radius)


def buffers_of(buffers, names, family) -> dict:
    """``buffers`` (a mapping) as ``{name: array}`` in the order of ``names``: the arrays a
    ``family``'s kernels write or read beyond the problem. TypeError naming both when its keys
    are not exactly ``names``."""
    if set(buffers) != set(names):
        raise TypeError(f"{family}'s arguments take the buffers {', '.join(names)}, got "
                        f"{', '.join(sorted(buffers))}")
    return {name: buffers[name] for name in names}


def _score_values(p, extra=()):
    """The values every attention kernel takes from the problem, by parameter name: the score
    operands (:data:`OPERANDS`, then the ``(name, view)`` pairs ``extra``: the backward's
    dout), their offset table ``(nbatch, operands)`` and strides ``(operands, 2)`` (int64
    NumPy arrays: :func:`_ordered` moves them to the device once they are final), and the
    option scalars, explicitly typed.

    An option the call does not use passes its neutral value (a null pointer, an unbounded
    window side, a softcap of 1): the variant compiled without it never reads it.
    """
    xp = p.xp
    acc = np.dtype(p.acc_dtype).type
    nbatch = p.nbatch
    arrays, offsets, strides = {}, [], []
    for name, x in [(name, getattr(p, name)) for name in OPERANDS] + list(extra):
        if name == "rel_bias" and x is not None:
            if x.strides[-1] != x.dtype.itemsize:
                # the kernels read rel_bias rows with unit stride (attention_score.cuh)
                x = xp.ascontiguousarray(x)
            x = x[..., None, :]              # batch_shape + (1, R): a view, one row
        if name in ("rel_q", "rel_k") and p.dr == 0:
            x = None                         # Dr = 0: the term is 0, no variant reads it
        if x is None:
            arrays[name] = None
            offsets.append(np.zeros(nbatch, dtype=np.int64))
            strides.append((0, 0))
            continue
        arrays[name], off, st = _operand(xp, x, p.batch_shape)
        offsets.append(off)
        strides.append(st)
    offsets = np.ascontiguousarray(np.stack(offsets, axis=1), dtype=np.int64)
    strides = np.asarray(strides, dtype=np.int64).reshape(len(strides), 2)
    if arrays["mask"] is not None and xp is np:
        arrays["mask"] = arrays["mask"].view(np.uint8)  # the kernel reads bytes (unsigned char*)
    # (nbatch,) arrays: with batch shape () these are 0-d (or, for a NumPy minimum, scalars),
    # and the kernel takes a pointer
    kv_lengths, slopes = (None if x is None else xp.ascontiguousarray(xp.reshape(x, (-1,)))
                          for x in (p.kv_lengths, p.alibi_slopes))
    left, right = p.window
    # a block taller (wider) than the queries (keys) is one block: clipped, the sizes fit int32
    rows, cols = p.bias_block if p.bias_block is not None else (1, 1)
    rows, cols = min(rows, max(p.lq, 1)), min(cols, max(p.lk, 1))
    return dict(
        arrays, kv_lengths=kv_lengths, alibi_slopes=slopes,
        offsets=offsets, strides=strides, lq=np.int32(p.lq), lk=np.int32(p.lk),
        diagonal_offset=np.int64(p.diagonal_offset),    # clamped to +-2**53 by validation
        scale=acc(p.scale), softcap=acc(p.softcap if p.softcap is not None else 1.0),
        window_left=np.int64(UNBOUNDED if left is None else left),
        window_right=np.int64(UNBOUNDED if right is None else right),
        bias_block_rows=np.int32(rows), bias_block_cols=np.int32(cols),
        rel_bias_radius=_radius(p.rel_bias_radius, "rel_bias"),
        rel_k_radius=_radius(p.rel_k_radius, "rel_k"),
        varlen_tiles=None, varlen_seqs=None, varlen_n_tiles=np.int32(0),
    )


#: The index tables the builders make on the host, moved to the device once they are final.
_HOST_TABLES = ("offsets", "strides", "varlen_tiles", "varlen_key_tiles", "varlen_seqs")


def _ordered(xp, values, signature) -> tuple:
    """``values`` in ``signature`` order, the host tables (:data:`_HOST_TABLES`) on ``xp``'s
    device."""
    if xp is not np:
        values = dict(values, **{name: xp.asarray(values[name]) for name in _HOST_TABLES
                                 if values.get(name) is not None})
    return tuple(values[name] for name in signature)


def score_arguments(p, signature) -> tuple:
    """The problem's values that ``signature`` names, in its order (a subset of
    :data:`ATTENTION_FWD_SIGNATURE`): the score operands, their offsets and strides and the
    option scalars, for a kernel that takes no more from the problem (the statistics
    kernels' common head)."""
    return _ordered(p.xp, _score_values(p), signature)


def _varlen_values(table, offsets, strides, operands, q_side):
    """A packed batch's offset table (a row per (sequence, batch element), the ``q_side``
    operands moved to the sequence's first query, k and v to its first key:
    :func:`cuonline.kernels.varlen.expand_offsets`) and the arguments of its
    :class:`cuonline.kernels.varlen.TileTable` ``table``, on the host."""
    return dict(offsets=varlen.expand_offsets(offsets, strides, table, operands, q_side,
                                              ("k", "v")),
                varlen_tiles=table.tiles, varlen_seqs=table.seqs,
                varlen_n_tiles=np.int32(len(table)))


#: The arrays the forward kernels write (the ``buffers`` of :func:`attention_fwd_arguments`).
FWD_BUFFERS = ("out", "lse")


def attention_fwd_arguments(problem, plan, buffers):
    """The arguments of ``cuonline_attention_fwd`` and ``cuonline_attention_mma``
    (:data:`ATTENTION_FWD_SIGNATURE`), explicitly typed.

    ``buffers`` holds :data:`FWD_BUFFERS`: ``out`` and ``lse`` (or None), the final outputs
    or, when ``plan.n_splits > 1``, the split workspaces. A packed batch takes its block table
    from ``plan.varlen``.
    """
    values = dict(_score_values(problem),
                  **buffers_of(buffers, FWD_BUFFERS, "attention forward"),
                  split_keys=np.int64(plan.split_keys))
    if plan.varlen is not None:
        values.update(_varlen_values(plan.varlen, values["offsets"], values["strides"],
                                     OPERANDS, ("q", "rel_q")))
    return _ordered(problem.xp, values, ATTENTION_FWD_SIGNATURE)


#: The arrays the split-key combine reads and writes (the ``buffers`` of
#: :func:`combine_arguments`).
COMBINE_BUFFERS = ("ws_out", "ws_lse", "out", "lse")


def combine_arguments(problem, plan, buffers):
    """The arguments of ``cuonline_attention_combine`` (:data:`COMBINE_SIGNATURE`):
    ``buffers`` holds :data:`COMBINE_BUFFERS`, the split workspaces ``ws_out`` ``(n_splits,
    nrows, Dv)`` and ``ws_lse`` ``(n_splits, nrows)`` merged into ``out`` and ``lse`` (or
    None); ``plan`` is the :class:`cuonline.kernels.heuristics.CombinePlan`."""
    arrays = buffers_of(buffers, COMBINE_BUFFERS, "attention_combine")
    return (*arrays.values(), np.int64(plan.nrows), np.int32(plan.n_splits))


#: The views the softmax kernels read and write (the ``buffers`` of
#: :func:`softmax_arguments`).
SOFTMAX_BUFFERS = ("x", "mask", "out")


def softmax_arguments(problem, plan, buffers):
    """The arguments of ``cuonline_softmax`` (:data:`SOFTMAX_SIGNATURE`), explicitly typed (the
    two segment kernels take the workspace and the segment length after them).

    ``buffers`` holds :data:`SOFTMAX_BUFFERS`: ``x``, ``mask`` (or None) and ``out``, views of
    one shape ``rows_shape + (n,)``, the rows of this launch of
    :class:`cuonline._validate.SoftmaxProblem` ``problem`` with the reduced axis last.
    """
    xp = problem.xp
    x, mask, out = views = tuple(buffers_of(buffers, SOFTMAX_BUFFERS, "softmax").values())
    acc = _semantics.accumulation_dtype(x.dtype).type
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
        np.int32(plan.rows_per_block), acc(problem.scale),
    )



# --------------------------------------------------------------------------------------------
# the attention backward (issue 13): attention_bwd_simt

#: Parameters of ``cuonline_attention_bwd_dkdv`` and ``cuonline_attention_bwd_dq`` (one
#: signature), in order. The forward's operands, options and scalars keep their forward names
#: and values (:func:`attention_fwd_arguments` builds them); the offset table gains a column.
ATTENTION_BWD_SIGNATURE = (
    "q", "k", "v", "bias", "mask", "kv_lengths", "alibi_slopes", "rel_bias", "rel_q", "rel_k",
    "dout", "lse", "delta", "dq", "dk", "dv", "ds", "drel_bias", "drel_q", "drel_k",
    "row_sums", "offsets", "strides",
    "lq", "lk",
    "diagonal_offset", "scale", "softcap", "window_left", "window_right", "bias_block_rows",
    "bias_block_cols", "rel_bias_radius", "rel_k_radius", "varlen_tiles", "varlen_key_tiles",
    "varlen_seqs", "varlen_n_tiles", "varlen_n_key_tiles",
)


#: The arrays the backward kernels read and write beyond the problem (the ``buffers`` of
#: :func:`attention_bwd_arguments`).
BWD_BUFFERS = ("dout", "lse", "delta", "dq", "dk", "dv", "ds", "drel_bias", "drel_q", "drel_k",
               "row_sums")


def attention_bwd_arguments(problem, plan, buffers):
    """The arguments of the backward kernels (:data:`ATTENTION_BWD_SIGNATURE`), explicitly
    typed.

    ``problem`` is the forward :class:`cuonline._validate.Problem`; ``buffers`` holds
    :data:`BWD_BUFFERS`: ``dout`` a view broadcast to ``batch_shape + (lq, dv)`` (any strides:
    addressed through the offset table's last column, after the forward's :data:`OPERANDS`);
    ``lse`` and ``delta`` contiguous ``(nbatch, lq)``, ``dq``/``dk``/``dv`` contiguous
    ``(nbatch, lq|lk, d|dv)``, ``ds`` ``(nbatch, lq, lk)`` (a bias's gradient) or None, the
    relative gradients' partials ``drel_bias`` ``(nbatch, n_query_tiles, Rb)``, ``drel_q``
    ``(nbatch, lq, Dr)`` and ``drel_k`` ``(nbatch, n_query_tiles, 2, Dr)`` (rel_k's end rows;
    the rel_k kernel gets its ``(nbatch, Rk, Dr)`` rows in this place), zero-filled, or None,
    ``row_sums`` ``(nbatch, lq)`` (the dQ kernel's record of each row's sum of P), all in the
    accumulation dtype. A packed batch takes its tables from ``plan.varlen``: ``(TileTable,
    key tiles)`` (:func:`cuonline.kernels.varlen.tile_table`,
    :func:`cuonline.kernels.varlen.key_tile_table`); its relative partials have a slot per dQ
    block (``n_query_tiles`` the table's length).
    """
    arrays = buffers_of(buffers, BWD_BUFFERS, "attention backward")
    # dout is addressed through the offset table like the operands: its column comes last
    values = dict(_score_values(problem, extra=[("dout", arrays.pop("dout"))]), **arrays,
                  varlen_key_tiles=None, varlen_n_key_tiles=np.int32(0))
    if plan.varlen is not None:
        table, key_tiles = plan.varlen
        # dout moves to the sequence's first query, as q and rel_q
        values.update(_varlen_values(table, values["offsets"], values["strides"],
                                     OPERANDS + ("dout",), ("q", "rel_q", "dout")),
                      varlen_key_tiles=key_tiles,
                      varlen_n_key_tiles=np.int32(key_tiles.shape[0]))
    return _ordered(problem.xp, values, ATTENTION_BWD_SIGNATURE)
