"""The NumPy score pipeline: one batch element's logits, tile by tile, for forward and backward.

The NumPy twin of ``kernels_cu/attention_score.cuh``. For the queries ``[i0, i1)`` of batch
element ``b`` and a key tile ``[js, je)``, :meth:`ScorePipeline.logits` returns every term of
the documented order (docs/semantics.md), in the accumulation dtype and natural units:

    content    scale * q . k                      (BLAS; a broadcast head dimension in slices)
             + rel_q[i] . rel_k[rk + clip(delta)]  (one band of distances per tile)
    soft cap   of the content alone               (softcap without softcap_bias)
             + bias (or block bias) + rel_bias[rb + clip(delta)]
             - slope * |delta|                     (ALiBi)
    soft cap   of the whole logit                 (softcap_bias)
    masking    -inf outside the window band and where ``mask`` is False

with ``delta = j - (i + diag)``. The forward (:mod:`.numpy`) and the backward
(:mod:`.numpy_backward`) both call it, so the backward's ``exp(s - lse)`` is the forward's P.
The backward also takes from it the tanh of the soft cap (its derivative), the table entries
of a tile's distances (:meth:`ScorePipeline.band_index`) and the visibility of a tile.

Beside it, the tile helpers both passes share: :func:`blas_ready` (a layout BLAS takes),
:func:`visible_product` (a product where NaN or inf reaches only the rows that see it),
:func:`spanned_product` (a product over the columns each group of rows may see),
:func:`soft_cap` and :func:`skewed` (the Toeplitz view of a band).
"""

from __future__ import annotations

import numpy as np

from .cpu_blas import product

__all__ = ["ScorePipeline", "band_columns", "query_diagonals", "blas_ready", "copy_is_large",
           "visible_product", "spanned_product", "soft_cap", "skewed", "group_rows",
           "REL_ROWS", "SLICE_BYTES"]

# Query rows per product of the relative logits (see ScorePipeline.add_relative_logits).
REL_ROWS = 64
# A broadcast (zero-stride) operand whose copy would exceed this many bytes is multiplied in
# slices of its last axis, copying one slice at a time (D = 2**24 broadcast from one element).
SLICE_BYTES = 1 << 22
# The fewest rows a group of a crossed tile's rows may have (see group_rows).
LEAST_GROUP_ROWS = 16


