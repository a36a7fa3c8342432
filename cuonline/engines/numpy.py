"""The NumPy engine: tiled online-softmax attention on the CPU.

Work is cut into tasks of one batch element x one block of queries (x one range of keys when
there are too few such tasks to keep every core busy). Each task walks its keys in tiles of
``BLOCK_K`` and keeps, per query row, the online-softmax state in natural units:

    m  running max of the scores seen so far
    l  sum of exp(s - m)
    O  sum of exp(s - m) * v        (unnormalised)

and rescales ``l`` and ``O`` by ``exp(m_old - m_new)`` whenever the max grows. The matrix
products go to BLAS; NumPy's ufuncs and BLAS release the GIL, so tasks run in a thread pool with
BLAS held to one thread per worker. Extra memory is a few ``BLOCK_Q x BLOCK_K`` tiles per worker
plus the output: the ``Lq x Lk`` score matrix never exists.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _semantics
from .merge import merge_states

# 256 x 512 float32 tiles: the score tile (512 KiB) stays in L2 while the two matmuls stream
# through it; measured fastest of {128, 256, 512}^2 at D=64 on the 2-core CI machine.
BLOCK_Q = 256
BLOCK_K = 512
# A block of few query rows walks its keys in wider tiles (up to BLOCK_Q * BLOCK_K scores, at
# most MAX_KEY_TILE keys): with one row, a 512-key tile is a few microseconds of work against
# tens of microseconds of per-tile Python.
MAX_KEY_TILE = 16384
# Query rows per product of the relative logits (see _ScoreTerms.add_relative_logits).
REL_ROWS = 64


def _key_tile(rows):
    """Keys per tile for a block of ``rows`` query rows: a multiple of BLOCK_K."""
    wide = BLOCK_Q * BLOCK_K // max(rows, 1) // BLOCK_K * BLOCK_K
    return min(max(BLOCK_K, wide), MAX_KEY_TILE)


def workers() -> int:
    """Number of CPU cores this process may run on: the thread count of ``workers=None``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def attention(p):
    """Run the problem ``p`` (a :class:`cuonline._validate.Problem`); return ``(out, lse)``.

    The tasks run on ``p.workers`` threads (validated: None or a count >= 1; None means
    :func:`workers`). The plan does not depend on ``p.workers``, so neither do the results.
    """
    n_workers = workers() if p.workers is None else p.workers
    out = np.zeros(p.batch_shape + (p.lq, p.dv), dtype=p.dtype)
    lse = np.full(p.batch_shape + (p.lq,), -np.inf, dtype=p.acc_dtype)
    blocks = _plan(p)
    tasks = [(b, i0, i1, ja, jb) for (b, i0, i1), ranges in blocks.items() for ja, jb in ranges]

    def run(task):
        b, i0, i1, ja, jb = task
        state = _attend(p, b, i0, i1, ja, jb)
        if len(blocks[b, i0, i1]) > 1:
            return state                       # one part of a split: merged below
        out[b][i0:i1], lse[b][i0:i1] = state
        return None

    states = _run(tasks, run, n_workers)
    for (b, i0, i1), ranges in blocks.items():
        if len(ranges) > 1:
            parts = [s for t, s in zip(tasks, states) if t[:3] == (b, i0, i1)]
            out[b][i0:i1], lse[b][i0:i1] = merge_states(
                np, [o for o, _ in parts], [s for _, s in parts]
            )
    return out, (lse if p.return_lse else None)


# --------------------------------------------------------------------------------------------
# planning and threads


