"""The CUDA engine's attention backward: our backward kernels on CuPy arrays
(``backend="cupy"``) or emulated on the CPU with NumPy arrays (``backend="emulate"``).

The same steps as the forward engine (:mod:`cuonline.engines.cuda`): target
(:func:`cuonline.engines.target.current`) -> family (the tensor-core one,
``kernels_cu/attention_bwd_mma.cu``, on sm_80+ for 16-bit and float64 inputs and float32 with
``precision="tf32"``, with the options it has and finite inputs; else
``kernels_cu/attention_bwd_simt.cu``) -> plan
(:func:`cuonline.kernels.heuristics.plan_bwd_mma` or ``plan_bwd_simt``: tiles and spec) ->
module (the target compiles the family's text) -> typed arguments
(:func:`cuonline.kernels.arguments.attention_bwd_arguments`) -> two launches, dK/dV then dQ.

Host work, all in a fixed order (no atomics, no reduction whose order depends on scheduling,
so two runs give bitwise identical gradients): ``Delta_i = rowsum(dO_i * O_i)`` in the
accumulation dtype, the sums over broadcast dimensions, and the bias-type gradients reduced
from the kernels' dS workspace (a bias to its shape, a block bias over its blocks, a relative
bias over its diagonals). The dQ kernel also sums each row's weights P; an ``lse`` under
which they do not sum to 1 is a ValueError (:func:`cuonline._lse_check.check_row_sums`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _lse_check
from ..kernels import arguments, families, features, heuristics
from ..kernels.specs import AttentionBwdMmaSpec
from . import target as _target

__all__ = ["attention_backward", "gradients", "weighted_sums"]

#: Gradient fields of the per-batch result and of Gradients -> the input each belongs to.
_INPUTS = {"dq": "q", "dk": "k", "dv": "v", "dbias": "bias", "drel_bias": "rel_bias",
           "drel_q": "rel_q", "drel_k": "rel_k"}


def attention_backward(bp):
    """Run the backward of ``bp`` (a :class:`cuonline._validate.BackwardProblem`); return
    :class:`cuonline._gradients.Gradients`, each gradient of its input's shape as passed (a
    broadcast input gets the sum over its broadcast dimensions)."""
    from .._gradients import Gradients  # noqa: PLC0415 - the API's result type

    full = gradients(bp.forward, bp.dout, bp.out, bp.lse)
    # gradient field -> the input it belongs to (BackwardProblem.targets' names)
    return Gradients(**{field: bp.reduce(name, full[field])
                        for field, name in _INPUTS.items() if full[field] is not None})


def gradients(p, dout, out, lse):
    """The gradients of :class:`cuonline._validate.Problem` ``p`` for output gradient
    ``dout``, at the forward's ``out`` and ``lse``, per batch element: a dict with ``dq``
    ``batch_shape + (lq, d)``, ``dk`` ``batch_shape + (lk, d)``, ``dv`` ``batch_shape +
    (lk, dv)`` and, for the terms ``p`` has (else None), ``dbias`` (the bias's batch-shaped
    view: ``batch_shape + (lq, lk)``, or the coarse ``batch_shape + (ceil(lq / r),
    ceil(lk / c))`` of a block bias), ``drel_bias`` ``batch_shape + (Rb,)``, ``drel_q``
    ``batch_shape + (lq, Dr)`` and ``drel_k`` ``batch_shape + (Rk, Dr)``; all in the
    accumulation dtype.

    ``dout`` and ``out`` broadcast to ``batch_shape + (lq, dv)``, ``lse`` to ``batch_shape +
    (lq,)``. Tests steer the target through :func:`cuonline.engines.target.overrides`.
    """
    return _run(p, dout, out, lse, _target.current(p.backend))


def _run(p, dout, out, lse, target):
    xp = p.xp
    acc = p.acc_dtype
    shape = p.batch_shape
    dout = xp.broadcast_to(dout, shape + (p.lq, p.dv))
    out = xp.broadcast_to(out, shape + (p.lq, p.dv))
    want_ds = heuristics.bwd_writes_ds(_bias_terms(p))
    want_dc = _has_rel_qk(p)
    if p.nbatch == 0 or p.lq == 0 or p.lk == 0:
        # no place is visible: every gradient is zero
        def places():
            return xp.zeros(shape + (p.lq, p.lk), dtype=acc)

        return _result(p, xp.zeros(shape + (p.lq, p.d), dtype=acc),
                       xp.zeros(shape + (p.lk, p.d), dtype=acc),
                       xp.zeros(shape + (p.lk, p.dv), dtype=acc),
                       places() if want_ds else None, places() if want_dc else None)
    if p.d == 0 or p.dv == 0:
        # As the forward: D = 0 is one column of zeros in q and k (every q·k is 0), Dv = 0 one
        # column of zeros in v, out and dout (dP = 0, Delta = 0: no gradient flows). The padded
        # columns' gradients are dropped.
        def zeros(rows):
            return xp.broadcast_to(xp.zeros((1, 1), dtype=p.dtype), shape + (rows, 1))

        padded = p
        if p.d == 0:
            padded = dataclasses.replace(padded, d=1, q=zeros(p.lq), k=zeros(p.lk))
        if p.dv == 0:
            padded = dataclasses.replace(padded, dv=1, v=zeros(p.lk))
            dout = out = zeros(p.lq)
        g = _run(padded, dout, out, lse, target)
        if p.d == 0:
            g["dq"], g["dk"] = g["dq"][..., :0], g["dk"][..., :0]
        if p.dv == 0:
            g["dv"] = g["dv"][..., :0]
        return g

    plan = _plan(p, dout, target, want_ds)
    family = families.of(plan.spec)
    nb = p.nbatch
    # Delta_i = rowsum(dO_i * O_i), in the accumulation dtype
    delta = xp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
    delta = xp.ascontiguousarray(xp.reshape(delta, (nb, p.lq)))
    lse = xp.ascontiguousarray(xp.reshape(
        xp.broadcast_to(xp.asarray(lse).astype(acc, copy=False), shape + (p.lq,)), (nb, p.lq)))
    dq = xp.empty((nb, p.lq, p.d), dtype=acc)
    dk = xp.empty((nb, p.lk, p.d), dtype=acc)
    dv = xp.empty((nb, p.lk, p.dv), dtype=acc)
    # places outside every query tile's key loop are never written: zero from the start
    ds = xp.zeros((nb, p.lq, p.lk), dtype=acc) if want_ds else None
    dc = xp.zeros((nb, p.lq, p.lk), dtype=acc) if want_dc else None
    row_sums = xp.empty((nb, p.lq), dtype=acc)
    args = family.arguments(p, dout, lse, delta, dq, dk, dv, ds, dc, row_sums)

    module = target.module(plan.spec)
    # the family's two entry points, dK/dV then dQ
    for entry, grid in zip(family.entries, (plan.grid_dkdv, plan.grid_dq)):
        kernel = module.get_function(entry)
        if plan.shared_bytes > heuristics.SMEM_NO_OPT_IN:
            kernel.max_dynamic_shared_size_bytes = plan.shared_bytes
        kernel(grid, plan.block, args, shared_mem=plan.shared_bytes)
    _check_lse(p, xp.reshape(row_sums, shape + (p.lq,)), xp.reshape(lse, shape + (p.lq,)))

    def full(x):
        return xp.reshape(x, shape + x.shape[1:])

    return _result(p, full(dq), full(dk), full(dv), None if ds is None else full(ds),
                   None if dc is None else full(dc))


#: precision="tf32" rounds q and k to 10 mantissa bits where a family has tensor cores, and not
#: where it falls back to SIMT: a logit's products may differ by TF32's epsilon (2**-10), not
#: float32's (2**-23), between the forward's lse and this backward.
_TF32_PRODUCTS = 2.0**13


def _check_lse(p, row_sums, lse):
    """Refuse an ``lse`` that does not belong to ``p`` (:func:`cuonline._lse_check
    .check_row_sums`) from the dQ kernel's ``row_sums`` ``batch_shape + (lq,)``: its sums of
    P, which are +inf on a row that sees a key under ``lse = -inf`` (P = exp(s + inf))."""
    xp = p.xp
    dead = lse == -np.inf
    lengths = p.kv_lengths
    rel = _has_rel_qk(p)
    products = _lse_check.product_bound(xp, p.q, p.k, p.scale, kv_lengths=lengths,
                                        rel_q=p.rel_q if rel else None,
                                        rel_k=p.rel_k if rel else None)
    if p.precision == "tf32":
        products = products * _TF32_PRODUCTS
    _lse_check.check_row_sums(
        xp, xp.where(dead, 0, row_sums), lse, acc_dtype=p.acc_dtype,
        n_keys=p.lk if lengths is None else xp.asarray(lengths)[..., None],
        logit_terms=p.d + (p.dr if rel else 0), products=products,
        sees_keys=dead & (row_sums != 0))


def _distinct(x):
    """The elements of the broadcast view ``x`` once each: its zero-stride axes cut to length 1
    (k and v shared by a group of query heads are scanned once, not once per head)."""
    return x[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in x.strides)]


def _plan(p, dout, target, want_ds):
    """The launch plan: the tensor-core family where it runs the call
    (:func:`cuonline.kernels.families.backward_family`) and every q, k, v and dout element is
    finite (its mmas would carry a NaN or inf into rows that do not see it, where the SIMT
    family skips zero weights), else the SIMT family."""
    names = features.backward_of_problem(p)
    if target.family == "attention_bwd_simt":      # tests pin a family (overrides(family=))
        return heuristics.plan_bwd_simt(p, arch=target.arch, write_ds=want_ds)
    # the tensor-core family where its block fits the arch (not float64 with a wide
    # rel_q/rel_k on a 99 KiB GPU), else the SIMT family plans it or says why not
    family = families.backward_family(p.dtype, p.d, p.dv, names, target.arch, p.precision,
                                      p.dr if "rel_qk" in names else 0)
    xp = p.xp
    if family.spec is AttentionBwdMmaSpec and all(
            bool(xp.isfinite(_distinct(x)).all()) for x in (p.q, p.k, p.v, dout)):
        cp_async = (arguments.cp_async_aligned(p)
                    and arguments.view_cp_async_aligned(dout, p.batch_shape))
        return heuristics.plan_bwd_mma(p, arch=target.arch, write_ds=want_ds,
                                       cp_async=cp_async)
    return heuristics.plan_bwd_simt(p, arch=target.arch, write_ds=want_ds)


def _bias_terms(p):
    """The bias-type terms ``p`` has (their gradient is dS, reduced)."""
    return tuple(n for n, x in (("bias", p.bias), ("rel_bias", getattr(p, "rel_bias", None)))
                 if x is not None)


def _has_rel_qk(p):
    """Whether ``p`` has the rel_q · rel_k term (Dr = 0 adds exactly 0: no gradient flows)."""
    return getattr(p, "rel_q", None) is not None and p.dr > 0


def _result(p, dq, dk, dv, ds, dc):
    xp = p.xp
    result = dict(dq=dq, dk=dk, dv=dv, dbias=None, drel_bias=None, drel_q=None, drel_k=None)
    if p.bias is not None:
        block = getattr(p, "bias_block", None)
        result["dbias"] = ds if block is None else block_sums(xp, ds, block)
    if getattr(p, "rel_bias", None) is not None:
        result["drel_bias"] = diagonal_sums(xp, ds, p.diagonal_offset, p.rel_bias_radius)
    if getattr(p, "rel_q", None) is not None:
        if dc is None:   # Dr = 0: empty gradients
            result["drel_q"] = xp.zeros(p.batch_shape + p.rel_q.shape[-2:], dtype=p.acc_dtype)
            result["drel_k"] = xp.zeros(p.batch_shape + p.rel_k.shape[-2:], dtype=p.acc_dtype)
        else:
            result["drel_q"], result["drel_k"] = relative_qk_sums(
                xp, dc, p.rel_q, p.rel_k, p.diagonal_offset, p.rel_k_radius)
    return result


def block_sums(xp, ds, block):
    """``ds`` ``(..., lq, lk)`` summed over blocks of ``block = (r, c)`` places: ``(...,
    ceil(lq / r), ceil(lk / c))`` (a block cut by the edge sums what it has)."""
    lq, lk = ds.shape[-2:]
    # a block taller (wider) than the places is one block, as in the forward's arguments:
    # clipped, the padding below stays under one block of the places' own size
    r, c = min(block[0], max(lq, 1)), min(block[1], max(lk, 1))
    rows, cols = -(-lq // r), -(-lk // c)
    padded = xp.zeros(ds.shape[:-2] + (rows * r, cols * c), dtype=ds.dtype)
    padded[..., :lq, :lk] = ds
    return padded.reshape(ds.shape[:-2] + (rows, r, cols, c)).sum(axis=(-3, -1))


def diagonal_sums(xp, ds, diagonal_offset, radius):
    """The gradient of a relative bias of radius ``radius`` from ``ds`` ``(..., lq, lk)``:
    entry ``radius + clip(delta, -radius, radius)`` sums the places of that clipped
    ``delta = j - i - diagonal_offset``; shape ``(..., 2 radius + 1)``.

    The places of one diagonal are gathered by a skew (place (i, j) to column j - i + lq - 1,
    each written once), summed over i, then the diagonals beyond the radius are summed into
    the two end entries: fixed orders throughout.
    """
    skew, base = _skew(xp, ds, diagonal_offset)
    return _clip_merge(xp, skew.sum(axis=-2), base, radius)


def relative_qk_sums(xp, dc, rel_q, rel_k, diagonal_offset, radius):
    """The gradients of ``rel_q`` ``(..., lq, Dr)`` and ``rel_k`` ``(..., 2 radius + 1, Dr)``
    from the content gradient ``dc`` ``(..., lq, lk)``: place (i, j) adds ``dc rel_k[row]``
    to ``rel_q[i]`` and ``dc rel_q[i]`` to ``rel_k[row]``, row = ``radius + clip(delta, -radius,
    radius)``. On the skew of ``dc`` (one column per diagonal, each of one row of ``rel_k``)
    both are matrix products, then the diagonals beyond the radius are merged into the end
    rows as in :func:`diagonal_sums`."""
    lq = dc.shape[-2]
    batch = dc.shape[:-2]
    skew, base = _skew(xp, dc, diagonal_offset)           # (..., lq, n)
    n = skew.shape[-1]
    table = xp.broadcast_to(rel_k, batch + rel_k.shape[-2:]).astype(dc.dtype, copy=False)
    rows = xp.clip(xp.arange(n) + base, -radius, radius) + radius
    drel_q = weighted_sums(xp, skew, table[..., rows, :])        # (..., lq, Dr)
    queries = xp.broadcast_to(rel_q, batch + (lq, rel_q.shape[-1])).astype(dc.dtype, copy=False)
    per_diagonal = weighted_sums(xp, xp.swapaxes(skew, -1, -2), queries)   # (..., n, Dr)
    drel_k = _clip_merge(xp, xp.moveaxis(per_diagonal, -1, -2), base, radius)
    return drel_q, xp.moveaxis(drel_k, -1, -2)


def weighted_sums(xp, w, x):
    """``w @ x`` (``(..., m, n) @ (..., n, c)``) where a zero weight adds exactly 0, whatever
    ``x`` holds there: the rows of a relative table that no visible place uses (weight 0) may
    be NaN or inf, and a matrix product would make 0 * NaN = NaN of them (docs/semantics.md:
    invisible places contribute exactly zero).

    Finite ``x``: the product itself. Otherwise the product of the finite part, and each
    non-finite entry added where a non-zero weight meets it: NaN, or an infinity of the sign
    of weight times entry (both signs: NaN), counted by products of indicators.
    """
    bad = ~xp.isfinite(x)
    if not bool(bad.any()):
        return xp.matmul(w, x)
    result = xp.matmul(w, xp.where(bad, 0, x))

    def meets(weights, entries):   # how many non-zero weights meet such entries, per result
        return xp.matmul(weights.astype(result.dtype), entries.astype(result.dtype)) > 0

    positive, negative = w > 0, w < 0
    plus, minus = x == np.inf, x == -np.inf
    to_plus = meets(positive, plus) | meets(negative, minus)
    to_minus = meets(positive, minus) | meets(negative, plus)
    result = xp.where(meets(w != 0, xp.isnan(x)), np.nan, result)
    result = xp.where(to_plus, result + np.inf, result)
    return xp.where(to_minus, result - np.inf, result)       # with to_plus: inf - inf = NaN


def _skew(xp, x, diagonal_offset):
    """``x`` ``(..., lq, lk)`` with place (i, j) moved to column j - i + lq - 1 of a zero
    ``(..., lq, lq + lk - 1)`` array (each place written once); and the delta of column 0."""
    lq, lk = x.shape[-2:]
    skew = xp.zeros(x.shape[:-2] + (lq, lq + lk - 1), dtype=x.dtype)
    rows = xp.arange(lq)[:, None]
    skew[..., rows, xp.arange(lk)[None, :] - rows + (lq - 1)] = x
    return skew, -(lq - 1) - int(diagonal_offset)


def _clip_merge(xp, per_diagonal, base, radius):
    """Per-diagonal values ``(..., n)`` (column k has delta ``k + base``) summed into the
    ``2 radius + 1`` entries of the clipped deltas: the interior ones are single columns, the
    two ends the sums of the columns beyond the radius."""
    n = per_diagonal.shape[-1]
    out = xp.zeros(per_diagonal.shape[:-1] + (2 * radius + 1,), dtype=per_diagonal.dtype)

    def column(delta):                          # the column of `delta`, clipped to [0, n]
        return min(max(delta - base, 0), n)

    if radius == 0:
        out[..., 0] = per_diagonal.sum(axis=-1)
        return out
    low, high = column(-radius + 1), column(radius)   # columns of the interior deltas
    out[..., 0] = per_diagonal[..., :low].sum(axis=-1)
    out[..., -1] = per_diagonal[..., high:].sum(axis=-1)
    if low < high:   # interior deltas: one diagonal each, entry k + base + radius
        out[..., low + base + radius:high + base + radius] = per_diagonal[..., low:high]
    return out
