"""softmax, log_softmax and logsumexp on our CUDA kernels (``kernels_cu/softmax.cu``): CuPy
arrays (``backend="cupy"``) or NumPy arrays emulated on the CPU (``backend="emulate"``).

The same path as the attention engine: target (once per call) -> plan
(:func:`cuonline.kernels.softmax_plan.plan_softmax`, the registry's planner of the softmax
family) -> module (compiled by the target) -> typed arguments -> launch on CuPy's current
stream. The input is never copied (unless a stride is not a whole number of elements): the
kernel reads it, and the mask, through their own element strides.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..kernels import families
from . import target as _target

if TYPE_CHECKING:
    from .._validate import SoftmaxProblem

__all__ = ["run"]

_SOFTMAX = families.get("softmax")


def run(problem: SoftmaxProblem) -> Any:
    """The result of :class:`cuonline._validate.SoftmaxProblem` ``problem``.

    It has the dtype of ``x``: ``x.shape`` for softmax/log_softmax, ``x.shape`` without
    ``axis`` (kept with length 1 if ``keepdims``) for logsumexp. Tests steer the target (grid
    cap, rows per launch, segment cutting, kernel texts) through
    :func:`cuonline.engines.target.overrides`.
    """
    p = problem
    target = _target.current(p.backend)
    xp, x, axis, mode = p.xp, p.x, p.axis, p.mode
    n = p.n
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
        mv = None if p.mask is None else xp.moveaxis(p.mask, axis, -1)
        ov = xp.moveaxis(out, axis, -1)
        module = None
        entry, *segment_entries = _SOFTMAX.entries
        for index in _row_chunks(xv.shape, target.max_rows_per_launch):
            sub_x, sub_o = xv[index], ov[index]
            sub_m = None if mv is None else mv[index]
            nrows = math.prod(sub_x.shape[:-1])
            plan = _SOFTMAX.planner(p, target.launch(nrows=nrows))
            if module is None:  # the variant is the same for every chunk
                module = target.module(plan.spec)
            args = _SOFTMAX.arguments(p, plan, dict(x=sub_x, mask=sub_m, out=sub_o))
            if plan.segments == 1:
                module.get_function(entry)(plan.grid, plan.block, args)
            else:  # statistics per segment, then merge and write (see softmax.cu)
                partial = xp.empty(2 * nrows * plan.segments, dtype=p.acc_dtype)
                for name in segment_entries:
                    module.get_function(name)(plan.grid, plan.block,
                                              args + (partial, np.int64(plan.seg_len)))
    if mode == "logsumexp" and not p.keepdims:
        out = out.squeeze(axis)
    return out


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
