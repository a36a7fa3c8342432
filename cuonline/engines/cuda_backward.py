"""The CUDA engine's attention backward: our backward kernels on CuPy arrays
(``backend="cupy"``) or emulated on the CPU with NumPy arrays (``backend="emulate"``).

The same steps as the forward engine (:mod:`cuonline.engines.cuda`): target
(:func:`cuonline.engines.target.current`) -> plan
(:func:`cuonline.kernels.families.plan_backward`: the tensor-core family,
``kernels_cu/attention_bwd_mma.cu``, on sm_80+ for 16-bit and float64 inputs and float32 with
``precision="tf32"``, with the options it has and finite inputs, else
``kernels_cu/attention_bwd_simt.cu``; its planner's tiles and spec) -> module (the target
compiles the family's text) -> typed arguments
(:func:`cuonline.kernels.arguments.attention_bwd_arguments`) -> launches: dK/dV, then dQ (once
per batch element sharing a bias), then with rel_q/rel_k the rel_k kernel.

Host work, all in a fixed order (no atomics, no reduction whose order depends on scheduling,
so two runs give bitwise identical gradients): ``Delta_i = rowsum(dO_i * O_i)`` in the
accumulation dtype, the sums over broadcast dimensions (one reduction per gradient), and the
sums of the kernels' partials (a block bias's slots, the query tiles' relative partials). No
array of Lq x Lk places is allocated unless it is the gradient (a bias, once per distinct
bias: the batch elements sharing it add into it one dQ launch after another): the dQ kernel
reduces a block bias's, rel_bias's and rel_q/rel_k's gradients per tile, rel_k's rows between
its clamped ends come from the rel_k kernel (``kernels_cu/attention_grads.cuh``). The dQ
kernel also sums each row's weights P; an ``lse`` under which they do not sum to 1 is a
ValueError (:func:`cuonline._lse_check.check_row_sums`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from .. import _lse_check
from .._gradients import GRADIENT_FIELDS, gradients_of
from ..kernels import arguments, families, heuristics
from . import target as _target

if TYPE_CHECKING:
    from .._gradients import Gradients
    from .._validate import BackwardProblem

__all__ = ["attention_backward", "block_bias_slots", "gradients"]

def attention_backward(bp: BackwardProblem) -> Gradients:
    """Run the backward of ``bp`` (a :class:`cuonline._validate.BackwardProblem`); return
    :class:`cuonline._gradients.Gradients`, each gradient of its input's shape as passed (a
    broadcast input gets the sum over its broadcast dimensions)."""
    full = gradients(bp.forward, bp.dout, bp.out, bp.lse,
                     bias_shape=bp.targets["bias"].shape if "bias" in bp.targets else None)
    xp = bp.forward.xp
    # each input (BackwardProblem.targets' names) from its field of the per-batch result; the
    # dimensions an input was broadcast along summed by one reduction each
    return gradients_of({name: bp.reduce(name, _sum_broadcast(xp, full[field],
                                                               bp.targets[name].shape))
                         for name, field in GRADIENT_FIELDS.items() if full[field] is not None})


def _sum_broadcast(xp, grad, shape):
    """``grad`` summed (one reduction, keeping the dimensions) over every dimension along
    which an input of ``shape`` was broadcast to it."""
    padded = (1,) * (grad.ndim - len(shape)) + tuple(shape)
    axes = tuple(a for a, (n, g) in enumerate(zip(padded, grad.shape)) if n == 1 and g != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


def gradients(p, dout, out, lse, *, bias_shape=None):
    """The gradients of :class:`cuonline._validate.Problem` ``p`` for output gradient
    ``dout``, at the forward's ``out`` and ``lse``, per batch element: a dict with ``dq``
    ``batch_shape + (lq, d)``, ``dk`` ``batch_shape + (lk, d)``, ``dv`` ``batch_shape +
    (lk, dv)`` and, for the terms ``p`` has (else None), ``dbias`` (the bias's batch-shaped
    view: ``batch_shape + (lq, lk)``, or the coarse ``batch_shape + (ceil(lq / r),
    ceil(lk / c))`` of a block bias), ``drel_bias`` ``batch_shape + (Rb,)``, ``drel_q``
    ``batch_shape + (lq, Dr)`` and ``drel_k`` ``batch_shape + (Rk, Dr)``; all in the
    accumulation dtype. With ``bias_shape`` (the shape of the bias as passed) a plain bias's
    ``dbias`` is already summed over the batch dimensions it was broadcast along (kept as
    length 1): the dQ kernel accumulates it in place, one launch per batch element sharing it.

    ``dout`` and ``out`` broadcast to ``batch_shape + (lq, dv)``, ``lse`` to ``batch_shape +
    (lq,)``. Tests steer the target through :func:`cuonline.engines.target.overrides`.
    """
    return _run(p, dout, out, lse, _target.current(p.backend), bias_shape)


def _run(p, dout, out, lse, target, bias_shape=None):
    xp = p.xp
    acc = p.acc_dtype
    shape = p.batch_shape
    dout = xp.broadcast_to(dout, shape + (p.lq, p.dv))
    out = xp.broadcast_to(out, shape + (p.lq, p.dv))
    rel_bias = getattr(p, "rel_bias", None) is not None
    rel_qk = _has_rel_qk(p)
    if p.nbatch == 0 or p.lq == 0 or p.lk == 0:
        # no place is visible: every gradient is zero
        return _zero_result(p)
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
        g = _run(padded, dout, out, lse, target, bias_shape)
        if p.d == 0:
            g["dq"], g["dk"] = g["dq"][..., :0], g["dk"][..., :0]
        if p.dv == 0:
            g["dv"] = g["dv"][..., :0]
        return g

    plan = families.plan_backward(p, target.launch(
        cp_async=(arguments.cp_async_aligned(p)
                  and arguments.view_cp_async_aligned(dout, p.batch_shape)),
        finite_inputs=lambda: all(bool(xp.isfinite(_distinct(x)).all())
                                  for x in (p.q, p.k, p.v, dout))))
    family = families.of(plan.spec)
    want_ds = plan.spec.write_ds
    nb = p.nbatch
    # a bias shared along batch dimensions: the batch elements reordered so that those sharing
    # it are `sharing` runs of `nb // sharing` (order[b'] = b; None: the given order)
    order, sharing = _sharing_order(shape, bias_shape) if want_ds else (None, 1)
    # Delta_i = rowsum(dO_i * O_i), in the accumulation dtype
    delta = xp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
    delta = xp.ascontiguousarray(xp.reshape(delta, (nb, p.lq)))
    lse = xp.ascontiguousarray(xp.reshape(
        xp.broadcast_to(xp.asarray(lse).astype(acc, copy=False), shape + (p.lq,)), (nb, p.lq)))
    if order is not None:
        order = xp.asarray(order)
        delta, lse = delta[order], lse[order]
    dq = xp.empty((nb, p.lq, p.d), dtype=acc)
    dk = xp.empty((nb, p.lk, p.d), dtype=acc)
    dv = xp.empty((nb, p.lk, p.dv), dtype=acc)
    # dS only where it is the gradient (a bias: its places outside every query tile's key
    # loop are never written, so zero from the start); the other gradients are reduced in the
    # kernels into partials (zero from the start), which the key tiles add to: a block bias's
    # per block in `slots` copies (query tiles sharing a block row write different ones), the
    # relative ones per query tile (drel_q: per row)
    tiles = -(-p.lq // plan.spec.block_r)
    if plan.varlen is not None:
        tiles = len(plan.varlen[0])   # a packed batch: a slot per dQ block of its table
    block = getattr(p, "bias_block", None)
    slots = 0
    if want_ds:
        # dS, the bias's gradient: the elements sharing a slot add into it one launch after
        # another (zero from the start)
        ds = xp.zeros((nb // sharing, p.lq, p.lk), dtype=acc)
    elif p.bias is not None:
        rows, cols = (min(n, max(size, 1)) for n, size in zip(block, (p.lq, p.lk)))
        slots = block_bias_slots(rows, plan.spec.block_r, tiles)
        ds = xp.zeros((nb, slots, -(-p.lq // rows), -(-p.lk // cols)), dtype=acc)
    else:
        ds = None
    drel_bias = (xp.zeros((nb, tiles, 2 * p.rel_bias_radius + 1), dtype=acc)
                 if rel_bias else None)
    drel_q = xp.zeros((nb, p.lq, p.dr), dtype=acc) if rel_qk else None
    # rel_k's gradient: its end rows (every distance beyond the radius) as the dQ kernel's
    # per-tile partials, the rows between from the rel_k kernel (one warp per row)
    drel_k = xp.zeros((nb, tiles, 2, p.dr), dtype=acc) if rel_qk else None
    rel_k_rows = xp.zeros((nb, 2 * p.rel_k_radius + 1, p.dr), dtype=acc) if rel_qk else None
    row_sums = xp.empty((nb, p.lq), dtype=acc)
    args = family.arguments(p, plan, dict(dout=dout, lse=lse, delta=delta, dq=dq, dk=dk, dv=dv,
                                          ds=ds, drel_bias=drel_bias, drel_q=drel_q,
                                          drel_k=drel_k, row_sums=row_sums))
    if order is not None:
        # the operands' offset rows and the per-element tables in the same order
        args = _reordered(args, order)

    module = target.module(plan.spec)
    kernels = [module.get_function(entry) for entry in family.entries]
    if plan.shared_bytes > heuristics.SMEM_NO_OPT_IN:
        for kernel in kernels[:2]:
            kernel.max_dynamic_shared_size_bytes = plan.shared_bytes
    # the family's entry points, dK/dV then dQ; the dQ kernel once per batch element
    # sharing the bias, in the C order of its broadcast indices (each launch adds into every
    # slot of ds at most once: a fixed order, no atomics); then the rel_k kernel
    kernels[0](plan.grid_dkdv, plan.block, args, shared_mem=plan.shared_bytes)
    for part in range(sharing):
        kernels[1]((plan.grid_dq[0] // sharing,) + plan.grid_dq[1:], plan.block,
                   args if sharing == 1 else _batch_run(args, part, nb // sharing),
                   shared_mem=plan.shared_bytes)
    if plan.grid_rel_k[0]:
        kernels[2](plan.grid_rel_k, plan.rel_k_block, _with(args, drel_k=rel_k_rows))

    def full(x):
        # the batch elements back in their order (the sums over partials taken first)
        x = x if order is None else x[_inverse(xp, order)]
        return xp.reshape(x, shape + x.shape[1:])

    _check_lse(p, full(row_sums), full(lse))
    given = dict(dq=full(dq), dk=full(dk), dv=full(dv))
    if ds is not None and order is not None:
        # summed over the broadcast dimensions (kept as length 1) in the kernel
        given["dbias"] = xp.reshape(ds, _batch_lead(shape, bias_shape) + ds.shape[1:])
    elif ds is not None:
        # a block bias: its slots summed in one fixed-order reduction
        given["dbias"] = full(ds) if not slots else full(ds.sum(axis=1))
    if rel_bias:
        # the query tiles' partials, summed in one fixed-order reduction
        given["drel_bias"] = full(drel_bias.sum(axis=1))
    if rel_qk:
        # the end rows: the query tiles' partials summed in one fixed-order reduction each
        ends = drel_k.sum(axis=1)
        rel_k_rows[:, 0] += ends[:, 0]
        if p.rel_k_radius:
            rel_k_rows[:, -1] += ends[:, 1]
        given["drel_q"], given["drel_k"] = full(drel_q), full(rel_k_rows)
    return _zero_result(p, **given)


#: The kernel arguments that hold one row per batch element (the dQ kernel's block b reads
#: and writes row b): reordered with the batch, sliced per dQ launch.
_PER_ELEMENT = ("kv_lengths", "alibi_slopes", "lse", "delta", "dq", "dk", "dv", "drel_bias",
                "drel_q", "drel_k", "row_sums", "offsets")


def _batch_lead(batch_shape, shape):
    """The batch dimensions of an input of ``shape`` (its trailing two are (Lq, Lk)) padded
    with ones to ``batch_shape``'s rank."""
    lead = (1,) * (len(batch_shape) + 2 - len(shape)) + tuple(shape)
    return lead[:len(batch_shape)]


