"""The NumPy engine: tiled online-softmax attention on the CPU.

Work is cut into tasks of one batch element x one block of queries (x one range of keys when
there are too few such tasks to keep every core busy). Each task walks its keys in tiles of
``BLOCK_K`` and keeps, per query row, the online-softmax state in base 2:

    m  running max of the scores seen so far (scores already multiplied by log2(e))
    l  sum of exp2(s - m)
    O  sum of exp2(s - m) * v        (unnormalised)

and rescales ``l`` and ``O`` by ``exp2(m_old - m_new)`` whenever the max grows. The matrix
products go to BLAS; NumPy's ufuncs and BLAS release the GIL, so tasks run in a thread pool with
BLAS held to one thread per worker. Extra memory is a few ``BLOCK_Q x BLOCK_K`` tiles per worker
plus the output: the ``Lq x Lk`` score matrix never exists.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _semantics
from .._semantics import LN2, LOG2E
from .merge import merge_states

# 256 x 512 float32 tiles: the score tile (512 KiB) stays in L2 while the two matmuls stream
# through it; measured fastest of {128, 256, 512}^2 at D=64 on the 2-core CI machine.
BLOCK_Q = 256
BLOCK_K = 512


def workers() -> int:
    """Number of CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def attention(p):
    """Run the problem ``p`` (a :class:`cuonline._validate.Problem`); return ``(out, lse)``."""
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

    states = _run(tasks, run)
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
    run as separate tasks and merged (see merge.py).
    """
    block_q = min(BLOCK_Q, max(p.lq, 1))
    q_blocks = [(i0, min(i0 + block_q, p.lq)) for i0 in range(0, p.lq, block_q)]
    n_blocks = p.nbatch * len(q_blocks)
    splits = max(1, workers() // n_blocks) if n_blocks else 1
    plan = {}
    for b in np.ndindex(*p.batch_shape):
        kv_len = p.lk if p.kv_lengths is None else int(p.kv_lengths[b])
        for i0, i1 in q_blocks:
            j0, j1 = _semantics.visible_key_range(i0, i1, p.lq, p.lk, p.window)
            j1 = max(j0, min(j1, kv_len))      # keys at or past kv_lengths are never read
            n_tiles = math.ceil((j1 - j0) / BLOCK_K)
            if splits == 1 or n_tiles < 2:
                plan[b, i0, i1] = [(j0, j1)]
                continue
            step = math.ceil(n_tiles / min(splits, n_tiles)) * BLOCK_K
            plan[b, i0, i1] = [(a, min(a + step, j1)) for a in range(j0, j1, step)]
    return plan


_pool = None
_pool_lock = threading.Lock()


def _executor():
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="cuonline")
        return _pool


def _run(tasks, fn):
    """``[fn(t) for t in tasks]``: on the pool with single-threaded BLAS when there are tasks
    for several cores, else in this thread, letting BLAS use the cores itself."""
    if len(tasks) >= 2 and workers() > 1:
        with _blas_threads(1):
            return list(_executor().map(fn, tasks))
    return [fn(t) for t in tasks]


def _blas_threads(n):
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


# --------------------------------------------------------------------------------------------
# one task


def _attend(p, b, i0, i1, j_lo, j_hi):
    """Normalised ``(out, lse)`` in the accumulation dtype for queries ``[i0, i1)`` of batch
    element ``b`` over keys ``[j_lo, j_hi)``."""
    acc_t = p.acc_dtype
    n = i1 - i0
    left, right = p.window
    diag = np.arange(i0, i1) + _semantics.diagonal_offset(p.lq, p.lk)   # key aligned with row

    # scores come out of the matmul in base 2: fold scale * log2(e) into the query block
    qb = _blas_ready(p.q[b][i0:i1], acc_t) * acc_t.type(p.scale * LOG2E)
    k, v = p.k[b], p.v[b]
    cap2 = None if p.softcap is None else acc_t.type(p.softcap * LOG2E)
    slope2 = None if p.alibi_slopes is None else acc_t.type(p.alibi_slopes[b] * LOG2E)

    m = np.full(n, -np.inf, dtype=acc_t)
    l = np.zeros(n, dtype=acc_t)
    o = np.zeros((n, p.dv), dtype=acc_t)
    scratch = None
    for js in range(j_lo, j_hi, BLOCK_K):
        je = min(js + BLOCK_K, j_hi)
        # scores, (n, je - js)
        s = qb @ _blas_ready(k[js:je], acc_t).T
        if cap2 is not None:                       # c * tanh(s / c), in base 2
            s /= cap2
            np.tanh(s, out=s)
            s *= cap2
        if p.bias is not None:
            if scratch is None or scratch.shape != s.shape:
                scratch = np.empty_like(s)
            np.multiply(p.bias[b][i0:i1, js:je], acc_t.type(LOG2E), out=scratch)
            s += scratch
        cols = np.arange(js, je)
        if slope2 is not None:                     # ALiBi: -slope * |i + Lk - Lq - j|
            s -= slope2 * np.abs(diag[:, None] - cols[None, :]).astype(acc_t)
        # masking: the window band only where this tile crosses its edge
        if left is not None and js < diag[-1] - left:
            np.copyto(s, -np.inf, where=cols[None, :] < (diag - left)[:, None])
        if right is not None and je - 1 > diag[0] + right:
            np.copyto(s, -np.inf, where=cols[None, :] > (diag + right)[:, None])
        if p.mask is not None:
            np.copyto(s, -np.inf, where=~p.mask[b][i0:i1, js:je])

        # rescale running state
        m_new = np.maximum(m, s.max(axis=1))
        m_safe = np.where(m_new == -np.inf, 0, m_new).astype(acc_t, copy=False)
        alpha = np.exp2(m - m_safe)
        s -= m_safe[:, None]
        np.exp2(s, out=s)
        l *= alpha
        l += s.sum(axis=1)
        o *= alpha[:, None]
        # accumulate P·V
        o += s @ _blas_ready(v[js:je], acc_t)
        m = m_new

    with np.errstate(divide="ignore", invalid="ignore"):
        seen = l > 0
        o = np.divide(o, l[:, None], out=np.zeros_like(o), where=seen[:, None])
        o[np.isnan(l)] = np.nan
        lse = (m + np.log2(l)) * acc_t.type(LN2)
    return o, lse.astype(acc_t, copy=False)


def _blas_ready(x, dtype):
    """``x`` as ``dtype`` in a layout BLAS takes without NumPy's slow fallback loop."""
    if x.dtype != dtype:
        return x.astype(dtype, order="C")
    if x.flags.c_contiguous or x.flags.f_contiguous:
        return x
    return np.ascontiguousarray(x)
