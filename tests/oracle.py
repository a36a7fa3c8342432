"""A float64 reference for attention, written independently of every engine, and the naive
same-precision computation the tolerances are measured against.

It materialises the full score matrix with plain NumPy, applies each option literally from its
definition in the docs (no online softmax, no tiling, no shared helper from cuonline) and is
meant for small shapes only. Every entry builds its logits with one function, :func:`_logits`,
so the forward, the gradients and the naive computations cannot disagree on a score term.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

#: The options every entry takes, with their defaults (the public ``attention``'s).
_OPTIONS = dict(scale=None, causal=False, window=None, bias=None, mask=None, kv_lengths=None,
                alibi_slopes=None, softcap=None, softcap_bias=False, q_offset=None, k_offset=0,
                bias_block=None, rel_bias=None, rel_q=None, rel_k=None)


def _logits(q, k, batch, rounding=None, *, scale, causal, window, bias, mask, kv_lengths,
            alibi_slopes, softcap, softcap_bias, q_offset, k_offset, bias_block, rel_bias,
            rel_q, rel_k):
    """Every dense piece of the logits, in the documented order, each of ``batch + (Lq, Lk)``:

    ``content = scale * q . k + rel_q[i] . rel_k[delta]`` (rounded to ``rounding`` once, as a
    same-precision kernel holds its scores), ``capped`` (the soft cap of the content unless
    ``softcap_bias``), ``terms`` (``bias`` expanded from its blocks with ``bias_block``,
    ``rel_bias[delta]``, ALiBi), ``pre = capped + terms``, ``logits`` (the cap of ``pre`` if
    ``softcap_bias``) and ``visible``; and the index maps the gradients sum through.

    A relative table of length ``R`` holds distances ``-(R - 1) / 2 .. (R - 1) / 2``; farther
    distances read its end entries. Positions: query ``i`` at ``q_offset + i`` (default
    ``Lk - Lq``), key ``j`` at ``k_offset + j``; ``delta`` = key position - query position,
    exact for offsets of any size (Python ints beyond int64 included).
    """
    rnd = _rounder(rounding)
    lq, d = q.shape[-2:]
    lk = k.shape[-2]
    full = batch + (lq, lk)
    scale = 1.0 / np.sqrt(max(d, 1)) if scale is None else scale
    q_offset = lk - lq if q_offset is None else q_offset
    # delta[i, j] = (k_offset + j) - (q_offset + i): int64 where that is exact, else Python ints
    base = int(k_offset) - int(q_offset)
    exact = np.int64 if abs(base) < 2**60 else object
    delta = (np.arange(lk, dtype=exact)[None, :] - np.arange(lq, dtype=exact)[:, None]
             + (np.int64(base) if exact is np.int64 else base))
    out = SimpleNamespace(scale=scale, delta=delta, kidx=None, bidx=None, blocks=None)

    content = scale * _product("...id,...jd->...ij", q, k, rounding)
    if rel_q is not None:
        table = _f64(rel_k)                                         # (..., R, Dr)
        out.kidx = _table_index(delta, table.shape[-2])             # (Lq, Lk) table entries
        content = content + np.einsum("...id,...ijd->...ij", _f64(rel_q), table[..., out.kidx, :])
    out.content = rnd(np.broadcast_to(content, full))
    capped = out.content
    if softcap is not None and not softcap_bias:
        capped = softcap * np.tanh(capped / softcap)
    terms = np.zeros(full)
    if bias is not None:
        dense = _f64(bias)
        if bias_block is not None:
            r, c = (bias_block, bias_block) if np.ndim(bias_block) == 0 else bias_block
            rows, cols = np.arange(lq) // r, np.arange(lk) // c
            out.blocks = (rows, cols)
            dense = dense[..., rows, :][..., cols]
        terms = terms + dense
    if rel_bias is not None:
        table = _f64(rel_bias)
        out.bidx = _table_index(delta, table.shape[-1])
        terms = terms + table[..., out.bidx]
    if alibi_slopes is not None:
        slopes = np.broadcast_to(_f64(alibi_slopes), batch)[..., None, None]
        terms = terms - slopes * np.abs(delta).astype(np.float64)
    out.capped, out.pre = capped, capped + terms
    out.logits = softcap * np.tanh(out.pre / softcap) if softcap_bias and softcap else out.pre

    visible = np.ones(full, dtype=bool)
    if causal:
        visible &= delta <= 0
    if window is not None:
        left, right = window
        if left is not None:
            visible &= delta >= -left
        if right is not None:
            visible &= delta <= right
    if mask is not None:
        visible &= _np(mask)
    if kv_lengths is not None:
        lengths = np.broadcast_to(_np(kv_lengths), batch)[..., None, None]
        visible &= np.arange(lk)[None, :] < lengths
    out.visible = visible
    return out


def _options(options):
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"oracle: unknown options {sorted(unknown)}")
    return {**_OPTIONS, **options}


def _batch(*arrays):
    return np.broadcast_shapes(*(np.shape(x)[:-2] for x in arrays))


def reference_attention(q, k, v, **options):
    """Return ``(out, lse)`` in float64 for NumPy (or CuPy, converted) inputs.

    Each term is built densely from its definition (:func:`_logits`), then each query row's
    softmax over its visible keys: a row that sees no key gives 0 and ``-inf``, a NaN logit
    it sees gives NaN.
    """
    q, k, v = (_f64(x) for x in (q, k, v))
    batch = _batch(q, k, v)
    lq = q.shape[-2]
    s = _logits(q, k, batch, **_options(options))

    out = np.zeros(batch + (lq, v.shape[-1]))
    lse = np.full(batch + (lq,), -np.inf)
    vv = np.broadcast_to(v, batch + v.shape[-2:])
    for idx in np.ndindex(*batch, lq):
        row_visible = s.visible[idx]
        if not row_visible.any():
            continue
        row = s.logits[idx][row_visible]
        m = row.max()
        if np.isnan(m) or np.isnan(row).any():
            out[idx] = np.nan
            lse[idx] = np.nan
            continue
        w = np.exp(row - m)
        total = w.sum()
        lse[idx] = m + np.log(total)
        out[idx] = (w / total) @ vv[idx[:-1]][row_visible]
    return out, lse


def naive_attention(q, k, v, *, rounding, **options):
    """``(out, lse)`` of a naive computation in the precision ``rounding`` (a dtype, or
    ``"tf32"``): the scores and the weights ``P`` rounded to it, the products ``q k^T`` and
    ``P v`` of operands rounded to it accumulated in float32 (float64 for float64), the output
    rounded to it; as float64 arrays. FlashAttention measures a kernel's error against this
    computation's (tests/support.py)."""
    rnd = _rounder(rounding)
    q, k, v = (_f64(x) for x in (q, k, v))
    batch = _batch(q, k, v)
    s = _logits(q, k, batch, rounding, **_options(options))
    x = np.where(s.visible, s.logits, -np.inf)
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(s.visible, np.exp(x - m), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    seen = total > 0
    p = rnd(np.where(seen, e / np.where(seen, total, 1), 0.0))
    vv = np.broadcast_to(v, batch + v.shape[-2:])
    finite = np.isfinite(vv)
    out = _product("...ij,...jd->...id", p, np.where(finite, vv, 0.0), rounding)
    if not finite.all():
        # a non-finite value reaches only the rows that see its key, as in the reference
        with np.errstate(invalid="ignore"):
            out = out + np.where(s.visible[..., None], p[..., None] * np.where(
                finite, 0.0, vv)[..., None, :, :], 0.0).sum(axis=-2)
    out = rnd(out)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(total), -np.inf)[..., 0]
    return out, rnd(lse)