def group_rows(rows, most):
    """Rows per group of a tile of ``rows`` query rows that the window band crosses
    (:meth:`ScorePipeline.row_spans`, and the compiled walks' rule): a quarter of them, at
    least ``LEAST_GROUP_ROWS`` and at most ``most`` (an engine's ``SPAN_ROWS``). Four groups
    make a causal diagonal tile cost 5/8 of a full one. A group of fixed size left a tile of
    its size or less in one group: measured on machine C (64 heads, D 64, float32, two
    workers), a causal call of 128 queries ran 12% faster in groups of 32 than in one of 128,
    of 256 queries 11% faster in groups of 64, of 64 queries 8% in groups of 16; 512-row tiles
    keep groups of 128 (their products in groups of 64 or 32 were no faster)."""
    return min(most, max(LEAST_GROUP_ROWS, rows // 4))


class ScorePipeline:
    """The logits of queries ``[i0, i1)`` of batch element ``b`` of the problem ``p``.

    ``queries``: the scaled, BLAS-ready ``(n, D)`` query block when the caller has it (the
    backward keeps a batch element's); None: made here from ``p.q``.

    The relative terms depend on the distance ``delta = j - (i + diag)`` only. For ``n``
    queries and a tile of ``w`` keys the distances form one band of ``n + w - 1`` values,
    ``delta = dmin + t`` with ``dmin = js - (i0 + diag + n - 1)``, and tile place ``(i, j)`` is
    band entry ``t = (j - js) - (i - i0) + n - 1``: a skewed (Toeplitz) view of the band, with
    strides ``(-1, 1)`` over a vector (``rel_bias``) or ``(nb - 1, 1)`` over the ``(n, nb)``
    products ``rel_q @ band.T`` (``rel_q``/``rel_k``), so neither term is gathered per score.
    """

    def __init__(self, p, b, i0, i1, queries=None):
        acc = p.acc_dtype
        self.acc = acc
        self.n = i1 - i0
        self.scale = acc.type(p.scale)
        self._keys = p.k[b]
        self._query_view = p.q[b][i0:i1]
        if queries is None and not copy_is_large(self._query_view, acc):
            queries = blas_ready(self._query_view, acc) * self.scale
        self.queries = queries                 # None: products in slices of D
        self.first_diag = i0 + p.diagonal_offset             # key facing query i0
        self.diag = query_diagonals(p, i0, i1)
        self.left, self.right = p.window
        self.cap = None if p.softcap is None else acc.type(p.softcap)
        self.cap_whole_logit = p.softcap_bias
        self.slope = None if p.alibi_slopes is None else acc.type(p.alibi_slopes[b])
        self.mask = None if p.mask is None else p.mask[b][i0:i1]
        self.block = p.bias_block
        self.bias = None
        if p.bias is not None and self.block is None:
            self.bias = p.bias[b][i0:i1]                    # (n, Lk), a view
        elif p.bias is not None:
            # the coarse rows of these queries, (n, ceil(Lk / c)): small, gathered once
            self.bias = p.bias[b][np.arange(i0, i1) // self.block[0]]
        self.rel_bias = None if p.rel_bias is None else p.rel_bias[b]
        self.rel_q = None if p.rel_q is None else blas_ready(p.rel_q[b][i0:i1], acc)
        self.rel_k = None if p.rel_k is None else p.rel_k[b]
        self.rb, self.rk = p.rel_bias_radius, p.rel_k_radius

    # ----------------------------------------------------------------------------------------
    # the logits

    def logits(self, js, je, keys=None, *, window=True, tanh=False, spans=None):
        """The ``(n, je - js)`` logits of keys ``[js, je)``, -inf where a row may not see a key.

        ``keys``: the BLAS-ready key tile when the caller has it (else read from ``p.k``).
        ``window=False`` leaves out the window band's -inf (the compiled kernel takes it from
        :meth:`window_columns`). ``tanh=True`` returns ``(s, t)`` with ``t`` the tanh of the
        soft cap, for its derivative ``1 - t**2`` (None without a soft cap). ``spans``: the
        ``(r0, r1, c0, c1)`` of :meth:`row_spans`; the content product then covers only those
        columns of each group of rows (0 elsewhere: places the window band hides).
        """
        s = self._content(js, je, keys, spans)
        self.add_relative_logits(s, js, je)         # + rel_q . rel_k[delta]
        t = None
        if self.cap is not None and not self.cap_whole_logit:
            t = soft_cap(s, self.cap, tanh)         # the content score only
        self.add_biases(s, js, je)                  # + bias (or block bias) + rel_bias[delta]
        cols = np.arange(js, je)                    # key indices of this tile
        if self.slope is not None:                  # ALiBi: -slope * |i + diag - j|
            s += self.alibi_band(js, je)
        if self.cap is not None and self.cap_whole_logit:
            t = soft_cap(s, self.cap, tanh)         # the whole logit (AlphaGenome)
        # masking: the window band only where this tile crosses its edge
        diag, left, right = self.diag, self.left, self.right
        if window and left is not None and js < diag[-1] - left:
            np.copyto(s, -np.inf, where=cols[None, :] < (diag - left)[:, None])
        if window and right is not None and je - 1 > diag[0] + right:
            np.copyto(s, -np.inf, where=cols[None, :] > (diag + right)[:, None])
        if self.mask is not None:
            np.copyto(s, -np.inf, where=~self.mask[:, js:je])
        return (s, t) if tanh else s

    def visible(self, js, je, keys=None):
        """The ``(n, je - js)`` boolean "row may see key": logits that are not -inf
        (recomputed: only the paths for non-finite numbers ask)."""
        return self.logits(js, je, keys) != -np.inf

    def window_columns(self, js, width):
        """``(lo, hi)``: row ``i`` sees the tile's columns ``[lo[i], hi[i])`` of a tile of
        ``width`` keys from ``js`` by the window band alone (int64, not clipped)."""
        return band_columns(self.diag, self.left, self.right, js, width)

    def row_spans(self, js, width, w, rows):
        """``[(r0, r1, c0, c1), ...]``: for each group of ``rows`` query rows, the columns
        ``[c0, c1)`` of a tile of ``w`` keys from ``js`` (of a tile width ``width``) that the
        window band lets any of them see; None when these spans cover more than 3/4 of the
        tile (one product over the whole tile is then as cheap). The compiled walk of the
        forward (:func:`._task_kernels.forward_walk`) applies the same rule in its own loop;
        ``tests/test_task_kernels.py`` holds the two to the same bits."""
        if self.n < 2 * rows or (self.left is None and self.right is None):
            return None
        lo, hi = self.window_columns(js, width)
        lo, hi = np.clip(lo, 0, w), np.clip(hi, 0, w)
        spans, area = [], 0
        for r0 in range(0, self.n, rows):
            r1 = min(r0 + rows, self.n)
            c0, c1 = int(lo[r0:r1].min()), int(hi[r0:r1].max())
            c1 = max(c0, c1)
            spans.append((r0, r1, c0, c1))
            area += (r1 - r0) * (c1 - c0)
        return spans if 4 * area <= 3 * self.n * w else None

    def _content(self, js, je, keys, spans=None):
        """``scale * q . k`` of the tile: (n, je - js) (only the ``spans``, 0 elsewhere)."""
        if keys is not None:
            return spanned_product(self.queries, keys, spans)
        k = self._keys[js:je]
        if self.queries is None or copy_is_large(k, self.acc):
            return _sliced_product(self._query_view, k, self.acc, self.scale)
        return spanned_product(self.queries, blas_ready(k, self.acc), spans)

    # ----------------------------------------------------------------------------------------
    # the terms

    def band_index(self, js, je, radius):
        """Table entries ``radius + clip(delta, -radius, radius)`` of the distances of the
        ``n`` rows and keys ``[js, je)``: ``n + (je - js) - 1`` of them, the smallest distance
        first."""
        dmin = js - (self.first_diag + self.n - 1)
        delta = np.arange(dmin, dmin + self.n + (je - js) - 1, dtype=np.int64)
        return radius + np.clip(delta, -radius, radius)

    def relative_band(self, js, je):
        """``(index, band)``: the ``rel_k`` entries of the tile's distances and the rows of the
        table there, ``(n + w - 1, Dr)``: a slice where no distance is clamped (a table of
        ``2 L - 1`` rows), else gathered."""
        index = self.band_index(js, je, self.rk)
        if index[-1] - index[0] == index.size - 1:
            return index, self.rel_k[index[0]:index[-1] + 1]
        return index, self.rel_k[index]

    def add_relative_logits(self, s, js, je):
        """``s += rel_q[i] . rel_k[rk + clip(delta)]`` (a no-op without the term).

        Rows go in groups of REL_ROWS: the band of a group of ``g`` rows has ``g + w - 1``
        distances, so the products cost ``(g + w - 1) / w`` times the term's own work (1.1 for
        64 rows against 512 keys, where the whole 256-row block would cost 1.5).
        """
        if self.rel_q is None:
            return
        w = je - js
        _, band = self.relative_band(js, je)
        band_t = blas_ready(band, self.acc).T                              # (Dr, n + w - 1)
        for r0 in range(0, self.n, REL_ROWS):
            r1 = min(r0 + REL_ROWS, self.n)
            g = r1 - r0
            products = product(self.rel_q[r0:r1],
                               band_t[:, self.n - r1:self.n - r1 + g + w - 1])
            s[r0:r1] += skewed(products.reshape(-1), g, products.shape[1] - 1, w)

    def alibi_band(self, js, je):
        """The ALiBi term ``-slope * |delta|`` of the tile's distances, as the ``(n, je - js)``
        skewed view of its ``n + (je - js) - 1`` values (one product per distance, not per
        score: 2.3x a plain call's time before, at N 1024); ``-inf`` where it overflows."""
        dmin = js - (self.first_diag + self.n - 1)
        distances = np.arange(dmin, dmin + self.n + (je - js) - 1, dtype=np.int64)
        with np.errstate(over="ignore"):            # a term beyond the range: -inf
            band = -(self.slope * np.abs(distances).astype(self.acc))
        return skewed(band, self.n, -1, je - js)

    def add_biases(self, s, js, je):
        """``s += bias[i, j]`` (or ``bias[i // r, j // c]``) ``+ rel_bias[rb + clip(delta)]``."""
        if self.bias is not None:
            if self.block is None:
                s += self.bias[:, js:je]
            elif js % self.block[1] == 0 and (je - js) % self.block[1] == 0:
                # whole column blocks (every tile but a tail): a broadcast add, no gather
                c = self.block[1]
                s.reshape(self.n, -1, c)[...] += self.bias[:, js // c:je // c, None]
            else:
                s += np.take(self.bias, np.arange(js, je) // self.block[1], axis=1)
        if self.rel_bias is not None:
            band = np.ascontiguousarray(self.rel_bias[self.band_index(js, je, self.rb)])
            s += skewed(band, self.n, -1, je - js)


def spanned_product(a, b, spans=None):
    """``a @ b.T`` of an (n, d) ``a`` and a (w, d) ``b``: all of it (``spans`` None), or only
    the columns ``[c0, c1)`` of the rows ``[r0, r1)`` of each span of
    :meth:`ScorePipeline.row_spans`, 0 elsewhere."""
    if spans is None:
        return product(a, b.T)
    out = np.empty((a.shape[0], b.shape[0]), dtype=np.result_type(a, b))
    for r0, r1, c0, c1 in spans:
        out[r0:r1, :c0] = 0
        out[r0:r1, c1:] = 0
        product(a[r0:r1], b[c0:c1].T, out[r0:r1, c0:c1])
    return out


def skewed(flat, rows, row_step, w, writeable=False):
    """The ``(rows, w)`` view ``v[i, j] = flat[i * row_step + j + rows - 1]`` of a 1-d
    ``flat``: a band read (or, ``writeable``, written) as the tile it covers."""
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[rows - 1:], shape=(rows, w),
                                           strides=(row_step * item, item),
                                           writeable=writeable)


def soft_cap(s, cap, keep_tanh=False):
    """``s = cap * tanh(s / cap)`` in place; returns a copy of the tanh when ``keep_tanh``."""
    s /= cap
    np.tanh(s, out=s)
    tanh = s.copy() if keep_tanh else None
    s *= cap
    return tanh


def visible_product(a, b, visible, b_finite=False, add_to=None):
    """``a @ b`` where a NaN or infinite row of ``b`` reaches only the rows of ``a`` that see
    it: 0 * NaN must not carry NaN into a result that the non-finite number has no path to.
    ``b_finite=True`` (the caller has checked that every element of ``b`` is finite): the plain
    product, which is what the general path gives for such a ``b``, without its checks.
    ``add_to``: an array the result is added to (in one pass where ``b`` is finite); returned.

    ``a``: (n, k) weights (0 where not visible); ``b``: (k, m); ``visible()``: the (n, k)
    boolean of the places that are seen (asked only when the plain product is not finite).
    One reduction over the small product (not over ``b``) keeps the plain matmul for finite
    operands; otherwise the non-finite rows of ``b`` are zeroed for the matmul and their exact
    contribution added where seen (there, 0 * inf is NaN as the naive formula gives).
    """
    if b_finite and add_to is not None:
        return product(a, b, add_to, add=True)
    out = _visible_product(a, b, visible, b_finite)
    if add_to is None:
        return out
    with np.errstate(invalid="ignore", over="ignore"):
        add_to += out
    return add_to


def _visible_product(a, b, visible, b_finite):
    with np.errstate(invalid="ignore", over="ignore"):
        out = product(a, b)
        if b_finite or np.isfinite(np.sum(out)):
            return out
        bad = np.flatnonzero(~np.isfinite(b).all(axis=1))
    if bad.size == 0:
        return out                 # the product overflowed, or a has NaN: as it is
    seen_bad = visible()[:, bad]                                     # (n, n_bad)
    b_bad = b[bad]
    b = b.copy()
    b[bad] = 0
    with np.errstate(invalid="ignore", over="ignore"):
        part = np.where(seen_bad[:, :, None], a[:, bad, None] * b_bad[None], 0)
        return product(a, b) + part.sum(axis=1)


def band_columns(diag, left, right, js, width):
    """``(lo, hi)``: the query whose key-facing diagonal is ``diag[i]`` sees the columns
    ``[lo[i], hi[i])`` of a tile of ``width`` keys from ``js`` under the window band
    ``(left, right)`` (None: unbounded) alone; int64, not clipped. A stack's elements share
    one band, so its drivers take it here rather than from a :class:`ScorePipeline`."""
    lo = np.zeros(len(diag), dtype=np.int64) if left is None else diag - left - js
    hi = np.full(len(diag), width, dtype=np.int64) if right is None else diag + right + 1 - js
    return lo, hi


def query_diagonals(p, i0, i1):
    """The key facing each of the queries ``[i0, i1)`` of ``p`` (int64): the diagonal the
    window band is measured from."""
    return np.arange(i0, i1, dtype=np.int64) + np.int64(p.diagonal_offset)


def blas_ready(x, dtype):
    """``x`` as ``dtype`` in a layout BLAS takes without NumPy's slow fallback loop.

    ``x`` is one tile of one batch element: batch broadcasts were indexed away by the caller,
    so a copy here, for a zero-stride (broadcast) row or column axis, a strided view or another
    dtype, is bounded by the tile (a broadcast head dimension larger than SLICE_BYTES is
    multiplied in slices instead, see ScorePipeline).
    """
    if x.dtype != dtype:
        return x.astype(dtype, order="C")
    if x.flags.c_contiguous or x.flags.f_contiguous:
        return x
    return np.ascontiguousarray(x)


def copy_is_large(x, dtype):
    """True when :func:`blas_ready` would copy the broadcast view ``x`` into more than
    SLICE_BYTES: memory of the size of what ``x`` only pretends to hold."""
    broadcast = any(st == 0 and n > 1 for st, n in zip(x.strides, x.shape))
    return broadcast and x.size * np.dtype(dtype).itemsize > SLICE_BYTES


def _sliced_product(a, b, dtype, scale):
    """``(a * scale) @ b.T`` of an (n, d) ``a`` and a (w, d) ``b``, summed over slices of ``d``
    of at most SLICE_BYTES per operand copy, in order."""
    n, d = a.shape
    w = b.shape[0]
    step = max(1, SLICE_BYTES // (np.dtype(dtype).itemsize * max(n, w, 1)))
    out = np.zeros((n, w), dtype=dtype)
    for c in range(0, d, step):
        part = blas_ready(a[:, c:c + step], dtype) * scale
        product(part, blas_ready(b[:, c:c + step], dtype).T, out, add=True)
    return out
