"""A float64 reference for attention, written independently of every engine.

It materialises the full score matrix with plain NumPy, applies each option literally from its
definition in the docs (no online softmax, no tiling, no shared helper from cuonline) and is
meant for small shapes only.
"""

from __future__ import annotations

import numpy as np


def reference_attention(q, k, v, *, scale=None, causal=False, window=None, bias=None,
                        mask=None, kv_lengths=None, alibi_slopes=None, softcap=None,
                        softcap_bias=False, q_offset=None, k_offset=0):
    """Return ``(out, lse)`` in float64 for NumPy (or CuPy, converted) inputs.

    Each term is built densely from its definition, in the documented order: the content
    score ``scale * q . k``, the soft cap (unless ``softcap_bias``), ``bias`` and ALiBi, the
    soft cap (if ``softcap_bias``), then masking. Positions: query ``i`` at ``q_offset + i``
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
    if softcap is not None and not softcap_bias:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + _f64(bias)
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


def _np(x):
    if type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    return np.asarray(x)


def _f64(x):
    return _np(x).astype(np.float64)
