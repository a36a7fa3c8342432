"""The NumPy engine of :func:`cuonline.attention_stats`: statistics of ``P`` in tiles.

``P = exp(s - lse)`` row by row, with the logits ``s`` of :class:`.numpy_scores.ScorePipeline`
(the forward's and backward's), so the statistics describe exactly the ``P`` that attention
applies. The ``Lq x Lk`` matrix never exists; memory is a few tiles per worker plus the
results.

* Pass 1, query-owned (one task per batch element x block of queries, x a range of keys when
  there are too few blocks for the cores): per row, the online-softmax state of
  :class:`RowState` over the key tiles: ``m`` (running max), ``l = sum e^(s - m)``,
  ``u = sum e^(s - m) (s - m)`` (the entropy's, rescaled with ``l``), the first key of the
  largest score, and the ``top_k`` best ``(score, key)`` pairs. States of key ranges merge
  exactly (:meth:`RowState.merge`), as the Dask engine's chunks do.
* Pass 2, key-owned (``received``): one task per batch element x block of keys walks the
  query blocks in a fixed order and adds ``w^T P`` of each, with ``P`` from pass 1's ``lse``:
  every key's sum has one order whatever the threads, so the result is deterministic.
* ``rows``: the requested rows of ``P``, from ``lse``, in runs of consecutive rows.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np

from .cpu_runtime import run_tasks, workers
from . import numpy as numpy_forward
from .numpy_scores import ScorePipeline

if TYPE_CHECKING:
    from .._stats import AttentionStats
    from .._validate import StatsProblem

__all__ = ["RowState", "attention_stats", "finished", "probabilities", "row_state", "row_states",
           "received", "weights_of_rows"]


def _key_tile(p, rows):
    """Keys per tile for a block of ``rows`` query rows: the forward's."""
    return numpy_forward.key_tile(rows, *numpy_forward.blocks(p.acc_dtype))