def _rounder(rounding):
    """The function that rounds float64 values to ``rounding`` (None: no rounding)."""
    if rounding is None:
        return lambda x: x
    if isinstance(rounding, str) and rounding == "tf32":
        return to_tf32
    dtype = np.dtype(rounding)
    return lambda x: np.asarray(x).astype(dtype).astype(np.float64)


def _product(spec, a, b, rounding=None):
    """``einsum(spec, a, b)``: in float64 for the reference, and for a naive computation of
    operands rounded to ``rounding`` summed in float32 (as a 16-bit, TF32 or float32 GEMM
    does; float64 for float64)."""
    if rounding is None or (not isinstance(rounding, str) and np.dtype(rounding) == np.float64):
        return np.einsum(spec, a, b)
    rnd = _rounder(rounding)
    return np.einsum(spec, rnd(a).astype(np.float32), rnd(b).astype(np.float32)).astype(
        np.float64)


def to_tf32(x):
    """``x`` rounded to TF32 (10 mantissa bits, nearest with ties away from zero: cvt.rna),
    as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(
        np.float64)


def _table_index(delta, n):
    """Entries ``radius + clip(delta, -radius, radius)`` of a table of ``n = 2 radius + 1``."""
    radius = (n - 1) // 2
    return np.array([[radius + max(-radius, min(radius, int(d))) for d in row] for row in delta],
                    dtype=np.int64).reshape(np.shape(delta))


def _np(x):
    if type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    return np.asarray(x)


def _f64(x):
    return _np(x).astype(np.float64)


# --------------------------------------------------------------------------------------------
# gradients (issue 13): a dense float64 reference, from the softmax Jacobian


def reference_attention_backward(dout, q, k, v, **options):
    """Gradients of ``sum(dout * attention(q, k, v, ...))`` in float64, as a dict with the keys
    ``dq, dk, dv, dbias, drel_bias, drel_q, drel_k`` (None for a term not given), each of the
    shape of its input as passed (broadcast dimensions summed).

    Written from the definition, one query row at a time over its visible keys only: the row's
    logits ``s`` (:func:`_logits`), ``p = softmax(s)``, ``dp = V dO_i``, the softmax Jacobian
    ``J = diag(p) - p p^T`` and ``ds = J dp``, then the chain rule through the soft cap
    (``d/dx c tanh(x / c) = 1 - tanh(x / c)^2``) into each term.
    """
    options = _options(options)
    q, k, v, dout = (_f64(x) for x in (q, k, v, dout))
    batch = _batch(q, k, v)
    lq, lk = q.shape[-2], k.shape[-2]
    s = _logits(q, k, batch, **options)
    Q, K, V, dO = _full(batch, q, k, v, dout)
    d_logit, d_cap = _cap_slopes(s, options)

    dQ, dK, dV = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
    d_terms = np.zeros(batch + (lq, lk))                          # gradient of each term
    d_content = np.zeros(batch + (lq, lk))                        # of the content score
    for idx in np.ndindex(*batch, lq):
        b = idx[:-1]
        seen = s.visible[idx]
        if not seen.any():
            continue
        row = s.logits[idx][seen]
        p = np.exp(row - row.max())
        p /= p.sum()
        dp = V[b][seen] @ dO[idx]
        ds = (np.diag(p) - np.outer(p, p)) @ dp                  # the softmax Jacobian
        ds = ds * d_logit[idx][seen]
        d_terms[idx][seen] = ds
        dc = ds * d_cap[idx][seen]
        d_content[idx][seen] = dc
        dV[b][seen] += np.outer(p, dO[idx])
        dQ[idx] += s.scale * dc @ K[b][seen]
        dK[b][seen] += s.scale * np.outer(dc, Q[idx])
    return dict(dq=_sum_to(dQ, q.shape), dk=_sum_to(dK, k.shape), dv=_sum_to(dV, v.shape),
                **_term_gradients(s, d_terms, d_content, options))


def naive_attention_backward(dout, q, k, v, *, rounding, **options):
    """The gradients of :func:`reference_attention_backward` computed naively in the precision
    ``rounding`` (a dtype, or ``"tf32"``): the scores, ``P``, ``dP``, ``dS`` and each gradient
    rounded to it, the matrix products of rounded operands accumulated in float32 (as a 16-bit,
    TF32 or float32 GEMM; float64 for float64); the terms' gradients summed from the rounded
    ``dS``. The computation FlashAttention holds a kernel's gradients against."""
    options = _options(options)
    rnd = _rounder(rounding)
    q, k, v, dout = (_f64(x) for x in (q, k, v, dout))
    batch = _batch(q, k, v)
    s = _logits(q, k, batch, rounding, **options)
    Q, K, V, dO = _full(batch, q, k, v, dout)
    d_logit, d_cap = _cap_slopes(s, options)

    x = np.where(s.visible, s.logits, -np.inf)
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    e = np.where(s.visible, np.exp(x - np.where(np.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    p = rnd(np.where(total > 0, e / np.where(total > 0, total, 1), 0.0))
    dV = rnd(_product("...ij,...id->...jd", p, dO, rounding))
    dp = rnd(_product("...id,...jd->...ij", dO, V, rounding))
    ds = rnd(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))    # rowsum(P dP) = Delta
    d_terms = rnd(ds * d_logit)
    d_content = d_terms * d_cap
    g = rnd(d_content * s.scale)                                  # of q . k
    dQ = rnd(_product("...ij,...jd->...id", g, K, rounding))
    dK = rnd(_product("...ij,...id->...jd", g, Q, rounding))
    return dict(dq=_sum_to(dQ, q.shape), dk=_sum_to(dK, k.shape), dv=_sum_to(dV, v.shape),
                **_term_gradients(s, d_terms, d_content, options))


def _full(batch, q, k, v, dout):
    """q, k, v and dout broadcast over the batch."""
    return (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v, dout))


def _cap_slopes(s, options):
    """``(d logit / d pre, d capped / d content)``: the soft cap's slopes where it applies,
    else 1."""
    softcap, softcap_bias = options["softcap"], options["softcap_bias"]
    one = np.ones(s.pre.shape)
    if softcap is None:
        return one, one
    if softcap_bias:
        return 1 - np.tanh(s.pre / softcap) ** 2, one
    return one, 1 - np.tanh(s.content / softcap) ** 2


def _term_gradients(s, d_terms, d_content, options):
    """``dbias, drel_bias, drel_q, drel_k`` from the dense gradients of the additive terms and
    of the content score, summed to each input's shape as passed (None for a term not given)."""
    batch = d_terms.shape[:-2]
    grads = dict(dbias=None, drel_bias=None, drel_q=None, drel_k=None)
    bias = options["bias"]
    if bias is not None:
        g = d_terms
        if s.blocks is not None:
            rows, cols = s.blocks
            g = np.zeros(batch + np.shape(bias)[-2:])
            np.add.at(g, (..., rows[:, None], cols[None, :]), d_terms)
        grads["dbias"] = _sum_to(g, np.shape(bias))
    if options["rel_bias"] is not None:
        rel_bias = options["rel_bias"]
        g = np.zeros(batch + np.shape(rel_bias)[-1:])
        np.add.at(g, (..., s.bidx), d_terms)
        grads["drel_bias"] = _sum_to(g, np.shape(rel_bias))
    if options["rel_q"] is not None:
        rel_q, rel_k = options["rel_q"], options["rel_k"]
        lq = d_terms.shape[-2]
        RQ = np.broadcast_to(_f64(rel_q), batch + (lq, np.shape(rel_q)[-1]))
        RK = np.broadcast_to(_f64(rel_k), batch + np.shape(rel_k)[-2:])
        gq = np.einsum("...ij,...ijd->...id", d_content, RK[..., s.kidx, :])
        gk = np.zeros(RK.shape)
        for (i, j), e in np.ndenumerate(s.kidx):
            gk[..., e, :] += d_content[..., i, j, None] * RQ[..., i, :]
        grads["drel_q"] = _sum_to(gq, np.shape(rel_q))
        grads["drel_k"] = _sum_to(gk, np.shape(rel_k))
    return grads


def _sum_to(g, shape):
    """Sum the broadcast gradient ``g`` to an input of ``shape``."""
    shape = tuple(shape)
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and g.shape[a] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


# --------------------------------------------------------------------------------------------
# statistics of the attention weights (issue 21): dense, from the weights themselves


def reference_attention_stats(q, k, *, query_weights=None, top_k=0, rows=None, **options):
    """The statistics of :func:`cuonline.attention_stats` in float64, as a dict of its fields
    (``received``, ``top_*`` and ``weights`` always given; ``rows`` as passed).

    ``P`` is the dense weight matrix of :func:`reference_attention` itself: with ``v`` the
    ``Lk x Lk`` identity, its output is ``P`` (the scores are not written twice). Then each
    statistic from its definition: ``H_i = -sum_j p_ij log p_ij`` over ``p_ij > 0``, the
    first largest weight, the ``top_k`` weights by a stable sort (lower key first on ties),
    ``sum_i w_i p_ij``. A weight of exactly 0 counts as a key not seen (index -1): the dense
    ``P`` cannot tell an invisible key from an underflowed one, so tests keep logits moderate.
    """
    lk = np.shape(k)[-2]
    P, lse = reference_attention(q, k, np.eye(lk), **options)     # (S, Lq, Lk), (S, Lq)
    return _statistics(P, lse, query_weights, top_k, rows)


def naive_attention_stats(q, k, *, rounding, query_weights=None, top_k=0, rows=None,
                          **options):
    """The statistics of a naive computation in the precision ``rounding`` (the accumulation
    dtype of ``attention_stats``: float32, float64 for float64): the weights ``P`` and ``lse``
    of :func:`naive_attention`, each statistic then formed from them as in
    :func:`reference_attention_stats`."""
    lk = np.shape(k)[-2]
    P, lse = naive_attention(q, k, np.eye(lk), rounding=rounding, **options)
    return _statistics(P, lse, query_weights, top_k, rows)


def _statistics(P, lse, query_weights, top_k, rows):
    """Every statistic of the dense weights ``P`` (S, Lq, Lk) from its definition."""
    lk = P.shape[-1]
    seen = P > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(seen, P * np.log(np.where(seen, P, 1)), 0).sum(axis=-1)
    max_weight = P.max(axis=-1) if lk else np.zeros(P.shape[:-1])
    argmax = np.where(seen.any(axis=-1), P.argmax(axis=-1) if lk else 0, -1)
    order = np.argsort(-P, axis=-1, kind="stable")[..., :top_k]
    top_weights = np.take_along_axis(P, order, axis=-1)
    top_indices = np.where(top_weights > 0, order, -1)
    if top_k > lk:
        pad = P.shape[:-1] + (top_k - lk,)
        top_indices = np.concatenate([top_indices, np.full(pad, -1)], axis=-1)
        top_weights = np.concatenate([top_weights, np.zeros(pad)], axis=-1)
    w = np.ones(P.shape[:-1]) if query_weights is None else np.broadcast_to(
        _f64(query_weights), P.shape[:-1])
    received = np.einsum("...i,...ij->...j", w, P)
    weights = None if rows is None else P[..., np.asarray(rows, dtype=np.int64), :]
    return dict(lse=lse, entropy=entropy, max_weight=max_weight, argmax=argmax,
                received=received, top_indices=top_indices, top_weights=top_weights,
                weights=weights)


# --------------------------------------------------------------------------------------------
# packed variable-length batches (issue 20): the dense reference, one sequence at a time


def _sequences(cu_seqlens_q, cu_seqlens_k, options):
    """``(rows of queries, rows of keys, options)`` of each sequence with queries: the
    options with ``rel_q`` cut to the sequence's rows (it is packed like ``q``)."""
    cq, ck = [int(c) for c in cu_seqlens_q], [int(c) for c in cu_seqlens_k]
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        here = dict(options)
        if options.get("rel_q") is not None:
            here["rel_q"] = np.asarray(options["rel_q"])[..., cq[b]:cq[b + 1], :]
        yield slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1]), here