def _plan(p):
    """Map each ``(batch_index, i0, i1)`` query block to the key ranges it must visit.

    A block visits the keys that any of its rows may see (window and causal band, keys below
    ``kv_lengths``), normally as one range. When there are fewer blocks than cores (a few
    queries scored against a long sequence, say), the range is split into whole-tile parts,
    run as separate tasks and merged (see merge.py). The split counts the cores, not the
    call's ``workers``, so that ``workers`` changes the speed and never the rounding.
    """
    block_q = min(BLOCK_Q, max(p.lq, 1))
    q_blocks = [(i0, min(i0 + block_q, p.lq)) for i0 in range(0, p.lq, block_q)]
    n_blocks = p.nbatch * len(q_blocks)
    splits = max(1, workers() // n_blocks) if n_blocks else 1
    plan = {}
    for b in np.ndindex(*p.batch_shape):
        kv_len = p.lk if p.kv_lengths is None else int(p.kv_lengths[b])
        for i0, i1 in q_blocks:
            j0, j1 = _semantics.visible_key_range(i0, i1, p.lq, p.lk, p.window,
                                                  p.diagonal_offset)
            j1 = max(j0, min(j1, kv_len))      # keys at or past kv_lengths are never read
            n_tiles = math.ceil((j1 - j0) / BLOCK_K)
            if splits == 1 or n_tiles < 2:
                plan[b, i0, i1] = [(j0, j1)]
                continue
            step = math.ceil(n_tiles / min(splits, n_tiles)) * BLOCK_K
            plan[b, i0, i1] = [(a, min(a + step, j1)) for a in range(j0, j1, step)]
    return plan


def _run(tasks, fn, n_workers):
    """``[fn(t) for t in tasks]`` on ``min(n_workers, len(tasks))`` threads.

    A single task runs in the calling thread with BLAS as the user set it (its matrix products
    are the only parallel work there is). Several tasks run with BLAS held to one thread, on
    any number of workers alike, so results do not depend on ``n_workers``: one worker runs
    them in the calling thread; ``n`` workers are the calling thread and ``n - 1`` threads of
    the shared pool, pulling tasks from one queue. The caller always works too, so a call
    progresses even while concurrent calls fill the pool, and each call runs on at most ``n``
    threads whatever the pool's size.
    """
    if len(tasks) < 2:
        return [fn(t) for t in tasks]
    n = min(n_workers, len(tasks))
    with _single_threaded_blas():
        if n == 1:
            return [fn(t) for t in tasks]
        batch = _Batch(tasks, fn)
        _submit(batch.drain, n - 1)
        try:
            batch.drain()
            batch.done.wait()
        finally:
            batch.stop()                       # interrupted: the pool takes no further task
    if batch.error is not None:
        raise batch.error
    return batch.results


class _Batch:
    """The tasks of one call, handed out one at a time to whichever thread asks first."""

    def __init__(self, tasks, fn):
        self.tasks, self.fn = tasks, fn
        self.results = [None] * len(tasks)
        self.error = None
        self.done = threading.Event()          # set when no task is left or running
        self._lock = threading.Lock()
        self._next = 0
        self._running = 0

    def stop(self):
        with self._lock:
            self._next = len(self.tasks)

    def drain(self):
        while True:
            with self._lock:
                if self.error is not None or self._next == len(self.tasks):
                    if self._running == 0:
                        self.done.set()
                    return
                i = self._next
                self._next += 1
                self._running += 1
            try:
                self.results[i] = self.fn(self.tasks[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                with self._lock:
                    self.error = self.error or exc
            with self._lock:
                self._running -= 1


# The pool is shared by all calls and grows to the largest thread count asked for. Its threads
# do not survive os.fork(), so a child starts with none (see _after_fork).
_pool = None
_pool_size = 0
_pool_lock = threading.Lock()


def _submit(job, count):
    """Run ``job`` on ``count`` pool threads (without waiting for it)."""
    global _pool, _pool_size
    # submitting under the lock: a pool being replaced by a larger one is shut down, and a
    # shut-down pool refuses new jobs (its queued and running jobs still finish)
    with _pool_lock:
        if _pool is None or _pool_size < count:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="cuonline")
            _pool_size = count
            if old is not None:
                old.shutdown(wait=False)
        for _ in range(count):
            _pool.submit(job)


# BLAS holds one process-wide thread count. Each call entering and leaving its own
# threadpool_limits would interleave (A saves N and sets 1, B saves 1, A restores N, B
# "restores" 1: the user's N is lost), so calls share one limit: the first call in sets it,
# the last one out restores it. Both happen on one helper thread because threadpoolctl (3.8+)
# lets only the thread that set OpenBLAS's limit change it again.
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter = None
_blas_thread = None


@contextlib.contextmanager
def _single_threaded_blas():
    _blas_enter()
    try:
        yield
    finally:
        _blas_exit()


def _blas_enter():
    global _blas_users, _blas_limiter, _blas_thread
    with _blas_lock:
        if _blas_users == 0:
            if _blas_thread is None:
                _blas_thread = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="cuonline-blas")
            _blas_limiter = _blas_thread.submit(_limit_blas).result()
        _blas_users += 1


def _blas_exit():
    global _blas_users, _blas_limiter
    with _blas_lock:
        _blas_users -= 1
        if _blas_users == 0:
            limiter, _blas_limiter = _blas_limiter, None
            _blas_thread.submit(limiter.__exit__, None, None, None).result()


_blas_controller = None


def _limit_blas():
    global _blas_controller
    if _blas_controller is None:
        # found once: a ThreadpoolController scans the loaded libraries (about 1 ms)
        from threadpoolctl import ThreadpoolController

        _blas_controller = ThreadpoolController().select(user_api="blas")
    limiter = _blas_controller.limit(limits=1)
    limiter.__enter__()                        # left in _blas_exit, on this same thread
    return limiter


def _after_fork():
    """In a child of os.fork(): forget the parent's threads and locks (they are not copied; a
    pool that believes it has idle threads would wait for them forever)."""
    global _pool, _pool_size, _pool_lock, _blas_lock, _blas_users, _blas_limiter, _blas_thread
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()
    limiter = _blas_limiter
    _blas_lock, _blas_users, _blas_limiter, _blas_thread = threading.Lock(), 0, None, None
    if limiter is not None:
        # forked while a call in another thread held BLAS at one thread: give the child the
        # user's count back, from a thread of its own as in _blas_exit
        restore = threading.Thread(target=limiter.__exit__, args=(None, None, None))
        restore.start()
        restore.join()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork)


