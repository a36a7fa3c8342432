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