def reference_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """``(out, lse)`` of a packed batch in float64: :func:`reference_attention` on each
    sequence alone (its rows of ``q``, ``k``, ``v`` and, packed like ``q``, ``rel_q``), written
    into the packed layout; a query of a sequence without keys gets 0 and ``-inf``."""
    batch = np.broadcast_shapes(np.shape(q)[:-2], np.shape(k)[:-2], np.shape(v)[:-2])
    out = np.zeros(batch + (np.shape(q)[-2], np.shape(v)[-1]))
    lse = np.full(batch + (np.shape(q)[-2],), -np.inf)
    for sq, sk, here in _sequences(cu_seqlens_q, cu_seqlens_k, options):
        o, s = reference_attention(np.asarray(q)[..., sq, :], np.asarray(k)[..., sk, :],
                                   np.asarray(v)[..., sk, :], **here)
        out[..., sq, :] = o
        lse[..., sq] = s
    return out, lse


def reference_varlen_attention_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Gradients of a packed batch in float64, as :func:`reference_attention_backward`'s
    dict: each sequence's gradients from the reference on that sequence alone, placed at its
    rows (``dq``, ``dk``, ``dv``, ``drel_q``) or summed over the sequences (the shared tables
    ``drel_bias``, ``drel_k``); keys of a sequence without queries get zeros."""
    shapes = {"dq": np.shape(q), "dk": np.shape(k), "dv": np.shape(v)}
    for name in ("rel_bias", "rel_q", "rel_k"):
        if options.get(name) is not None:
            shapes["d" + name] = np.shape(options[name])
    grads = {name: np.zeros(shape) for name, shape in shapes.items()}
    for sq, sk, here in _sequences(cu_seqlens_q, cu_seqlens_k, options):
        g = reference_attention_backward(
            np.asarray(dout)[..., sq, :], np.asarray(q)[..., sq, :], np.asarray(k)[..., sk, :],
            np.asarray(v)[..., sk, :], **here)
        grads["dq"][..., sq, :] = g["dq"]
        grads["dk"][..., sk, :] = g["dk"]
        grads["dv"][..., sk, :] = g["dv"]
        if "drel_q" in grads:
            grads["drel_q"][..., sq, :] = g["drel_q"]
        for name in ("drel_bias", "drel_k"):
            if name in grads:
                grads[name] += g[name]
    return grads