# --------------------------------------------------------------------------------------------
# one task


def _attend(p, b, i0, i1, j_lo, j_hi):
    """Normalised ``(out, lse)`` in the accumulation dtype for queries ``[i0, i1)`` of batch
    element ``b`` over keys ``[j_lo, j_hi)``."""
    acc_t = p.acc_dtype
    n = i1 - i0
    left, right = p.window
    diag = np.arange(i0, i1, dtype=np.int64) + np.int64(p.diagonal_offset)  # key facing row

    # Scores and the running max stay in natural units: any finite score is representable,
    # whereas folding log2(e) in would overflow scores above max / 1.44. Only s - m <= 0 is
    # exponentiated (np.exp: twice as fast as np.exp2 for float32, measured).
    k, v = p.k[b], p.v[b]
    q_block = p.q[b][i0:i1]
    sliced = _copy_is_large(q_block, acc_t) or _copy_is_large(k[j_lo:j_hi], acc_t)
    qb = None if sliced else _blas_ready(q_block, acc_t) * acc_t.type(p.scale)
    cap = None if p.softcap is None else acc_t.type(p.softcap)
    slope = None if p.alibi_slopes is None else acc_t.type(p.alibi_slopes[b])
    terms = _ScoreTerms(p, b, i0, i1)

    def scores(js, je, band=True):
        """(n, je - js) scores of the tile, -inf where a row may not see a key (but for the
        window band when ``band`` is false: the kernel takes that from its ``lo`` and ``hi``)."""
        if sliced:
            s = _sliced_product(q_block, k[js:je], acc_t, p.scale)
        else:
            s = qb @ _blas_ready(k[js:je], acc_t).T
        terms.add_relative_logits(s, js, je)       # + rel_q . rel_k[delta]
        if cap is not None and not p.softcap_bias:
            _soft_cap(s, cap)                      # the content score only
        terms.add_biases(s, js, je)                # + bias (or block bias) + rel_bias[delta]
        cols = np.arange(js, je)                   # key indices of this tile
        if slope is not None:                      # ALiBi: -slope * |i + diag - j|
            with np.errstate(over="ignore"):   # a term beyond the range: -inf
                s -= slope * np.abs(diag[:, None] - cols[None, :]).astype(acc_t)
        if cap is not None and p.softcap_bias:
            _soft_cap(s, cap)                      # the whole logit (AlphaGenome)
        # masking: the window band only where this tile crosses its edge
        if band and left is not None and js < diag[-1] - left:
            np.copyto(s, -np.inf, where=cols[None, :] < (diag - left)[:, None])
        if band and right is not None and je - 1 > diag[0] + right:
            np.copyto(s, -np.inf, where=cols[None, :] > (diag + right)[:, None])
        if p.mask is not None:
            np.copyto(s, -np.inf, where=~p.mask[b][i0:i1, js:je])
        return s

    m = np.full(n, -np.inf, dtype=acc_t)
    l = np.zeros(n, dtype=acc_t)
    o = np.zeros((n, p.dv), dtype=acc_t)
    kernel = _tile_kernel(acc_t)
    width = _key_tile(n)
    everything_lo = np.zeros(n, dtype=np.int64)
    everything_hi = np.full(n, width, dtype=np.int64)
    for js in range(j_lo, j_hi, width):
        je = min(js + width, j_hi)
        s = scores(js, je, band=kernel is None)
        # rescale running state; s becomes p = exp(s - m)
        if kernel is not None:
            # row i sees tile columns [lo, hi): the window band, with no pass over the tile
            lo = everything_lo if left is None else diag - left - js
            hi = everything_hi if right is None else diag + right + 1 - js
            kernel(s, m, l, o, lo, hi)             # in place: m, l, o updated, one call
        else:
            m = _softmax_tile_ufuncs(s, m, l, o)
        # accumulate P·V
        vt = _blas_ready(v[js:je], acc_t)
        # Values at keys a row cannot see must not reach it, but 0 * NaN (or inf) in the
        # matmul would. Any non-finite value in V makes its column of p·v non-finite in every
        # row, so one reduction over the small product (not over V) keeps the plain matmul for
        # finite tiles; otherwise the product is redone exactly by _nonfinite_values.
        with np.errstate(over="ignore", invalid="ignore"):
            pv = s @ vt
            finite = np.isfinite(np.sum(pv))
        if not finite:
            pv = _nonfinite_values(s, vt, lambda: scores(js, je) != -np.inf, pv)
        o += pv

    with np.errstate(divide="ignore", invalid="ignore"):
        seen = l > 0
        o = np.divide(o, l[:, None], out=np.zeros_like(o), where=seen[:, None])
        o[np.isnan(l)] = np.nan
        lse = m + np.log(l)
    return o, lse.astype(acc_t, copy=False)


