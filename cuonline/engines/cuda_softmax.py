"""softmax, log_softmax and logsumexp on our CUDA kernels (``kernels_cu/softmax.cu``): CuPy
arrays (``backend="cupy"``) or NumPy arrays emulated on the CPU (``backend="emulate"``).

The same path as the attention engine: plan (pure functions) ->
:class:`~cuonline.kernels.specs.SoftmaxSpec` -> source text -> module (``cupy.RawModule`` or
the emulation, through :func:`cuonline.engines.cuda._module`) -> typed arguments -> launch on
CuPy's current stream. The input is never copied (unless a stride is not a whole number of
elements): the kernel reads it, and the mask, through their own element strides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _semantics
from ..kernels.heuristics import DEFAULT_NUM_SMS
from ..kernels.specs import SoftmaxSpec
from . import cuda

__all__ = ["MAX_ROWS_PER_LAUNCH", "SoftmaxPlan", "kernel_arguments", "plan_softmax", "run"]

WARP = 32
#: Threads per block (kMaxThreads in softmax.cu).
BLOCK_THREADS = SoftmaxSpec.threads
MAX_WARPS_PER_ROW = BLOCK_THREADS // WARP
#: Columns each lane visits before another warp is given to the row.
COLUMNS_PER_LANE = 32
#: The kernel splits the row index with 32-bit division: larger problems take several launches.
MAX_ROWS_PER_LAUNCH = 2**31 - 1
#: Grid cap: far more than the resident blocks of any GPU (132 SMs x 8 blocks of 256 threads);
#: the kernel's row loop covers the rest.
MAX_BLOCKS = 65535
#: Long rows, few of them: rows are cut into segments of at least this many columns (the
#: second launch and the partial states cost more below) until the grid has BLOCKS_PER_SM
#: blocks per SM, at most MAX_SEGMENTS per row.
MIN_SEGMENT = 16384
BLOCKS_PER_SM = 2
MAX_SEGMENTS = 4096


@dataclass(frozen=True)
class SoftmaxPlan:
    """A launch of the softmax family: the variant, its block shape and grid."""

    spec: SoftmaxSpec
    warps_per_row: int
    rows_per_block: int
    grid: tuple              # (row blocks, segments per row, 1)
    block: tuple
    seg_len: int             # columns per segment (n when rows are not cut)

    @property
    def segments(self) -> int:
        return self.grid[1]


def plan_softmax(dtype, mode, has_mask, n, nrows, *, max_blocks=MAX_BLOCKS,
                 num_sms=DEFAULT_NUM_SMS, min_segment=MIN_SEGMENT):
    """Plan a launch over ``nrows`` rows of ``n`` columns; a pure function of the shapes.

    Rows are cut into segments (two launches, see softmax.cu) when they are long and too few
    to give every SM ``BLOCKS_PER_SM`` blocks.
    """
    dtype = np.dtype(dtype)
    spec = SoftmaxSpec(dtype=dtype.name, acc=_semantics.accumulation_dtype(dtype).name,
                       mode=mode, mask=bool(has_mask))
    # A warp per row while each lane has at most COLUMNS_PER_LANE columns: no barrier at all,
    # and a block holds 8 rows. Longer rows get more warps (merged through shared memory, two
    # barriers per row) until the block is full; beyond 8192 columns lanes take more columns.
    warps = 1
    while warps < MAX_WARPS_PER_ROW and n > COLUMNS_PER_LANE * WARP * warps:
        warps *= 2
    rows_per_block = MAX_WARPS_PER_ROW // warps
    row_blocks = math.ceil(nrows / rows_per_block)
    blocks = max(1, min(row_blocks, max_blocks))
    segments = 1
    if row_blocks < BLOCKS_PER_SM * num_sms and n >= 2 * min_segment:
        segments = min(n // min_segment, math.ceil(BLOCKS_PER_SM * num_sms / row_blocks),
                       MAX_SEGMENTS)
    seg_len = math.ceil(n / segments)
    return SoftmaxPlan(spec=spec, warps_per_row=warps, rows_per_block=rows_per_block,
                       grid=(blocks, math.ceil(n / seg_len), 1), block=(BLOCK_THREADS, 1, 1),
                       seg_len=seg_len)


def run(mode, x, axis, mask, *, backend, keepdims=False, scale=1.0, max_blocks=MAX_BLOCKS,
        max_rows_per_launch=MAX_ROWS_PER_LAUNCH, min_segment=MIN_SEGMENT, num_sms=None,
        kernel_sources=None, emulate_options=None):
    """``mode`` ("softmax", "log_softmax", "logsumexp") of ``x`` along ``axis``.

    ``x`` and ``mask`` come from :func:`cuonline._validate.validate_axis_input` (``axis``
    non-negative, ``mask`` a bool view broadcast to ``x.shape`` or None). The result has the
    dtype of ``x``: ``x.shape`` for softmax/log_softmax, ``x.shape`` without ``axis`` (kept with
    length 1 if ``keepdims``) for logsumexp. The other keywords are seams for tests: ``scale``
    (> 0) multiplies ``x``; ``max_blocks`` and ``max_rows_per_launch`` force the kernel's row
    loop and the host's row chunking; ``min_segment`` and ``num_sms`` steer the cutting of long
    rows (see :func:`plan_softmax`); ``kernel_sources`` and ``emulate_options`` as in
    :func:`cuonline.engines.cuda.attention`.
    """
    if backend not in ("cupy", "emulate"):
        raise ValueError(f"the CUDA engine runs backend 'cupy' or 'emulate', got {backend!r}")
    xp = np if backend == "emulate" else _cupy()
    n = x.shape[axis]
    if mode == "logsumexp":
        out = xp.empty(x.shape[:axis] + (1,) + x.shape[axis + 1:], dtype=x.dtype)
    else:
        out = xp.empty(x.shape, dtype=x.dtype)
    if out.size == 0 or n == 0:
        # Nothing to launch; an empty axis has nothing visible: logsumexp -inf.
        if mode == "logsumexp":
            out[...] = -np.inf
    else:
        x = _whole_elements(xp, x)
        # Views with the reduced axis last: rows_shape + (n,). logsumexp writes one value per
        # row (its column stride is never used).
        xv = xp.moveaxis(x, axis, -1)
        mv = None if mask is None else xp.moveaxis(mask, axis, -1)
        ov = xp.moveaxis(out, axis, -1)
        if num_sms is None:
            num_sms = cuda._num_sms() if backend == "cupy" else DEFAULT_NUM_SMS
        module = None
        for index in _row_chunks(xv.shape, max_rows_per_launch):
            sub_x, sub_o = xv[index], ov[index]
            sub_m = None if mv is None else mv[index]
            nrows = math.prod(sub_x.shape[:-1])
            plan = plan_softmax(x.dtype, mode, mask is not None, n, nrows,
                                max_blocks=max_blocks, num_sms=num_sms, min_segment=min_segment)
            if module is None:  # the variant is the same for every chunk
                module = cuda._module(plan.spec, backend, kernel_sources, emulate_options)
            args = kernel_arguments(xp, sub_x, sub_m, sub_o, plan, scale)
            if plan.segments == 1:
                module.get_function(plan.spec.entry)(plan.grid, plan.block, args)
            else:  # statistics per segment, then merge and write (see softmax.cu)
                partial = xp.empty(2 * nrows * plan.segments,
                                   dtype=_semantics.accumulation_dtype(x.dtype))
                for entry in plan.spec.segment_entries:
                    module.get_function(entry)(plan.grid, plan.block,
                                               args + (partial, np.int64(plan.seg_len)))
    if mode == "logsumexp" and not keepdims:
        out = out.squeeze(axis)
    return out


def kernel_arguments(xp, x, mask, out, plan, scale):
    """The argument tuple of ``cuonline_softmax``, in signature order, explicitly typed (the
    two segment kernels take the workspace and the segment length after it).

    ``x``, ``mask`` (or None) and ``out`` are views of one shape ``rows_shape + (n,)``.
    """
    acc = np.dtype(_semantics.accumulation_dtype(x.dtype)).type
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


def _row_chunks(shape, limit):
    """Index tuples that cut a ``rows_shape + (n,)`` view into pieces of at most ``limit`` rows
    (row dimensions sliced from the outside in)."""
    rows = math.prod(shape[:-1])
    if rows <= limit:
        yield ()
        return
    inner = math.prod(shape[1:-1])
    if inner <= limit:
        step = limit // inner
        for i in range(0, shape[0], step):
            yield (slice(i, i + step),)
        return
    for i in range(shape[0]):
        for rest in _row_chunks(shape[1:], limit):
            yield (i,) + rest


def _whole_elements(xp, x):
    """``x``, or a contiguous copy when one of its strides is not a whole number of elements."""
    if any(s % x.dtype.itemsize for s in x.strides):
        return xp.ascontiguousarray(x)
    return x


def _cupy():
    import cupy  # noqa: PLC0415 - only on the GPU path

    return cupy
