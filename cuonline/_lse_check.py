"""The backward's check that ``lse`` belongs to its inputs, shared by every engine.

A backward pass recomputes ``P = exp(s - lse)`` tile by tile from the forward's ``lse``; the
sum of each row of ``P`` costs one accumulator more and must be 1 for a row that sees a key
(``lse = log sum_j exp(s_j)``) and 0 for one that does not (``lse = -inf``). A row further
from that than rounding allows means an ``lse`` of other inputs or other options, which would
otherwise give finite, wrong gradients. Pure array code through ``xp`` (NumPy or CuPy); no
engine import.

The rule, as a bound on ``|log S|`` where ``S`` is a row's sum, for a row of ``n`` keys whose
logits hold products of ``t`` terms (``t = D``, plus ``Dr`` with ``rel_q``/``rel_k``), with
``eps`` the machine epsilon of the accumulation dtype (float32 for 16-bit and float32 inputs,
float64 for float64)::

    tol = eps * (n + (t + 4) * (|lse| + R + log(n + 1) + 1))
    R   = |scale| * |q_i| * max_j |k_j|  +  |rel_q_i| * max_r |rel_k_r|    (2-norms)

* ``n * eps``: the sums of ``n`` positive terms, the forward's ``l`` and the backward's ``S``,
  each within ``(n - 1) eps / 2`` relative in any order, each term's ``exp`` within an ulp;
* ``t * eps * R``: a logit's products summed in another order (another tile shape, BLAS
  kernel or engine) move by at most ``t eps / 2 * sum_d |a_d b_d|`` each time, and
  ``sum_d |a_d b_d| <= |a| |b|`` (Cauchy-Schwarz), so ``s - lse`` moves by at most
  ``t * eps * R`` (without this term, float32 products of ``q, k ~ N(0, 100^2)`` cancelled
  by a bias used 60% of the rest of the bound);
* ``|lse| * eps``: the rounding of ``lse = m + log l`` and of ``s - lse`` (an ulp of ``|lse|``);
* ``log(n + 1)``: ``s - lse`` rounds at ``|s - lse|``, and ``sum_j P_j |s_j - lse|`` (the
  row's entropy) is at most ``log n``.

Where ``eps * |lse|`` is large (logits near the dtype's range) the bound allows anything from
0 to ``exp(tol)``: there ``lse`` cannot resolve the row's ``log l`` at all. An offset of ``lse``
by ``delta`` shifts ``log S`` by ``-delta``, so any offset larger than ``tol`` is caught (for
float32, ``n = 10**4`` keys, ``D = 64``, unit-variance inputs and ``|lse| < 100``:
``tol < 2e-3``).

A backward run over part of each row's keys with the global ``lse`` (a Dask chunk pair, a ring
of devices: FlashAttention-2's backward needs nothing else) has row sums between 0 and 1; such
calls run inside :func:`partial_keys`, which keeps the checks that hold for any part: no sum
above ``exp(tol)``, no ``-inf`` on a row that sees a key.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import numpy as np

__all__ = ["row_sum_tolerance", "row_norms", "product_bound", "check_row_sums",
           "partial_keys", "keys_are_partial"]

# set by partial_keys(): per thread and per asyncio task, as each Dask task runs its own call
_partial = contextvars.ContextVar("cuonline_partial_keys", default=False)


@contextlib.contextmanager
def partial_keys():
    """Backward calls inside see part of each row's keys, with the ``lse`` of all of them."""
    token = _partial.set(True)
    try:
        yield
    finally:
        _partial.reset(token)


def keys_are_partial() -> bool:
    """Whether the calling context is inside :func:`partial_keys`."""
    return _partial.get()


def row_sum_tolerance(xp, acc_dtype, n_keys, lse, logit_terms, products=0.0):
    """The bound on ``|log S|`` of each row (see the module docstring), in float64.

    Parameters
    ----------
    xp : module
        ``numpy`` or ``cupy``.
    acc_dtype : dtype
        The accumulation dtype (float32 or float64).
    n_keys : int or array
        Keys each row's sum ran over (broadcast against ``lse``).
    lse : array
        The ``lse`` the backward was given, one per row; ``-inf`` rows get the bound of
        ``|lse| = 0`` (they are judged by whether they see a key, not by the bound).
    logit_terms : int
        Products summed into one logit: the head size ``D``, plus ``Dr`` with ``rel_q``/``rel_k``.
    products : float or array broadcast against ``lse``
        ``R`` of each row (:func:`product_bound`); a NaN counts as infinite (not judged).
    """
    size = xp.asarray(lse, dtype=xp.float64)
    size = xp.where(xp.isfinite(size), xp.abs(size), 0.0)
    n = xp.asarray(n_keys, dtype=xp.float64)
    r = xp.asarray(products, dtype=xp.float64)
    r = xp.where(xp.isnan(r), xp.inf, r)
    return _tolerance(acc_dtype, n, size, r, logit_terms, xp.log1p)


