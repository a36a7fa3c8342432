"""Merging attention states computed on disjoint sets of keys.

A state is ``(out, lse)``: the normalised output over some keys and the log-sum-exp of the
scores over those keys. For states ``(o_1, L_1), ..., (o_n, L_n)`` over disjoint key sets the
union is

    M   = max_i L_i
    w_i = exp(L_i - M)
    L   = M + log(sum_i w_i)
    o   = sum_i w_i o_i / sum_i w_i

which is the online-softmax ``(m, l, O)`` merge written for normalised outputs. A state with
``L = -inf`` (no visible key) has weight 0, and a union with no visible key at all gives
``o = 0`` and ``L = -inf``. ``L = +inf`` (infinite mass) gives ``L = +inf`` and ``o`` NaN, as
``logsumexp`` would: no mean of the outputs is defined. Written once for any array namespace
``xp`` (NumPy or CuPy), and shared by :func:`cuonline.merge`, the NumPy engine's key splitting
and the CUDA host code.
"""

from __future__ import annotations

import numpy as np

from .. import _semantics


def merge_states(xp, outs, lses):
    """Merge normalised states. ``outs[i]``: (..., Lq, Dv); ``lses[i]``: (..., Lq).

    All ``outs`` share one shape and real floating dtype, all ``lses`` likewise (as
    :func:`cuonline._validate.validate_merge` checks). Computed in float64 if either dtype is
    float64, else in float32; the result has the dtype of ``outs[0]`` for ``out`` and of
    ``lses[0]`` for ``lse``. A row with ``lse = +inf`` in some state (infinite mass) gives
    ``lse = +inf`` and ``out`` NaN; a NaN ``lse`` gives NaN in both.
    """
    acc = max((_semantics.accumulation_dtype(x.dtype) for x in (outs[0], lses[0])),
              key=lambda dt: dt.itemsize)
    lse_stack = xp.stack([s.astype(acc, copy=False) for s in lses])   # (n, ..., Lq)
    top = lse_stack.max(axis=0)                   # M: -inf where nothing is visible
    # a finite shift: no -inf - (-inf) where nothing is visible, no inf - inf at +inf
    top_safe = xp.where(xp.isinf(top), 0, top).astype(acc, copy=False)
    with ignore_float_errors(xp):
        weights = xp.exp(lse_stack - top_safe)    # (n, ..., Lq), 0 for empty states
        total = weights.sum(axis=0)
        lse = top_safe + xp.log(total)            # -inf where total == 0
        norm = xp.where(total > 0, weights / xp.where(total > 0, total, 1), 0)
    out = xp.zeros(outs[0].shape, dtype=acc)
    for w, o in zip(norm, outs):
        # a state with weight 0 may hold anything (even NaN) without touching the union
        out += xp.where((w > 0)[..., None], w[..., None] * o.astype(acc, copy=False), 0)
    # NaN anywhere makes the row NaN (max propagates it); +inf: infinite mass, no defined mean
    undefined = xp.isnan(top) | (top == np.inf)
    lse = xp.where(xp.isnan(top), np.nan, xp.where(top == np.inf, np.inf, lse))
    out = xp.where(undefined[..., None], np.nan, out)
    return out.astype(outs[0].dtype, copy=False), lse.astype(lses[0].dtype, copy=False)


def ignore_float_errors(xp):
    errstate = getattr(xp, "errstate", None)
    if errstate is None:                          # CuPy raises no floating-point warnings
        import contextlib

        return contextlib.nullcontext()
    return errstate(divide="ignore", invalid="ignore")