def _sharing_order(batch_shape, shape):
    """``(order, sharing)`` for a bias of ``shape`` on ``batch_shape``: ``sharing`` batch
    elements add into each slot of its gradient; ``order`` (None where ``sharing`` is 1) lists
    the batch elements with the broadcast dimensions outermost, in C order, so that run
    ``g`` of ``order`` (``nbatch // sharing`` elements) holds the g-th sharer of every slot,
    the slots in C order."""
    if shape is None:
        return None, 1
    lead = _batch_lead(batch_shape, shape)
    axes = [a for a, (n, m) in enumerate(zip(lead, batch_shape)) if n == 1 and m != 1]
    if not axes:
        return None, 1
    kept = [a for a in range(len(batch_shape)) if a not in axes]
    order = np.arange(int(np.prod(batch_shape))).reshape(batch_shape).transpose(axes + kept)
    return order.reshape(-1), int(np.prod([batch_shape[a] for a in axes]))


def _inverse(xp, order):
    """The permutation that undoes ``order``."""
    inverse = xp.empty_like(order)
    inverse[order] = xp.arange(order.size, dtype=order.dtype)
    return inverse


def _reordered(args, order):
    """The kernel arguments with the batch elements in ``order``: the offset table's rows and
    the per-element tables the argument builder made (the workspaces are allocated in that
    order already)."""
    named = dict(zip(arguments.ATTENTION_BWD_SIGNATURE, args))
    return _with(args, **{name: named[name][order]
                          for name in ("kv_lengths", "alibi_slopes", "offsets")
                          if named[name] is not None})


