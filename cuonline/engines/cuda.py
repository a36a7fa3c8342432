"""The CUDA engine: our kernels on CuPy arrays (``backend="cupy"``) or emulated on the CPU with
NumPy arrays (``backend="emulate"``).

One code path for both: target (:func:`cuonline.engines.target.current`, once per call) ->
plan (:func:`cuonline.kernels.families.plan_attention`: the family, its tiles and spec) ->
module (the target compiles the family's text: a ``cupy.RawModule`` memoized per device and
spec, or :func:`cuonline.testing.emulate.compile_module` of the very same text) -> typed
arguments (the family's builder) -> launch. CuPy is imported lazily: ``import cuonline`` never
imports it. A packed batch (``cu_seqlens_q``, ``cu_seqlens_k``) takes the same steps: its plan
carries the block table (:mod:`cuonline.kernels.varlen`), its arguments the table and an
offset row per sequence.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ..kernels import arguments, families, heuristics
from . import target as _target

if TYPE_CHECKING:
    from .._validate import Problem

__all__ = ["attention"]


def attention(problem: Problem) -> tuple[Any, Any]:
    """Run :class:`cuonline._validate.Problem` ``problem``; return ``(out, lse or None)``.

    ``out`` has the dtype of the inputs and shape ``batch_shape + (lq, dv)``; ``lse`` the
    accumulation dtype and shape ``batch_shape + (lq,)``. Tests steer the target (arch, SM
    count, family, key splits, tiles, kernel texts) through
    :func:`cuonline.engines.target.overrides`.
    """
    return _run(problem, _target.current(problem.backend))


def _run(p, target):
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
        out, lse = _run(padded, target)
        return (out[..., :0] if p.dv == 0 else out), lse

    launch = target.launch(cp_async=arguments.cp_async_aligned(p))
    plan = families.plan_attention(p, launch)
    return _launch(p, launch, plan, target.module(plan.spec))


def _launch(p, launch, plan, module):
    xp = p.xp
    spec = plan.spec
    family = families.of(spec)
    out = xp.empty(p.batch_shape + (p.lq, p.dv), dtype=p.dtype)
    lse = xp.empty(p.batch_shape + (p.lq,), dtype=p.acc_dtype) if p.return_lse else None
    if plan.n_splits > 1:
        # Partial, already normalised (out, lse) per split, merged by the combine kernel.
        ws_out = xp.empty((plan.n_splits, p.nbatch, p.lq, p.dv), dtype=p.acc_dtype)
        ws_lse = xp.empty((plan.n_splits, p.nbatch, p.lq), dtype=p.acc_dtype)
        args = family.arguments(p, plan, dict(out=ws_out, lse=ws_lse))
    else:
        args = family.arguments(p, plan, dict(out=out, lse=lse))

    (entry,) = family.entries
    fwd = module.get_function(entry)
    if plan.shared_bytes > heuristics.SMEM_NO_OPT_IN:
        fwd.max_dynamic_shared_size_bytes = plan.shared_bytes
    fwd(plan.grid, plan.block, args, shared_mem=plan.shared_bytes)

    if plan.n_splits > 1:
        (combine,) = family.includes
        merge = combine.planner(p, dataclasses.replace(launch, n_splits=plan.n_splits))
        (entry,) = combine.entries
        module.get_function(entry)(merge.grid, merge.block, combine.arguments(
            p, merge, dict(ws_out=ws_out, ws_lse=ws_lse, out=out, lse=lse)))
    return out, lse