class _ScoreTerms:
    """The additive score terms of one task's queries ``[i0, i1)`` of batch element ``b``, added
    to a tile of scores in place, each read from its small array and never expanded.

    The relative terms depend on the distance ``delta = j - (i + diag)`` only. For a tile of
    ``n`` queries and ``w`` keys the distances form one band of ``n + w - 1`` values, ``delta =
    dmin + t`` with ``dmin = js - (i0 + diag + n - 1)``, and tile place ``(i, j)`` is band entry
    ``t = (j - js) - (i - i0) + n - 1``: a skewed (Toeplitz) view of the band, with strides
    ``(-1, 1)`` over a vector (``rel_bias``) or ``(nb - 1, 1)`` over the ``(n, nb)`` products
    ``rel_q @ band.T`` (``rel_q``/``rel_k``), so neither term is gathered per score.
    """

    def __init__(self, p, b, i0, i1):
        acc = p.acc_dtype
        self.n = i1 - i0
        self.first_diag = i0 + p.diagonal_offset           # key facing query i0
        self.block = p.bias_block
        self.bias = None
        if p.bias is not None and self.block is None:
            self.bias = p.bias[b][i0:i1]                  # (n, Lk), a view
        elif p.bias is not None:
            # the coarse rows of these queries, (n, ceil(Lk / c)): small, gathered once
            self.bias = p.bias[b][np.arange(i0, i1) // self.block[0]]
        self.rel_bias = None if p.rel_bias is None else p.rel_bias[b]
        self.rel_q = None if p.rel_q is None else _blas_ready(p.rel_q[b][i0:i1], acc)
        self.rel_k = None if p.rel_k is None else p.rel_k[b]
        self.rb, self.rk = p.rel_bias_radius, p.rel_k_radius
        self.acc = acc

    def _band(self, js, je, radius):
        """Table entries ``radius + clip(delta, -radius, radius)`` of the distances of the
        task's ``n`` rows and keys ``[js, je)``: ``n + (je - js) - 1`` of them, the smallest
        distance first."""
        dmin = js - (self.first_diag + self.n - 1)
        delta = np.arange(dmin, dmin + self.n + (je - js) - 1, dtype=np.int64)
        return radius + np.clip(delta, -radius, radius)

    @staticmethod
    def _skewed(flat, rows, row_step, w):
        """The (rows, w) view ``v[i, j] = flat[i * row_step + j + rows - 1]`` of a 1-d ``flat``."""
        item = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat[rows - 1:], shape=(rows, w),
                                               strides=(row_step * item, item),
                                               writeable=False)

    def add_relative_logits(self, s, js, je):
        """``s += rel_q[i] . rel_k[rk + clip(delta)]`` (a no-op without the term).

        Rows go in groups of REL_ROWS: the band of a group of ``g`` rows has ``g + w - 1``
        distances, so the products cost ``(g + w - 1) / w`` times the term's own work (1.1 for
        64 rows against 512 keys, where the whole 256-row block would cost 1.5).
        """
        if self.rel_q is None:
            return
        w = je - js
        # the band of the whole block, read once: a slice of the table where no distance is
        # clamped (a table of 2 L - 1 rows), else gathered; a group's band is a slice of it
        index = self._band(js, je, self.rk)
        if index[-1] - index[0] == index.size - 1:
            band = self.rel_k[index[0]:index[-1] + 1]
        else:
            band = self.rel_k[index]
        band_t = _blas_ready(band, self.acc).T                               # (Dr, n + w - 1)
        for r0 in range(0, self.n, REL_ROWS):
            r1 = min(r0 + REL_ROWS, self.n)
            g = r1 - r0
            products = self.rel_q[r0:r1] @ band_t[:, self.n - r1:self.n - r1 + g + w - 1]
            s[r0:r1] += self._skewed(products.reshape(-1), g, products.shape[1] - 1, w)

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
            band = np.ascontiguousarray(self.rel_bias[self._band(js, je, self.rb)])
            s += self._skewed(band, self.n, -1, je - js)