def _batch_run(args, part, count):
    """The arguments of the dQ launch over the batch elements ``[part count, (part + 1)
    count)`` (contiguous views of every per-element argument)."""
    named = dict(zip(arguments.ATTENTION_BWD_SIGNATURE, args))
    return _with(args, **{name: named[name][part * count:(part + 1) * count]
                          for name in _PER_ELEMENT if named[name] is not None})


def _with(args, **values):
    """The kernel arguments ``args`` with the named ones replaced by ``values``."""
    named = dict(zip(arguments.ATTENTION_BWD_SIGNATURE, args), **values)
    return tuple(named[name] for name in arguments.ATTENTION_BWD_SIGNATURE)


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
    def products():                     # only where a row is past the bound of R = 0
        bound = _lse_check.product_bound(xp, p.q, p.k, p.scale, kv_lengths=lengths,
                                         rel_q=p.rel_q if rel else None,
                                         rel_k=p.rel_k if rel else None)
        return bound * _TF32_PRODUCTS if p.precision == "tf32" else bound

    _lse_check.check_row_sums(
        xp, xp.where(dead, 0, row_sums), lse, acc_dtype=p.acc_dtype,
        n_keys=p.lk if lengths is None else xp.asarray(lengths)[..., None],
        logit_terms=p.d + (p.dr if rel else 0), products=products,
        sees_keys=dead & (row_sums != 0))


