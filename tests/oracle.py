"""A float64 reference for attention, written independently of every engine.

It materialises the full score matrix with plain NumPy, applies each option literally from its
definition in the docs (no online softmax, no tiling, no shared helper from cuonline) and is
meant for small shapes only.
"""

from __future__ import annotations

import numpy as np


def reference_attention(q, k, v, *, scale=None, causal=False, window=None, bias=None,
                        mask=None, kv_lengths=None, alibi_slopes=None, softcap=None,
                        softcap_bias=False, q_offset=None, k_offset=0, bias_block=None,
                        rel_bias=None, rel_q=None, rel_k=None):
    """Return ``(out, lse)`` in float64 for NumPy (or CuPy, converted) inputs.

    Each term is built densely from its definition, in the documented order: the content
    score ``scale * q . k + rel_q[i] . rel_k[delta]``, the soft cap (unless ``softcap_bias``),
    ``bias`` (expanded from its blocks with ``bias_block``), ``rel_bias[delta]`` and ALiBi, the
    soft cap (if ``softcap_bias``), then masking. A relative table of length ``R`` holds
    distances ``-(R - 1) / 2 .. (R - 1) / 2``; farther distances read its end entries. Positions: query ``i`` at ``q_offset + i``
    (default ``Lk - Lq``), key ``j`` at ``k_offset + j``; ``delta`` = key position - query
    position, exact for offsets of any size (Python ints beyond int64 included).
    """
    q, k, v = (_f64(x) for x in (q, k, v))
    lq, d = q.shape[-2:]
    lk = k.shape[-2]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if scale is None:
        scale = 1.0 / np.sqrt(max(d, 1))
    if q_offset is None:
        q_offset = lk - lq

    # delta[i, j] = (k_offset + j) - (q_offset + i): int64 where that is exact, else Python ints
    base = int(k_offset) - int(q_offset)
    exact = np.int64 if abs(base) < 2**60 else object
    delta = (np.arange(lk, dtype=exact)[None, :] - np.arange(lq, dtype=exact)[:, None]
             + (np.int64(base) if exact is np.int64 else base))

    s = scale * np.einsum("...id,...jd->...ij", q, k)
    s = np.broadcast_to(s, batch + (lq, lk)).copy()
    if rel_q is not None:
        table = _f64(rel_k)                                   # (..., R, Dr)
        keys = table[..., _table_index(delta, table.shape[-2]), :]   # (..., Lq, Lk, Dr)
        s = s + np.einsum("...id,...ijd->...ij", _f64(rel_q), keys)
    if softcap is not None and not softcap_bias:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        dense = _f64(bias)
        if bias_block is not None:
            r, c = (bias_block, bias_block) if np.ndim(bias_block) == 0 else bias_block
            dense = dense[..., np.arange(lq) // r, :][..., np.arange(lk) // c]
        s = s + dense
    if rel_bias is not None:
        table = _f64(rel_bias)
        s = s + table[..., _table_index(delta, table.shape[-1])]
    if alibi_slopes is not None:
        slopes = np.broadcast_to(_f64(alibi_slopes), batch)[..., None, None]
        s = s - slopes * np.abs(delta).astype(np.float64)
    if softcap is not None and softcap_bias:
        s = softcap * np.tanh(s / softcap)

    j = np.arange(lk)[None, :]
    visible = np.ones(batch + (lq, lk), dtype=bool)
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
        visible &= j < lengths

    out = np.zeros(batch + (lq, v.shape[-1]))
    lse = np.full(batch + (lq,), -np.inf)
    vv = np.broadcast_to(v, batch + v.shape[-2:])
    for idx in np.ndindex(*batch, lq):
        row_visible = visible[idx]
        if not row_visible.any():
            continue
        row = s[idx][row_visible]
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


def _table_index(delta, n):
    """Entries ``radius + clip(delta, -radius, radius)`` of a table of ``n = 2 radius + 1``."""
    radius = (n - 1) // 2
    return np.array([[radius + max(-radius, min(radius, int(d))) for d in row] for row in delta],
                    dtype=np.int64)


def _np(x):
    if type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    return np.asarray(x)


def _f64(x):
    return _np(x).astype(np.float64)


# --------------------------------------------------------------------------------------------
# gradients (issue 13): a dense float64 reference, from the softmax Jacobian


def reference_attention_backward(dout, q, k, v, *, scale=None, causal=False, window=None,
                                 bias=None, mask=None, kv_lengths=None, alibi_slopes=None,
                                 softcap=None, softcap_bias=False, q_offset=None, k_offset=0,
                                 bias_block=None, rel_bias=None, rel_q=None, rel_k=None):
    """Gradients of ``sum(dout * attention(q, k, v, ...))`` in float64, as a dict with the keys
    ``dq, dk, dv, dbias, drel_bias, drel_q, drel_k`` (None for a term not given), each of the
    shape of its input as passed (broadcast dimensions summed).

    Written from the definition, one query row at a time over its visible keys only: the row's
    logits ``s`` (every term densely, in the documented order), ``p = softmax(s)``, ``dp =
    V dO_i``, the softmax Jacobian ``J = diag(p) - p p^T`` and ``ds = J dp``, then the chain rule
    through the soft cap (``d/dx c tanh(x / c) = 1 - tanh(x / c)^2``) into each term.
    """
    q, k, v, dout = (_f64(x) for x in (q, k, v, dout))
    lq, d = q.shape[-2:]
    lk, dv_ = k.shape[-2], v.shape[-1]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    scale = 1.0 / np.sqrt(max(d, 1)) if scale is None else scale
    q_offset = lk - lq if q_offset is None else q_offset
    rows, cols = np.arange(lq)[:, None], np.arange(lk)[None, :]
    delta = cols - rows + (int(k_offset) - int(q_offset))         # key minus query position

    def full(x, tail):
        return np.broadcast_to(_f64(x), batch + tail)

    Q, K, V = full(q, (lq, d)), full(k, (lk, d)), full(v, (lk, dv_))
    dO = full(dout, (lq, dv_))
    content = scale * np.einsum("...id,...jd->...ij", Q, K)
    if rel_q is not None:
        RQ, RK = full(rel_q, (lq, rel_q.shape[-1])), full(rel_k, rel_k.shape[-2:])
        kidx = _table_index(delta, RK.shape[-2])                  # (Lq, Lk) table entries
        content = content + np.einsum("...id,...ijd->...ij", RQ, RK[..., kidx, :])
    terms = np.zeros(batch + (lq, lk))                            # every additive term
    if bias is not None:
        if bias_block is None:
            terms = terms + full(bias, (lq, lk))
        else:
            r, c = (bias_block, bias_block) if np.ndim(bias_block) == 0 else bias_block
            bi, bj = np.arange(lq) // r, np.arange(lk) // c
            coarse = full(bias, (-(-lq // r), -(-lk // c)))
            terms = terms + coarse[..., bi[:, None], bj[None, :]]
    if rel_bias is not None:
        table = full(rel_bias, (rel_bias.shape[-1],))
        bidx = _table_index(delta, table.shape[-1])
        terms = terms + table[..., bidx]
    if alibi_slopes is not None:
        terms = terms - full(alibi_slopes, ())[..., None, None] * np.abs(delta)
    cap_content = softcap is not None and not softcap_bias
    cap_logit = softcap is not None and softcap_bias
    capped = softcap * np.tanh(content / softcap) if cap_content else content
    pre = capped + terms
    logits = softcap * np.tanh(pre / softcap) if cap_logit else pre

    visible = np.ones(batch + (lq, lk), dtype=bool)
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        visible &= delta >= -left
    if right is not None:
        visible &= delta <= right
    if mask is not None:
        visible &= _np(mask)
    if kv_lengths is not None:
        visible &= cols < np.broadcast_to(_np(kv_lengths), batch)[..., None, None]

    dQ, dK, dV = np.zeros(Q.shape), np.zeros(K.shape), np.zeros(V.shape)
    d_terms = np.zeros(batch + (lq, lk))                          # gradient of each term
    d_content = np.zeros(batch + (lq, lk))                        # of the content score
    for idx in np.ndindex(*batch, lq):
        b, i = idx[:-1], idx[-1]
        seen = visible[idx]
        if not seen.any():
            continue
        s = logits[idx][seen]
        p = np.exp(s - s.max())
        p /= p.sum()
        dp = V[b][seen] @ dO[idx]
        ds = (np.diag(p) - np.outer(p, p)) @ dp                  # the softmax Jacobian
        if cap_logit:
            ds = ds * (1 - np.tanh(pre[idx][seen] / softcap) ** 2)
        d_terms[idx][seen] = ds
        dc = ds * (1 - np.tanh(content[idx][seen] / softcap) ** 2) if cap_content else ds
        d_content[idx][seen] = dc
        dV[b][seen] += np.outer(p, dO[idx])
        dQ[idx] += scale * dc @ K[b][seen]
        dK[b][seen] += scale * np.outer(dc, Q[idx])

    grads = dict(dq=_sum_to(dQ, q.shape), dk=_sum_to(dK, k.shape), dv=_sum_to(dV, v.shape),
                 dbias=None, drel_bias=None, drel_q=None, drel_k=None)
    if bias is not None:
        if bias_block is None:
            grads["dbias"] = _sum_to(d_terms, np.shape(bias))
        else:
            g = np.zeros(batch + coarse.shape[-2:])
            for i in range(lq):
                for j in range(lk):
                    g[..., bi[i], bj[j]] += d_terms[..., i, j]
            grads["dbias"] = _sum_to(g, np.shape(bias))
    if rel_bias is not None:
        g = np.zeros(batch + table.shape[-1:])
        for (i, j), e in np.ndenumerate(bidx):
            g[..., e] += d_terms[..., i, j]
        grads["drel_bias"] = _sum_to(g, np.shape(rel_bias))
    if rel_q is not None:
        gq, gk = np.zeros(RQ.shape), np.zeros(RK.shape)
        for (i, j), e in np.ndenumerate(kidx):
            dc = d_content[..., i, j, None]
            gq[..., i, :] += dc * RK[..., e, :]
            gk[..., e, :] += dc * RQ[..., i, :]
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
    eye = np.eye(lk)
    P, lse = reference_attention(q, k, eye, **options)        # (S, Lq, Lk), (S, Lq)
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