def _tolerance(acc_dtype, n, size, r, logit_terms, log1p):
    """The bound's formula, on arrays (``log1p`` an array library's) or on floats
    (``math.log1p``): ``n`` keys, ``size`` = ``|lse|``, ``r`` = R."""
    eps = float(np.finfo(acc_dtype).eps)
    return eps * (n + (logit_terms + 4) * (size + r + log1p(n) + 1))


def row_norms(xp, x):
    """The 2-norm of each row of ``x`` (``(..., L, D)`` -> ``(..., L)`` float64), never below
    the exact one: summed in float32 for float32 ``x`` where no sum overflows (three times the
    speed of a float64 ``einsum`` over float32 on the CPU), then raised by the relative error
    of ``D`` squares summed (``D eps``); else in float64. NaN and inf stay."""
    if x.dtype == xp.float32:
        squares = xp.einsum("...ij,...ij->...i", x, x)
        if bool(xp.isfinite(squares).all()):
            bound = 1 + x.shape[-1] * float(np.finfo(np.float32).eps)
            return xp.sqrt(squares.astype(xp.float64) * bound)
    return xp.sqrt(xp.einsum("...ij,...ij->...i", x, x, dtype=xp.float64))


def product_bound(xp, q, k, scale, *, kv_lengths=None, rel_q=None, rel_k=None,
                  sequences=None):
    """``R`` of every row (see the module docstring): ``(..., Lq)`` float64.

    ``q`` (..., Lq, D), ``k`` (..., Lk, D), ``rel_q`` (..., Lq, Dr) and ``rel_k`` (..., T, Dr)
    broadcast to one batch shape; keys at or past ``kv_lengths`` (..., never read) are left
    out, and so is NaN in ``k`` or ``rel_k`` (a NaN the row sees makes its sum NaN, and a NaN
    it does not see changes nothing). Reads each array once (views of broadcast inputs are
    not expanded).

    ``sequences``, ``(cu_seqlens_q, cu_seqlens_k)``: ``q`` and ``k`` hold packed sequences
    (``Lq`` and ``Lk`` their totals), sequence ``s`` the query rows and keys from offset
    ``[s]`` to offset ``[s + 1]``, and each row's largest key norm is taken over its own
    sequence's keys (0 for a sequence without keys). NumPy only (``reduceat``).
    """
    def largest(x):                                     # NaN left out; no rows: 0
        if x.shape[-1] == 0:
            return xp.zeros(x.shape[:-1])
        return xp.where(xp.isnan(x), 0.0, x).max(axis=-1)

    keys = row_norms(xp, k)
    if kv_lengths is not None:
        keys = xp.where(xp.arange(keys.shape[-1]) < xp.asarray(kv_lengths)[..., None], keys, 0)
    if sequences is None:
        seen = largest(keys)[..., None]
    else:
        seen = _largest_per_sequence(xp, keys, *sequences)
    bound = abs(float(scale)) * row_norms(xp, q) * seen              # any sign of the scale
    if rel_q is not None:
        bound = bound + row_norms(xp, rel_q) * largest(row_norms(xp, rel_k))[..., None]
    return bound


def _largest_per_sequence(xp, keys, cu_q, cu_k):
    """``(..., Lq)``: for each packed query row, the largest of ``keys`` (..., Lk) over its
    sequence's keys, NaN left out (as :func:`product_bound`'s ``largest``), 0 where the
    sequence has none."""
    keys = xp.where(xp.isnan(keys), 0.0, keys)
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    largest = xp.zeros(keys.shape[:-1] + (len(cu_k) - 1,))
    filled = np.flatnonzero(np.diff(cu_k))
    if filled.size:      # reduceat's runs end where the next begins: the empty ones left out
        largest[..., filled] = xp.maximum.reduceat(keys, cu_k[filled], axis=-1)
    return xp.repeat(largest, np.diff(cu_q), axis=-1)


