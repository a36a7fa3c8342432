"""softmax, log_softmax and logsumexp along one axis, for any array namespace ``xp``.

Stable for scores of any finite magnitude (the max is subtracted first) and for slices with
no visible entry (masked or all ``-inf``): softmax 0, log_softmax and logsumexp ``-inf``, with
no floating-point warning. Computed in the accumulation dtype of ``x`` (float32 for 16-bit
inputs) and returned in the dtype of ``x``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _semantics
from .merge import ignore_float_errors


def stats(xp: Any, x: Any, axis: int, mask: Any) -> tuple[Any, Any, Any]:
    """Return ``(d, shift, total)``: ``d = xa - shift`` (a new array) for ``xa``, ``x`` in the
    accumulation dtype with masked entries at ``-inf``; the per-slice shift (the max, or 0 for a
    slice with nothing visible) and ``sum(exp(d))``, both with ``keepdims``."""
    return _stats(xp, x, axis, mask, keep_exp=False)[:3]


def _stats(xp, x, axis, mask, keep_exp):
    """:func:`stats` and, when ``keep_exp``, ``exp(d)`` as a fourth item (else None)."""
    acc = _semantics.accumulation_dtype(x.dtype)
    xa = x.astype(acc, copy=False)
    if mask is not None:
        xa = xp.where(mask, xa, -xp.inf)
    if x.shape[axis] == 0:
        shape = list(x.shape)
        shape[axis] = 1
        zeros = xp.zeros(shape, dtype=acc)
        return xa.copy(), zeros, zeros, xa.copy()
    top = xa.max(axis=axis, keepdims=True)
    shift = xp.where(top == -xp.inf, 0, top).astype(acc, copy=False)  # no -inf - (-inf)
    with ignore_float_errors(xp):                      # a +inf entry gives inf - inf = NaN, as documented
        d = xa - shift
        e = xp.exp(d)
        total = e.sum(axis=axis, keepdims=True)
    return d, shift, total, (e if keep_exp else None)


def _fast(xp, x, axis, mask, mode):
    """The compiled row kernel's result for NumPy float32/float64 input reduced along its last,
    contiguous axis without a mask, else None (the generic ufunc passes run)."""
    if (xp is not np or mask is not None or x.dtype not in (np.float32, np.float64)
            or not x.dtype.isnative or axis not in (-1, x.ndim - 1)
            or not x.flags.c_contiguous or x.size == 0):
        return None
    from .cpu_runtime import tile_kernel  # compiled on first use; None: the ufunc passes

    kernel = tile_kernel(x.dtype, "softmax_rows")
    if kernel is None:
        return None
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty((rows.shape[0], 1) if mode == 2 else rows.shape, dtype=x.dtype)
    kernel(rows, out, mode)
    return out.reshape(x.shape[:-1] + out.shape[-1:])


def logsumexp(xp: Any, x: Any, axis: int, mask: Any, keepdims: bool) -> Any:
    out = _fast(xp, x, axis, mask, mode=2)
    if out is not None:
        return out if keepdims else out.squeeze(-1)
    _, shift, total = stats(xp, x, axis, mask)
    with ignore_float_errors(xp):
        out = shift + xp.log(total)
    if not keepdims:
        out = out.squeeze(axis)
    return out.astype(x.dtype, copy=False)


def softmax(xp: Any, x: Any, axis: int, mask: Any) -> Any:
    out = _fast(xp, x, axis, mask, mode=0)
    if out is not None:
        return out
    _, _, total, e = _stats(xp, x, axis, mask, keep_exp=True)
    with ignore_float_errors(xp):
        # a slice with nothing visible has e = 0 and total = 0: divided by 1 it stays 0
        e /= xp.where(total == 0, 1, total)
    return e.astype(x.dtype, copy=False)


def log_softmax(xp: Any, x: Any, axis: int, mask: Any) -> Any:
    out = _fast(xp, x, axis, mask, mode=1)
    if out is not None:
        return out
    d, _, total = stats(xp, x, axis, mask)
    with ignore_float_errors(xp):
        # (x - m) first: x - m is exact near the max, and log(total) <= log(n) is small, so
        # the result is a few ulp; x - (m + log(total)) would round m + log(total) at the
        # magnitude of m (ulp(1e4) ~ 1e-3 in float32) and lose it all. A slice with nothing
        # visible has d = -inf and total = 0: minus log(1) it stays -inf.
        d -= xp.log(xp.where(total == 0, 1, total))
    return d.astype(x.dtype, copy=False)