def _distinct(x):
    """The elements of the broadcast view ``x`` once each: its zero-stride axes cut to length 1
    (k and v shared by a group of query heads are scanned once, not once per head)."""
    return x[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in x.strides)]


def _has_rel_qk(p):
    """Whether ``p`` has the rel_q · rel_k term (Dr = 0 adds exactly 0: no gradient flows)."""
    return getattr(p, "rel_q", None) is not None and p.dr > 0


def _zero_result(p, **given):
    """The gradients of ``p`` (:func:`gradients`' dict): those ``given``, zero for every
    other term ``p`` has (no place is visible, or Dr = 0: no gradient flows), None for the
    terms it has not."""
    xp = p.xp
    shape = p.batch_shape

    def zeros(*tail):
        return xp.zeros(shape + tuple(tail), dtype=p.acc_dtype)

    tails = dict(dq=(p.lq, p.d), dk=(p.lk, p.d), dv=(p.lk, p.dv))
    if p.bias is not None:
        block = getattr(p, "bias_block", None)
        tails["dbias"] = ((p.lq, p.lk) if block is None else
                          (-(-p.lq // max(1, min(block[0], max(p.lq, 1)))),
                           -(-p.lk // max(1, min(block[1], max(p.lk, 1))))))
    if getattr(p, "rel_bias", None) is not None:
        tails["drel_bias"] = (2 * p.rel_bias_radius + 1,)
    if getattr(p, "rel_q", None) is not None:
        tails["drel_q"], tails["drel_k"] = p.rel_q.shape[-2:], p.rel_k.shape[-2:]
    result = dict.fromkeys(("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k"))
    for name, tail in tails.items():
        result[name] = given[name] if name in given else zeros(*tail)
    return result


def block_bias_slots(rows, block_r, n_tiles):
    """How many copies of a block bias's gradient the dQ kernel adds into
    (``block_bias_slots`` in ``kernels_cu/attention_grads.cuh``): query tile t of ``block_r``
    rows writes copy ``t % slots``, and two tiles that share a block of ``rows`` rows never
    share a copy. One where the blocks tile the query tiles."""
    slots = 1 if rows <= block_r and block_r % rows == 0 else (rows - 1) // block_r + 2
    return min(slots, n_tiles)