def _soft_cap(s, cap):
    """``s = cap * tanh(s / cap)`` in place."""
    s /= cap
    np.tanh(s, out=s)
    s *= cap


def _nonfinite_values(p, vt, visible, pv):
    """``p @ vt`` where NaN or infinite values in ``vt`` reach only the rows that see them.

    ``p``: (n, k) weights; ``vt``: (k, dv) values; ``visible()``: the (n, k) boolean of scores
    that are not -inf (recomputed: only this rare path needs it); ``pv``: the plain product,
    returned as it is when every value is finite (the product overflowed, or ``p`` has NaN).
    The non-finite rows of V are zeroed for the matmul and their exact contribution added where
    the score is not -inf (there, 0 * inf is NaN as the naive formula gives).
    """
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~np.isfinite(vt).all(axis=1))
    if bad.size == 0:
        return pv
    seen_bad = visible()[:, bad]                                    # (n, n_bad)
    v_bad = vt[bad]
    vt = vt.copy()
    vt[bad] = 0
    with np.errstate(invalid="ignore", over="ignore"):
        part = np.where(seen_bad[:, :, None], p[:, bad, None] * v_bad[None], 0)
        return p @ vt + part.sum(axis=1)


def _softmax_tile_ufuncs(s, m, l, o):
    """The ufunc form of ``_tile_kernels.online_softmax_tile`` (four passes over ``s``
    instead of two): ``s`` becomes ``exp(s - m_new)``, ``l`` and ``o`` are rescaled and updated in
    place; returns ``m_new``."""
    m_new = np.maximum(m, s.max(axis=1))
    m_safe = np.where(m_new == -np.inf, 0, m_new).astype(s.dtype, copy=False)
    with np.errstate(over="ignore"):           # s - m <= 0: -inf (weight 0) is right
        alpha = np.exp(m - m_safe)
        s -= m_safe[:, None]
    np.exp(s, out=s)
    l *= alpha
    l += s.sum(axis=1)
    o *= alpha[:, None]
    return m_new


