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
``o = 0`` and ``L = -inf``. Written once for any array namespace ``xp`` (NumPy or CuPy), and
shared by :func:`cuonline.merge`, the NumPy engine's key splitting and the CUDA host code.
"""

from __future__ import annotations


def merge_states(xp, outs, lses):
    """Merge normalised states. ``outs[i]``: (..., Lq, Dv); ``lses[i]``: (..., Lq).

    All arrays must already share one shape family and dtype; the result has the dtype of
    ``outs[0]`` for ``out`` and of ``lses[0]`` for ``lse``.
    """
    lse_stack = xp.stack(lses)                    # (n, ..., Lq)
    top = lse_stack.max(axis=0)                   # M, -inf where nothing is visible
    top_safe = xp.where(top == -xp.inf, 0, top)   # avoid -inf - (-inf)
    weights = xp.exp(lse_stack - top_safe)        # (n, ..., Lq), 0 for empty states
    total = weights.sum(axis=0)
    with _quiet(xp):
        lse = top_safe + xp.log(total)            # -inf where total == 0
        norm = xp.where(total > 0, weights / xp.where(total > 0, total, 1), 0)
    out = xp.zeros(outs[0].shape, dtype=weights.dtype)
    for w, o in zip(norm, outs):
        # a state with weight 0 may hold anything (even NaN) without touching the union
        out += xp.where((w > 0)[..., None], w[..., None] * o, 0)
    nan_rows = xp.isnan(top)                      # a NaN state makes its rows NaN
    lse = xp.where(nan_rows, top, lse)
    out = xp.where(nan_rows[..., None], xp.nan, out)
    return out.astype(outs[0].dtype, copy=False), lse.astype(lses[0].dtype, copy=False)


def _quiet(xp):
    errstate = getattr(xp, "errstate", None)
    if errstate is None:                          # CuPy raises no floating-point warnings
        import contextlib

        return contextlib.nullcontext()
    return errstate(divide="ignore", invalid="ignore")