class RowState:
    """The running statistics of ``n`` query rows over the keys seen so far.

    ``m`` (max score), ``l = sum_j e^(s_j - m)``, ``u = sum_j e^(s_j - m) (s_j - m)`` (None
    without entropy), ``arg`` (first key of the max, -1 before any visible key) and, with
    ``k > 0``, the ``k`` best scores ``top_s`` and their keys ``top_i`` (descending score,
    lower key first on ties; -inf / -1 where fewer keys were seen). Invisible keys have the
    score -inf and weigh nothing.
    """

    def __init__(self, n, k, acc, entropy):
        self.m = np.full(n, -np.inf, dtype=acc)
        self.l = np.zeros(n, dtype=acc)
        self.u = np.zeros(n, dtype=acc) if entropy else None
        self.arg = np.full(n, -1, dtype=np.int64)
        self.k = k
        self.top_s = np.full((n, k), -np.inf, dtype=acc)
        self.top_i = np.full((n, k), -1, dtype=np.int64)

    def update(self, s, js):
        """Take in the ``(n, w)`` logits ``s`` of keys ``[js, js + w)`` (all later than the
        keys seen so far); ``s`` is overwritten."""
        rows = np.arange(s.shape[0])
        first = s.argmax(axis=1)                    # first key of the tile's max (NaN: first NaN)
        tile_max = s[rows, first]
        self.arg = np.where(tile_max > self.m, js + first, self.arg)   # ties: earlier keys
        if self.k:
            self.top_s, self.top_i = _select_tile(self.top_s, self.top_i, s, js,
                                                  bool(np.isnan(tile_max).any()))
        m_new = np.maximum(self.m, tile_max)
        m_safe = _finite_or_zero(m_new)
        self._rescale(m_new, m_safe)
        np.subtract(s, m_safe[:, None], out=s)     # x = s - m <= 0
        if self.u is None:
            self.l += np.exp(s, out=s).sum(axis=1)
            return
        if (s == -np.inf).any():
            # an invisible key becomes the lowest float: e^x is 0 and e^x * x is -0, where
            # -inf would give 0 * -inf = NaN (a row of the lowest: NumPy's maximum with a
            # scalar runs three times slower)
            np.maximum(s, np.full(s.shape[1], np.finfo(s.dtype).min, dtype=s.dtype), out=s)
        e = np.exp(s)
        self.l += e.sum(axis=1)
        self.u += np.einsum("ij,ij->i", e, s)

    def _rescale(self, m_new, m_safe):
        """Express ``l`` and ``u`` against the max ``m_new`` (``m_safe``: 0 where -inf)."""
        with np.errstate(invalid="ignore"):        # -inf - -inf where no key was seen yet
            alpha = np.exp(self.m - m_safe)
            if self.u is not None:
                # e^(s - m') (s - m') = alpha e^(s - m) ((s - m) + (m - m'))
                shift = np.where(self.l > 0, self.m - m_safe, 0)
                self.u = alpha * (self.u + shift * self.l)
        self.l = self.l * alpha                    # new arrays: a merged state stays intact
        self.m = m_new

    def merge(self, later):
        """Take in ``later``, the state of the same rows over keys after all of this one's:
        the result is this state as if it had also seen ``later``'s keys."""
        m_new = np.maximum(self.m, later.m)
        m_safe = _finite_or_zero(m_new)
        self.arg = np.where(later.m > self.m, later.arg, self.arg)
        if self.k:
            self.top_s, self.top_i = _select(
                np.concatenate([self.top_s, later.top_s], axis=1),
                np.concatenate([self.top_i, later.top_i], axis=1), self.k,
                bool(np.isnan(later.m).any() or np.isnan(self.m).any()))
        saved = later.m, later.l, later.u
        later._rescale(m_new, m_safe)
        self._rescale(m_new, m_safe)
        self.l = self.l + later.l
        if self.u is not None:
            self.u = self.u + later.u
        later.m, later.l, later.u = saved          # left as it came
        return self

    def shifted(self, offset):
        """This state with its key indices moved by ``offset`` (a chunk's first key); -1
        stays -1."""
        out = copy.copy(self)
        out.arg = np.where(self.arg < 0, -1, self.arg + offset)
        out.top_i = np.where(self.top_i < 0, -1, self.top_i + offset)
        return out

    @classmethod
    def stack(cls, states):
        """One state of the rows of ``states``, in order."""
        out = copy.copy(states[0])
        for name in ("m", "l", "u", "arg", "top_s", "top_i"):
            if getattr(out, name) is not None:
                setattr(out, name, np.concatenate([getattr(s, name) for s in states]))
        return out

    def finish(self):
        """``(lse, entropy, max_weight, argmax, top_indices, top_weights)``; entropy None
        without it, the top pair None with ``k = 0``. A row that saw no key: lse -inf,
        entropy 0, max weight 0, argmax -1, top keys -1 with weight 0."""
        none = self.l == 0                          # not NaN: a NaN row stays NaN
        with np.errstate(divide="ignore", invalid="ignore"):
            log_l = np.log(self.l)
            lse = self.m + log_l                    # -inf + log 0 = -inf where none seen
            entropy = None
            if self.u is not None:
                entropy = np.where(none, 0, log_l - self.u / self.l).astype(self.l.dtype)
            max_weight = np.where(none, 0, 1 / self.l).astype(self.l.dtype)
        argmax = np.where(none, -1, self.arg)
        top_i = top_w = None
        if self.k:
            top_i = np.where(self.top_s == -np.inf, -1, self.top_i)
            top_w = probabilities(self.top_s.copy(), lse)
        return lse, entropy, max_weight, argmax, top_i, top_w


def _finite_or_zero(m):
    """The max to subtract: 0 where it is -inf (no key seen: e^(-inf - 0) = 0, no NaN)."""
    return np.where(m == -np.inf, 0, m).astype(m.dtype, copy=False)


def _select(scores, index, k, has_nan):
    """The ``k`` best of each row of ``scores`` (n, c >= k) with their ``index``: descending
    score, and among equal scores the earlier column first (the callers put lower keys in
    earlier columns). NaN counts as -inf here (its row's weights are NaN anyway)."""
    n, c = scores.shape
    if has_nan:
        scores = np.where(np.isnan(scores), -np.inf, scores)
    if c > k:
        # the k-th best value of each row; of the entries equal to it, the earliest ones
        kth = np.partition(scores, c - k, axis=1)[:, c - k, None]
        greater = scores > kth
        equal = scores == kth
        need = k - greater.sum(axis=1, keepdims=True)
        take = greater | equal
        ties = np.flatnonzero(equal.sum(axis=1) > need[:, 0])
        if ties.size:
            # more entries equal the k-th value than places left: the earliest ones (a
            # cumsum along rows is slow, so only on these rows)
            tied = equal[ties]
            take[ties] = greater[ties] | (tied & (np.cumsum(tied, axis=1) <= need[ties]))
        scores = scores[take].reshape(n, k)        # row-major: each row's columns in order
        index = index[take].reshape(n, k)
    order = np.argsort(-scores, axis=1, kind="stable")
    return (np.take_along_axis(scores, order, axis=1),
            np.take_along_axis(index, order, axis=1))