# The compiled kernels (numba) by (name, dtype): the kernel, or None where numba is missing or
# the kernel does not compile here (the engines then run their ufunc passes, after one warning).
_kernels = {}
_kernels_lock = threading.Lock()
# False forces the ufunc passes (tests compare the two)
_use_kernels = True


def _tile_kernel(dtype, name="online_softmax_tile"):
    """The compiled kernel ``name`` of :mod:`._tile_kernels` for ``dtype``, or None.

    Imported and compiled on first use (so ``import cuonline`` imports no numba, about 0.3 s;
    compiled code is cached on disk by numba across processes).
    """
    if not _use_kernels:
        return None
    key = (name, np.dtype(dtype))
    kernel = _kernels.get(key, False)
    if kernel is False:
        with _kernels_lock:
            if key not in _kernels:
                _kernels[key] = _compile(*key)
            kernel = _kernels[key]
    return kernel


def _compile(name, dtype):
    try:
        from . import _tile_kernels

        return _tile_kernels.compile_for(name, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure to import or compile: the ufuncs
        import warnings

        warnings.warn(f"cuonline: the compiled kernel {name} for {dtype} is unavailable "
                      f"({type(exc).__name__}: {exc}); the NumPy engine runs its ufunc passes "
                      f"instead (slower, same results)", RuntimeWarning, stacklevel=3)
        return None


def _blas_ready(x, dtype):
    """``x`` as ``dtype`` in a layout BLAS takes without NumPy's slow fallback loop.

    ``x`` is one tile of one batch element (at most ``max(BLOCK_Q, BLOCK_K)`` rows of ``D`` or
    ``Dv`` columns): batch broadcasts were indexed away by the caller, so a copy here, for a
    zero-stride (broadcast) row or column axis, a strided view or another dtype, is bounded by
    the tile and never by the broadcast size. BLAS takes no zero stride and the products need
    every row, so a broadcast axis inside a tile is copied: there is no cheaper exact form.
    """
    if x.dtype != dtype:
        return x.astype(dtype, order="C")
    if x.flags.c_contiguous or x.flags.f_contiguous:
        return x
    return np.ascontiguousarray(x)


# A broadcast (zero-stride) operand whose copy would exceed this many bytes is multiplied in
# slices of its last axis, copying one slice at a time (D = 2**24 broadcast from one element).
SLICE_BYTES = 1 << 22


def _copy_is_large(x, dtype):
    """True when :func:`_blas_ready` would copy the broadcast view ``x`` into more than
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
        part = _blas_ready(a[:, c:c + step], dtype) * dtype.type(scale)
        out += part @ _blas_ready(b[:, c:c + step], dtype).T
    return out