def check_row_sums(xp, row_sums, lse, *, acc_dtype, n_keys, logit_terms, products=0.0,
                   sees_keys=None, all_keys=None):
    """Raise ``ValueError`` naming ``lse`` where a row's sum of ``exp(s - lse)`` is off.

    Parameters
    ----------
    xp : module
        ``numpy`` or ``cupy``.
    row_sums : array, shape (..., Lq)
        ``S = sum_j exp(s_j - lse)`` of each row over its visible keys, accumulated in
        ``acc_dtype``, with ``exp(s - lse)`` taken as 0 where ``lse = -inf`` (the engines'
        rule for rows without keys).
    lse : array, shape (..., Lq)
        The ``lse`` the backward was given.
    acc_dtype : dtype
        The accumulation dtype.
    n_keys : int or array broadcast against ``lse``
        Keys each row's sum ran over (``Lk``, or ``kv_lengths``).
    logit_terms : int
        See :func:`row_sum_tolerance`.
    products : float, array broadcast against ``lse``, or a function returning one
        ``R`` of each row (:func:`product_bound`). A function is called only where a row
        falls outside the bound of ``R = 0``: the bound grows with ``R`` (``R >= 0``), so a
        row within it is within any, and a genuine ``lse`` is (no pass over ``q`` and ``k``
        for their norms).
    sees_keys : bool array of the shape of ``lse``, optional
        Whether each row has a logit that is not ``-inf``. Read only where ``lse = -inf``
        (an engine may fill it for those rows alone); None: not checked there.
    all_keys : bool, optional
        Whether the sums ran over all of each row's keys; None: unless inside
        :func:`partial_keys`. False keeps the checks that hold for part of the keys.

    Notes
    -----
    Expected: ``S = 1`` where ``lse`` is finite, within ``|log S| <= tol``
    (:func:`row_sum_tolerance`); ``S = 0`` where ``lse = -inf``, and then the row must see no
    key. Rows whose sum is NaN are left alone: NaN in the inputs reaches the gradients of the
    rows that see it, as documented. ``lse = +inf`` or NaN on a row without NaN is an error
    (its sum is 0 or NaN; NaN sums are left alone).
    """
    lse = xp.asarray(lse)
    row_sums = xp.asarray(row_sums, dtype=xp.float64)
    if row_sums.size == 0:
        return
    if all_keys is None:
        all_keys = not keys_are_partial()
    if all_keys and _within_the_least_bound(xp, row_sums, acc_dtype, n_keys, logit_terms):
        return
    lazy = callable(products)
    tol = row_sum_tolerance(xp, acc_dtype, n_keys, lse, logit_terms, 0.0 if lazy else products)
    dead = lse == -xp.inf
    # a sum of 0 counts as the smallest positive number of the dtype: allowed only where the
    # bound spans the whole exponent range (an lse that rounds the row's maximum away). Its
    # log is formed from the exponent, not taken of the number: where the process flushes
    # subnormals to zero (JAX does), float64's smallest one reads as 0
    info = np.finfo(acc_dtype)
    log_tiny = (info.minexp - info.nmant) * math.log(2.0)
    positive = row_sums > 0
    log_sum = xp.where(positive, xp.log(xp.where(positive, row_sums, 1.0)), log_tiny)
    judged = (xp.abs(log_sum) if all_keys else log_sum)
    unjudged = dead | xp.isnan(row_sums)
    off = xp.where(unjudged, 0.0, judged - tol)
    if sees_keys is not None:
        wrongly_dead = dead & xp.asarray(sees_keys, dtype=bool)
        if bool(wrongly_dead.any()):
            row = _index(xp, wrongly_dead.argmax(), lse.shape)
            raise ValueError(
                f"`lse` must be the one attention returned for these inputs and options: it "
                f"is -inf at row {row}, which sees keys (a row of -inf lse sees none); "
                f"expected each row's sum of exp(s - lse) to be 1 there, got 0")
    worst = int(off.argmax())
    if lazy and float(off.reshape(-1)[worst]) > 0:
        # a row past the bound of R = 0: judged again by the bound of its own R
        tol = row_sum_tolerance(xp, acc_dtype, n_keys, lse, logit_terms, products())
        off = xp.where(unjudged, 0.0, judged - tol)
        worst = int(off.argmax())
    if float(off.reshape(-1)[worst]) > 0:
        row = _index(xp, worst, lse.shape)
        got = float(row_sums.reshape(-1)[worst])
        allowed = float(xp.broadcast_to(tol, lse.shape).reshape(-1)[worst])
        raise ValueError(
            f"`lse` must be the one attention returned for these inputs and options: each "
            f"row's sum of exp(s - lse) must be 1 for a row that sees a key (|log sum| <= "
            f"{allowed:.3g} at this row, rounding of {np.dtype(acc_dtype).name}), 0 for one "
            f"that sees none; row {row} sums to {got:.6g} (lse {float(lse.reshape(-1)[worst])!r})"
            f": there lse exceeds the log-sum-exp of the row's logits by {_offset(got)}")


def _within_the_least_bound(xp, row_sums, acc_dtype, n_keys, logit_terms):
    """Whether every row's sum (float64) is within the bound of ``|lse| = R = 0`` and the
    fewest keys, the least of the rows' bounds (each grows with ``|lse|``, ``R`` and the
    keys): then every row passes and the rest of the check is not needed. Most genuine
    ``lse`` are; a NaN sum, and the 0 of a row given ``lse = -inf``, are not. The least and
    the most of the sums, where the whole check makes about 15 passes over the rows."""
    fewest = float(xp.min(xp.asarray(n_keys))) if np.ndim(n_keys) else float(n_keys)
    tol = _tolerance(acc_dtype, fewest, 0.0, 0.0, logit_terms, math.log1p) * (1 - 1e-6)
    # within these, |log sum| <= the bound; a NaN makes the least and the most NaN
    return bool(row_sums.min() >= math.exp(-tol)) and bool(row_sums.max() <= math.exp(tol))


def _offset(total):
    if 0 < total < math.inf:
        return f"about {-math.log(total):.3g}"
    return "more than the dtype's range" if total == 0 else "minus more than the dtype's range"


def _index(xp, flat, shape):
    return tuple(int(i) for i in xp.unravel_index(int(flat), shape))