def _select_tile(top_s, top_i, s, js, has_nan):
    """The ``k`` best of the running ``(top_s, top_i)`` (n, k) and the tile ``s`` of keys
    from ``js``, as :func:`_select` orders them.

    Only the tile's scores above a row's current k-th best can enter (an equal one has a
    higher key, so it loses the tie): after the first tiles they are few, and only the rows
    with entrants select among their running best and entrants; a tile with many of them (the
    first) takes :func:`_select` over the whole tile instead.
    """
    n, k = top_s.shape
    enters = s > top_s[:, -1:]                    # NaN never enters: its row's weights are NaN
    count = np.count_nonzero(enters)
    if count > 4 * top_s.size:
        index = np.broadcast_to(np.arange(js, js + s.shape[1], dtype=np.int64), s.shape)
        return _select(np.concatenate([top_s, s], axis=1),
                       np.concatenate([top_i, index], axis=1), k, has_nan)
    if count == 0:
        return top_s, top_i
    rows, cols = np.nonzero(enters)               # row-major: each row's keys ascending
    # the rows with entrants: their running best, then their entrants, padded with -inf
    counts = np.bincount(rows, minlength=n)
    busy = np.flatnonzero(counts)
    width = k + int(counts.max())
    slot = np.cumsum(counts) - counts             # first entrant of each row
    place = k + np.arange(rows.size) - np.repeat(slot[busy], counts[busy])
    where = np.searchsorted(busy, rows)
    pad_s = np.full((busy.size, width), -np.inf, dtype=top_s.dtype)
    pad_i = np.full((busy.size, width), -1, dtype=np.int64)
    pad_s[:, :k], pad_i[:, :k] = top_s[busy], top_i[busy]
    pad_s[where, place], pad_i[where, place] = s[rows, cols], js + cols
    top_s, top_i = top_s.copy(), top_i.copy()
    top_s[busy], top_i[busy] = _select(pad_s, pad_i, k, False)
    return top_s, top_i


def probabilities(s, lse):
    """``P = e^(s - lse)`` of the ``(n, w)`` logits ``s`` (overwritten and returned): 0 at
    invisible keys (-inf) and in rows that see no key (lse -inf); NaN at the visible keys of
    a NaN row."""
    safe = np.where(lse == -np.inf, 0, lse).astype(s.dtype, copy=False)
    invisible = None
    if np.isnan(lse).any():
        invisible = s == -np.inf
    np.subtract(s, safe[:, None], out=s)
    np.exp(s, out=s)
    if invisible is not None:
        s[invisible] = 0
    return s


# --------------------------------------------------------------------------------------------
# planning


def _query_blocks(p):
    block_q = min(numpy_forward.blocks(p.acc_dtype)[0], max(p.lq, 1))
    return [(i0, min(i0 + block_q, p.lq)) for i0 in range(0, p.lq, block_q)]


# --------------------------------------------------------------------------------------------
# the passes


def row_states(p, top_k, entropy, j_lo, j_hi, b, i0, i1):
    """The :class:`RowState` of queries ``[i0, i1)`` of batch element ``b`` over keys
    ``[j_lo, j_hi)`` (the caller clips the range to the keys the rows may see)."""
    state = RowState(i1 - i0, top_k, p.acc_dtype, entropy)
    pipeline = ScorePipeline(p, b, i0, i1)
    width = _key_tile(p, i1 - i0)
    for js in range(j_lo, j_hi, width):
        je = min(js + width, j_hi)
        state.update(pipeline.logits(js, je), js)
    return state


def received(p, lse, query_weights, n_workers):
    """``sum_i w_i P_ij``: S + (Lk,) in the accumulation dtype. One task per batch element x
    block of keys, each adding the query blocks in order (deterministic for any thread
    count); a query block that cannot see the key block, or whose weights are all 0, is
    skipped (a zero-weight row adds nothing, even where its P is NaN)."""
    out = np.zeros(p.batch_shape + (p.lk,), dtype=p.acc_dtype)
    q_blocks = _query_blocks(p)
    block_k = numpy_forward.blocks(p.acc_dtype)[1]
    tasks = [(b, j0, min(j0 + block_k, p.lk))
             for b in np.ndindex(*p.batch_shape) for j0 in range(0, p.lk, block_k)]

    def run(task):
        b, j0, j1 = task
        total = out[b][j0:j1]
        for i0, i1 in q_blocks:
            lo, hi = numpy_forward.key_range(p, b, i0, i1)
            js, je = max(lo, j0), min(hi, j1)
            if js >= je:
                continue
            w = None if query_weights is None else query_weights[b][i0:i1]
            if w is not None and not w.any():
                continue
            probs = probabilities(ScorePipeline(p, b, i0, i1).logits(js, je), lse[b][i0:i1])
            if w is None:
                total[js - j0:je - j0] += probs.sum(axis=0)
                continue
            zero = w == 0
            if zero.any():
                probs[zero] = 0
            total[js - j0:je - j0] += w @ probs

    run_tasks(tasks, run, n_workers)
    return out


