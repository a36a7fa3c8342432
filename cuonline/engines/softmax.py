"""softmax, log_softmax and logsumexp along one axis, for any array namespace ``xp``.

Stable for scores of any finite magnitude (the max is subtracted first) and for slices with
no visible entry (masked or all ``-inf``): softmax 0, log_softmax and logsumexp ``-inf``, with
no floating-point warning. Computed in the accumulation dtype of ``x`` (float32 for 16-bit
inputs) and returned in the dtype of ``x``.
"""

from __future__ import annotations

from .. import _semantics
from .merge import _quiet


def stats(xp, x, axis, mask):
    """Return ``(xa, shift, total)``: ``x`` in the accumulation dtype with masked entries at
    ``-inf``, the per-slice shift (the max, or 0 for a slice with nothing visible) and
    ``sum(exp(xa - shift))``, both with ``keepdims``."""
    acc = _semantics.accumulation_dtype(x.dtype)
    xa = x.astype(acc, copy=False)
    if mask is not None:
        xa = xp.where(mask, xa, -xp.inf)
    if x.shape[axis] == 0:
        shape = list(x.shape)
        shape[axis] = 1
        return xa, xp.zeros(shape, dtype=acc), xp.zeros(shape, dtype=acc)
    top = xa.max(axis=axis, keepdims=True)
    shift = xp.where(top == -xp.inf, 0, top).astype(acc, copy=False)  # no -inf - (-inf)
    with _quiet(xp):                      # a +inf entry gives inf - inf = NaN, as documented
        total = xp.exp(xa - shift).sum(axis=axis, keepdims=True)
    return xa, shift, total


def logsumexp(xp, x, axis, mask, keepdims):
    _, shift, total = stats(xp, x, axis, mask)
    with _quiet(xp):
        out = shift + xp.log(total)
    if not keepdims:
        out = out.squeeze(axis)
    return out.astype(x.dtype, copy=False)


def softmax(xp, x, axis, mask):
    xa, shift, total = stats(xp, x, axis, mask)
    with _quiet(xp):
        out = xp.where(total == 0, 0, xp.exp(xa - shift) / total)
    return out.astype(x.dtype, copy=False)


def log_softmax(xp, x, axis, mask):
    xa, shift, total = stats(xp, x, axis, mask)
    with _quiet(xp):
        # (x - m) first: x - m is exact near the max, and log(total) <= log(n) is small, so
        # the result is a few ulp; x - (m + log(total)) would round m + log(total) at the
        # magnitude of m (ulp(1e4) ~ 1e-3 in float32) and lose it all
        out = xp.where(total == 0, -xp.inf, (xa - shift) - xp.log(total))
    return out.astype(x.dtype, copy=False)
