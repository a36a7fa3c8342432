"""The CUDA engine of :func:`cuonline.attention_stats`: the statistics kernels
(``kernels_cu/attention_stats.cu``) on CuPy arrays (``backend="cupy"``) or emulated on the
CPU with NumPy arrays (``backend="emulate"``).

The attention engine's path: target (:func:`cuonline.engines.target.current`, once per call)
-> plan (:func:`cuonline.kernels.stats_plan.plan_stats`, the registry's planner of the
``attention_stats`` family, ``planner(problem, launch)``) -> module
(:meth:`cuonline.engines.target.Target.module`) -> typed arguments
(:func:`cuonline.kernels.stats_plan.stats_arguments`, ``arguments(problem, plan, buffers)``)
-> launches: pass 1 (lse, entropy, max weight, argmax, top-k), then, from its lse, the
key-owned ``received`` pass and the rows of ``P``. Every result is written by one thread in
a fixed order: two runs give the same bits.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ..kernels import families, heuristics
from . import target as _target

if TYPE_CHECKING:
    from .._validate import StatsProblem

__all__ = ["attention_stats"]

_STATS = families.get("attention_stats")
_PASS1, _RECEIVED, _ROWS = _STATS.entries


def attention_stats(sp: StatsProblem) -> dict:
    """Run the :class:`cuonline._validate.StatsProblem` ``sp`` on the CUDA engine; return the
    fields of :class:`cuonline.AttentionStats` as a dict (arrays of ``sp.scores.xp``).

    ValueError for a ``top_k`` above
    :data:`cuonline.kernels.specs.STATS_MAX_TOP_K` or a shape the kernels cannot take (the
    planner's messages). Tests steer the target through
    :func:`cuonline.engines.target.overrides`.
    """
    p = sp.scores
    target = _target.current(p.backend)
    xp = p.xp
    nbatch, lq, lk = p.nbatch, p.lq, p.lk
    acc = p.acc_dtype
    lse = xp.full((nbatch, lq), -np.inf, dtype=acc)
    entropy = xp.zeros((nbatch, lq), dtype=acc)
    max_weight = xp.zeros((nbatch, lq), dtype=acc)
    argmax = xp.full((nbatch, lq), -1, dtype=np.int64)
    top_k = sp.top_k
    top_i = xp.full((nbatch, lq, top_k), -1, dtype=np.int64) if top_k else None
    top_w = xp.zeros((nbatch, lq, top_k), dtype=acc) if top_k else None
    received = xp.zeros((nbatch, lk), dtype=acc) if sp.received else None
    rows = sp.rows
    weights = xp.zeros((nbatch, rows.size, lk), dtype=acc) if rows is not None else None

    if p.d == 0:
        # D = 0 makes every q·k exactly 0, as one column of zeros in q and k does (broadcast
        # views: nothing of the batch size is allocated)
        def zeros(n):
            return xp.broadcast_to(xp.zeros((1, 1), dtype=p.dtype), p.batch_shape + (n, 1))

        p = dataclasses.replace(p, d=1, q=zeros(lq), k=zeros(lk))
    # the planner's errors (top_k, options, shared memory) come before the empty shortcut, so
    # that a call is refused for its arguments whatever its lengths
    plan = _STATS.planner(p, target.launch(top_k=top_k))
    if nbatch and lq and lk:
        w = sp.query_weights if received is not None else None
        if w is not None:   # S + (Lq,), possibly a broadcast view: (nbatch, lq) contiguous
            w = xp.ascontiguousarray(xp.reshape(xp.ascontiguousarray(w), (nbatch, lq)))
        buffers = dict(lse=lse, entropy=entropy, max_weight=max_weight, argmax=argmax,
                       top_indices=top_i, top_weights=top_w, query_weights=w,
                       received=received, weights=weights,
                       rows=None if rows is None else xp.ascontiguousarray(rows, dtype=np.int64))
        # in order: pass 1 writes the lse the other two read (one stream); a pass is launched
        # where its results are asked for
        grids = {_PASS1: plan.grid_stats}
        if received is not None:
            grids[_RECEIVED] = plan.grid_received
        if rows is not None and rows.size:
            grids[_ROWS] = plan.grid_rows(rows.size)
        module = target.module(plan.spec)
        args = _STATS.arguments(p, plan, buffers)
        for entry, grid in grids.items():
            kernel = module.get_function(entry)
            if plan.shared_bytes > heuristics.SMEM_NO_OPT_IN:
                kernel.max_dynamic_shared_size_bytes = plan.shared_bytes
            kernel(grid, plan.block, args[entry], shared_mem=plan.shared_bytes)

    def shaped(x):   # (nbatch, ...) -> S + (...)
        return None if x is None else xp.reshape(x, p.batch_shape + x.shape[1:])

    return dict(lse=shaped(lse), entropy=shaped(entropy) if sp.entropy else None,
                max_weight=shaped(max_weight), argmax=shaped(argmax),
                top_indices=shaped(top_i), top_weights=shaped(top_w),
                received=shaped(received), weights=shaped(weights))