def weights_of_rows(p, lse, rows, n_workers):
    """The rows ``rows`` (1-D, in [0, Lq)) of ``P``: S + (len(rows), Lk), computed for runs of
    consecutive distinct rows (at most the forward's rows per task each) from ``lse``."""
    block_q = numpy_forward.blocks(p.acc_dtype)[0]
    out = np.zeros(p.batch_shape + (rows.size, p.lk), dtype=p.acc_dtype)
    unique = np.unique(rows)
    runs = []
    start = 0
    for n in range(1, unique.size + 1):
        if (n == unique.size or unique[n] != unique[n - 1] + 1
                or n - start == block_q):
            runs.append((int(unique[start]), int(unique[n - 1]) + 1))
            start = n
    tasks = [(b, i0, i1) for b in np.ndindex(*p.batch_shape) for i0, i1 in runs]

    def run(task):
        b, i0, i1 = task
        block = np.zeros((i1 - i0, p.lk), dtype=p.acc_dtype)
        j0, j1 = numpy_forward.key_range(p, b, i0, i1)
        pipeline = ScorePipeline(p, b, i0, i1)
        width = _key_tile(p, i1 - i0)
        for js in range(j0, j1, width):
            je = min(js + width, j1)
            block[:, js:je] = probabilities(pipeline.logits(js, je), lse[b][i0:i1])
        where = np.flatnonzero((rows >= i0) & (rows < i1))
        out[b][where] = block[rows[where] - i0]

    run_tasks(tasks, run, n_workers)
    return out


def row_state(sp, n_workers=None):
    """Pass 1 of the :class:`cuonline._validate.StatsProblem` ``sp``: the :class:`RowState`
    of every query over every key, its rows in C order of ``S + (Lq,)``."""
    p = sp.scores
    n_workers = n_workers or (workers() if p.workers is None else p.workers)
    plan = numpy_forward.plan(p)
    tasks = [(b, i0, i1, ja, jb) for (b, i0, i1), ranges in plan.items() for ja, jb in ranges]
    states = run_tasks(tasks, lambda t: row_states(p, sp.top_k, sp.entropy, t[3], t[4],
                                                   *t[:3]), n_workers)
    merged = []
    for key in plan:                          # C order of (b, i0): the rows' order
        parts = [s for t, s in zip(tasks, states) if t[:3] == key]
        for later in parts[1:]:               # in key order
            parts[0].merge(later)
        merged.append(parts[0])
    if not merged:
        return RowState(0, sp.top_k, p.acc_dtype, sp.entropy)
    return RowState.stack(merged)


def finished(state, shape):
    """The row fields of :class:`cuonline.AttentionStats` from the :class:`RowState` of the
    rows of ``shape`` (``S + (Lq,)``), as a dict."""
    lse, entropy, max_weight, argmax, top_i, top_w = state.finish()
    fields = dict(lse=lse, entropy=entropy, max_weight=max_weight, argmax=argmax,
                  top_indices=top_i, top_weights=top_w)
    return {n: None if x is None else x.reshape(shape + x.shape[1:]) for n, x in fields.items()}


def attention_stats(sp: StatsProblem) -> AttentionStats:
    """Run the :class:`cuonline._validate.StatsProblem` ``sp``; return the fields of
    :class:`cuonline.AttentionStats` as a dict."""
    p = sp.scores
    n_workers = workers() if p.workers is None else p.workers
    result = finished(row_state(sp, n_workers), p.batch_shape + (p.lq,))
    result.update(received=None, weights=None)
    if sp.received:
        result["received"] = received(p, result["lse"], sp.query_weights, n_workers)
    if sp.rows is not None:
        result["weights"] = weights_of_rows(p, result["lse"], sp.rows, n_workers)
    return result
