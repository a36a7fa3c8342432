"""The NumPy engine: tiled online-softmax attention on the CPU.

Work is cut into tasks of one batch element x one block of queries (x one range of keys when
there are too few such tasks to keep every core busy); the block and tile shapes come from the
machine's L2 cache (:func:`blocks`). A batch of short sequences (each element's queries one
block) runs as stacks of elements instead (:func:`stack_plan`, one
compiled call per stack). Each task walks its keys in tiles of ``BLOCK_K`` and
keeps, per query row, the online-softmax state in natural units:

    m  running max of the scores seen so far
    l  sum of exp(s - m)
    O  sum of exp(s - m) * v        (unnormalised)

and rescales ``l`` and ``O`` by ``exp(m_old - m_new)`` whenever the max grows. The matrix
products go to BLAS; NumPy's ufuncs and BLAS release the GIL, so tasks run in a thread pool with
BLAS held to one thread per worker. Extra memory is a few ``BLOCK_Q x BLOCK_K`` tiles per worker
plus the output: the ``Lq x Lk`` score matrix never exists.

The logits of a tile come from the score pipeline shared with the backward
(:mod:`.numpy_scores`); threads, BLAS limits and the compiled tile kernel from
:mod:`.cpu_runtime`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _options, _semantics
from .cpu_blas import batch_addresses, batch_index, compiled_task, product
from .cpu_runtime import (ElementRun, cache_sizes, cores_for, run_tasks, score_tile, stacks_of,
                          tile_kernel, workers)
from .merge import merge_states
from .numpy_scores import (SLICE_BYTES, ScorePipeline, band_columns, blas_ready,
                           copy_is_large, group_rows, query_diagonals, visible_product)

if TYPE_CHECKING:
    from .._validate import Problem

# The float32 tile shape from this machine's L2 (cpu_runtime.score_tile, one live score tile:
# 512 x 512 on a 1 MiB L2); other dtypes take theirs from blocks() (512 x 256 float64). Set to
# other values, BLOCK_Q and BLOCK_K fix the shape for every dtype (tests do).
BLOCK_Q, BLOCK_K = score_tile(cache_sizes()["L2"], 4, live_tiles=1)
_MACHINE_TILE = (BLOCK_Q, BLOCK_K)
# A block of few query rows walks its keys in wider tiles (up to rows x keys of the tile shape
# scores, at most MAX_KEY_TILE keys): with one row, a 512-key tile is a few microseconds of
# work against tens of microseconds of per-tile Python.
MAX_KEY_TILE = 16384
# The most rows per group when a tile's products cover only the columns the window band shows
# each group (ScorePipeline.row_spans; numpy_scores.group_rows: four groups of a tile's rows,
# at most these): a causal diagonal tile then costs 5/8 of a full one, while each product
# keeps enough rows for BLAS.
SPAN_ROWS = 128


def blocks(dtype):
    """``(BLOCK_Q, BLOCK_K)``: query rows per task and keys per tile for scores of ``dtype``."""
    rows, keys = score_tile(cache_sizes()["L2"], np.dtype(dtype).itemsize, live_tiles=1)
    return (rows if BLOCK_Q == _MACHINE_TILE[0] else BLOCK_Q,
            keys if BLOCK_K == _MACHINE_TILE[1] else BLOCK_K)


def key_tile(rows, block_q, block_k):
    """Keys per tile for a block of ``rows`` query rows: a multiple of ``block_k``."""
    wide = block_q * block_k // max(rows, 1) // block_k * block_k
    return min(max(block_k, wide), MAX_KEY_TILE)


def attention(p: Problem) -> tuple[np.ndarray, Any]:
    """Run the problem ``p`` (a :class:`cuonline._validate.Problem`); return ``(out, lse)``.

    The tasks run on ``p.workers`` threads (validated: None or a count >= 1; None means
    :func:`workers`). The plan does not depend on ``p.workers``, so neither do the results.
    """
    n_workers = workers() if p.workers is None else p.workers
    stacks = stack_plan(p)
    # where the stacks' query blocks hold every row (none left out for seeing no key), each
    # row of the results is written: no zeros first (2 MB of them at 64 heads of 128 x 64)
    if stacks is not None and sum(i1 - i0 for i0, i1 in {t[1:3] for t in stacks}) == p.lq:
        out = np.empty(p.batch_shape + (p.lq, p.dv), dtype=p.dtype)
        lse = np.empty(p.batch_shape + (p.lq,), dtype=p.acc_dtype)
    else:
        out = np.zeros(p.batch_shape + (p.lq, p.dv), dtype=p.dtype)
        lse = np.full(p.batch_shape + (p.lq,), -np.inf, dtype=p.acc_dtype)
    if stacks is not None:
        _run_stacks(p, stacks, out, lse, n_workers)
        return out, (lse if p.return_lse else None)
    blocks = plan(p)
    tasks = [(b, i0, i1, ja, jb) for (b, i0, i1), ranges in blocks.items() for ja, jb in ranges]

    def run(task):
        b, i0, i1, ja, jb = task
        state = _attend(p, b, i0, i1, ja, jb)
        if len(blocks[b, i0, i1]) > 1:
            return state                       # one part of a split: merged below
        out[b][i0:i1], lse[b][i0:i1] = state
        return None

    # the longest tasks first: under a causal band or a window, blocks see unequal key ranges
    states = run_tasks(tasks, run, n_workers, cost=lambda t: (t[2] - t[1]) * (t[4] - t[3]))
    for (b, i0, i1), ranges in blocks.items():
        if len(ranges) > 1:
            parts = [s for t, s in zip(tasks, states) if t[:3] == (b, i0, i1)]
            out[b][i0:i1], lse[b][i0:i1] = merge_states(
                np, [o for o, _ in parts], [s for _, s in parts]
            )
    return out, (lse if p.return_lse else None)


def _run_stacks(p, stacks, out, lse, n_workers):
    """:func:`stack_plan`'s ``stacks`` run into the (fresh, C-ordered) results ``out`` and
    ``lse``.

    Every stack's compiled call is made first, in this thread (:meth:`StackWalks.call`),
    while the interpreter's data are still in the caches; the longest stack runs first
    (under a causal band, the lower blocks see more keys). A compiled stack's thread runs its
    kernel only (and copies its outputs where they are not written in place): the rows'
    ``lse`` and the elements whose outputs were not finite (redone by :func:`_attend`'s
    careful path) are worked out here after every stack, once for each query block of the
    batch. (Done by each stack's thread, the two threads, finishing together, handed the GIL
    to and fro across NumPy's calls: 0.15 ms of a 1.7 ms call of 64 heads of 128 queries on
    machine C.)"""
    acc_t = p.acc_dtype
    # a stack is a run of consecutive elements: one slice of the results
    flat_out = out.reshape((p.nbatch, p.lq, p.dv))
    flat_lse = lse.reshape((p.nbatch, p.lq))
    # each query block's walks and its rows' m, l and finiteness over the batch, or None where
    # the compiled walk does not apply
    spans = {}

    def prepared(task):
        elements, i0, i1, j0, j1 = task
        rows = slice(elements.start, elements.stop)
        if (i0, i1, j0, j1) not in spans:
            walks = stack_walks(p, i0, i1, j0, j1)
            spans[i0, i1, j0, j1] = None if walks is None else (
                walks, np.full((p.nbatch, i1 - i0), -np.inf, dtype=acc_t),
                np.zeros((p.nbatch, i1 - i0), dtype=acc_t), np.empty(p.nbatch, dtype=np.bool_))
        found = spans[i0, i1, j0, j1]
        if found is None:
            def products():
                flat_out[rows, i0:i1], flat_lse[rows, i0:i1] = _stacked_products(
                    p, elements, i0, i1, j0, j1)

            return products
        walks, m, l, finite = found
        # whole elements in the accumulation dtype: the walk writes into the result
        target = flat_out[rows] if i1 - i0 == p.lq and p.dtype == acc_t else None
        walk = walks.call(elements, m[rows], l[rows], finite[rows], target)

        def run():
            o = walk()
            if o is not target:
                flat_out[rows, i0:i1] = o

        return run

    runs = [prepared(task) for task in stacks]
    # compiled stacks on a sequential library call no BLAS that threads: no hold to make
    hold = any(found is None or not found[0].blas.sequential for found in spans.values())
    run_tasks(range(len(stacks)), lambda i: runs[i](), n_workers,
              cost=lambda i: len(stacks[i][0]) * (stacks[i][2] - stacks[i][1])
              * (stacks[i][4] - stacks[i][3]), hold_blas=hold)
    batch = ElementRun(p.batch_shape, 0, p.nbatch)
    for (i0, i1, j0, j1), found in spans.items():
        if found is not None:
            _, m, l, finite = found
            flat_lse[:, i0:i1] = _lse(m, l, acc_t)
            _redone(p, batch, i0, i1, j0, j1, flat_out[:, i0:i1], flat_lse[:, i0:i1], finite)


# --------------------------------------------------------------------------------------------
# planning


def plan(p):
    """Map each ``(batch_index, i0, i1)`` query block to the key ranges it must visit.

    A block visits the keys that any of its rows may see (window and causal band, keys below
    ``kv_lengths``), normally as one range. When there are fewer blocks than cores (a few
    queries scored against a long sequence, say), the range is split into whole-tile parts,
    run as separate tasks and merged (see merge.py). The split counts the cores, not the
    call's ``workers``, so that ``workers`` changes the speed and never the rounding.
    """
    block_q, block_k = blocks(p.acc_dtype)
    block_q = min(block_q, max(p.lq, 1))
    q_blocks = [(i0, min(i0 + block_q, p.lq)) for i0 in range(0, p.lq, block_q)]
    n_blocks = p.nbatch * len(q_blocks)
    splits = max(1, workers() // n_blocks) if n_blocks else 1
    plan = {}
    for b in np.ndindex(*p.batch_shape):
        for i0, i1 in q_blocks:
            j0, j1 = key_range(p, b, i0, i1)
            n_tiles = math.ceil((j1 - j0) / block_k)
            if splits == 1 or n_tiles < 2:
                plan[b, i0, i1] = [(j0, j1)]
                continue
            step = math.ceil(n_tiles / min(splits, n_tiles)) * block_k
            plan[b, i0, i1] = [(a, min(a + step, j1)) for a in range(j0, j1, step)]
    return plan


def stack_plan(p):
    """The tasks of a batch run as stacks of elements, ``[(batch elements, i0, i1, j0, j1),
    ...]`` (the elements an :class:`.cpu_runtime.ElementRun`): the queries ``[i0, i1)`` of
    each of the (consecutive) elements over keys ``[j0, j1)``; or None where :func:`plan`
    applies.

    A task of one element and query block spends time in Python around its compiled walk:
    measured at L = 256, keys in one tile, about 100 us of each 280 us task; and after the
    walk's tiles have filled the caches, the Python after it runs from cold caches (about
    150 us of each 1.3 ms task of a 512 x 1024 tile on machine C). So where every query of
    an element fits one block (:func:`stack_limit`), the batch runs as stacks of consecutive
    elements (in the C order of the batch shape); and where the queries are longer and the
    compiled walk applies (:func:`_block_spans`), each query block of the elements does.
    Each stack is one compiled call or one batched product per step (:func:`attend_stacked`),
    at most :func:`stack_limit`'s elements, in a multiple of the cores' count of stacks
    (:func:`.cpu_runtime.stacks_of`).
    """
    if p.nbatch < 2:
        return None
    limit = stack_limit(p)
    found = ((limit[2], [(0, p.lq, limit[0], limit[1])]) if limit is not None
             else _block_spans(p))
    if found is None:
        return None
    most, spans = found
    scores = p.nbatch * sum((i1 - i0) * (j1 - j0) for i0, i1, j0, j1 in spans)
    runs = stacks_of(p.nbatch, most, cores_for(scores, p.d + p.dv))
    if min(z - a for a, z in runs) < 2:  # one element a stack: the general path, band spans
        return None
    return [(ElementRun(p.batch_shape, a, z), i0, i1, j0, j1) for i0, i1, j0, j1 in spans
            for a, z in runs]


def _block_spans(p):
    """``(most, [(i0, i1, j0, j1), ...])`` for :func:`stack_plan` where the queries pass one
    block: the most elements a stack may hold (its outputs and at most a copy of its queries
    within ``SLICE_BYTES``, as :func:`stack_limit` counts them), and each query block with the
    keys its rows see (a block whose rows see no key is left out: 0 and -inf as allocated).
    None where the compiled walk does not apply (the logits of :func:`walk_score`, keys and
    values CBLAS reads in place) or where ``kv_lengths`` gives the elements different key ranges."""
    acc_t = p.acc_dtype
    block_q = blocks(acc_t)[0]
    if (p.lq <= block_q or p.kv_lengths is not None or not walk_score(p)
            or tile_kernel(acc_t) is None):
        return None
    first = (0,) * len(p.batch_shape)
    if _stack_walk(p, first) is None:
        return None
    most = SLICE_BYTES // max(block_q * (p.d + p.dv) * acc_t.itemsize, 1)
    spans = [(i0, min(i0 + block_q, p.lq)) for i0 in range(0, p.lq, block_q)]
    spans = [(i0, i1, *key_range(p, first, i0, i1)) for i0, i1 in spans]
    return most, [(i0, i1, j0, j1) for i0, i1, j0, j1 in spans if j1 > j0]


def stack_limit(p):
    """``(j0, j1, most)`` where the batch elements of ``p`` may run as stacks
    (:func:`attend_stacked`): the keys ``[j0, j1)`` every element's queries see, and the most
    elements one stack may hold: as many as keep the stack's copies within ``SLICE_BYTES`` (a
    head dimension in the millions, broadcast from a few numbers, is multiplied in slices by
    the general path instead). The compiled walk (:func:`_stack_walk`) holds the outputs and
    at most a copy of the queries, reading keys and values in place through one score tile;
    without it the stack also copies its keys and values, and where they fit one tile it
    takes no more elements than fill one score tile, the batched products' tile. None where
    they may not: any array option but the window band or a soft cap, queries past one block.
    """
    if (p.lq == 0 or not walk_score(p) or p.kv_lengths is not None
            or tile_kernel(p.acc_dtype) is None):
        return None
    block_q, block_k = blocks(p.acc_dtype)
    j0, j1 = key_range(p, (0,) * len(p.batch_shape), 0, p.lq)
    if p.lq > block_q or j1 == j0:
        return None
    compiled = _stack_walk(p, (0,) * len(p.batch_shape)) is not None
    if not compiled and not plain_score(p):      # the batched products take no ALiBi term
        return None
    copies = p.lq * (p.d + p.dv) if compiled else p.lq * p.d + (j1 - j0) * (p.d + p.dv)
    most = SLICE_BYTES // max(copies * p.acc_dtype.itemsize, 1)
    if not compiled and j1 - j0 <= key_tile(p.lq, block_q, block_k):
        most = min(most, block_q * block_k // (p.lq * (j1 - j0)))
    return j0, j1, most


def attend_stacked(p, elements, i0, i1, j0, j1, out=None):
    """Normalised ``(out, lse)`` in the accumulation dtype, shapes ``(G, n, Dv)`` and
    ``(G, n)``, of the queries ``[i0, i1)`` (``n`` of them) of the batch ``elements`` (G of
    them) over keys ``[j0, j1)``; ``out``: an array of that shape and dtype, C-ordered (its
    values are not read), for the compiled walk to write the outputs into (then returned):
    :func:`_attend`'s steps on the stack. Where :func:`stack_walks` finds the compiled walk,
    it runs the elements in one call (each element's scaled queries, tiles, products, tile
    kernel and normalisation those of a task of its own, so the same bits, and no GIL held);
    else, keys in one tile, each product is one batched call (BLAS per element, the same
    products as :func:`_attend`'s Python loop), and keys past one tile, :func:`_attend` per
    element. An element whose output is not finite is redone by :func:`_attend` (its careful
    path keeps NaN in the rows that see it)."""
    acc_t = p.acc_dtype
    m = np.full((len(elements), i1 - i0), -np.inf, dtype=acc_t)
    l = np.zeros((len(elements), i1 - i0), dtype=acc_t)
    walked = _compiled_walks(p, elements, i0, i1, j0, j1, m, l, out)
    if walked is None:
        return _stacked_products(p, elements, i0, i1, j0, j1)
    o, finite = walked
    return _redone(p, elements, i0, i1, j0, j1, o, _lse(m, l, acc_t), finite)


def _stacked_products(p, elements, i0, i1, j0, j1):
    """:func:`attend_stacked` where the compiled walk does not apply."""
    acc_t = p.acc_dtype
    g, n, w = len(elements), i1 - i0, j1 - j0
    m = np.full((g, n), -np.inf, dtype=acc_t)
    l = np.zeros((g, n), dtype=acc_t)
    if w > key_tile(n, *blocks(acc_t)):
        # keys past one tile and no compiled walk: each element as a task of its own runs it
        outs, lses = zip(*(_attend(p, b, i0, i1, j0, j1) for b in elements))
        return np.stack(outs), np.stack(lses)
    else:
        queries = np.stack([blas_ready(p.q[b][i0:i1], acc_t)
                            for b in elements]) * acc_t.type(p.scale)
        keys = np.stack([blas_ready(p.k[b][j0:j1], acc_t) for b in elements])
        values = np.stack([blas_ready(p.v[b][j0:j1], acc_t) for b in elements])
        s = product(queries, keys.transpose(0, 2, 1))
        lo, hi = band_columns(query_diagonals(p, i0, i1), *p.window, j0, w)
        # one tile: no output to rescale yet, so the kernel gets a zero-width one
        tile_kernel(acc_t)(s.reshape(g * n, w), m.reshape(g * n), l.reshape(g * n),
                           np.empty((g * n, 0), dtype=acc_t), np.tile(lo, g), np.tile(hi, g))
        o = product(s, values)
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(o).all(axis=(1, 2))
        o, lse = _normalised(m, l, o, acc_t)
    return _redone(p, elements, i0, i1, j0, j1, o, lse, finite)


def _redone(p, elements, i0, i1, j0, j1, o, lse, finite):
    """``(o, lse)`` with each element whose output was not ``finite`` redone by
    :func:`_attend` (its careful path keeps NaN in the rows that see it); ``o`` and ``lse``
    may be views of the results, written through."""
    for i in np.flatnonzero(~finite):
        o[i], lse[i] = _attend(p, elements[i], i0, i1, j0, j1)
    return o, lse


def _compiled_walks(p, elements, i0, i1, j0, j1, m, l, out=None):
    """``(o, finite)`` of the queries ``[i0, i1)`` of each of the batch ``elements`` after
    their walks over keys ``[j0, j1)``, in one compiled call (:class:`StackWalks`): the
    normalised outputs ``(G, i1 - i0, Dv)`` (in ``out`` where given: C-ordered, of the
    accumulation dtype, its values not read), and whether each element's output was finite
    before (the others are for the caller to redo); ``m`` and ``l`` updated in place. None
    (nothing done) where the compiled walk does not apply: the logits of :func:`walk_score`
    (the plain score, ALiBi's term added in the walk) of a stack of whole elements
    (:func:`attend_stacked`) or of one query block (:func:`_compiled_walk`)."""
    walks = stack_walks(p, i0, i1, j0, j1)
    if walks is None:
        return None
    finite = np.empty(len(elements), dtype=np.bool_)
    return walks.call(elements, m, l, finite, out)(), finite


def stack_walks(p, i0, i1, j0, j1):
    """The :class:`StackWalks` of the queries ``[i0, i1)`` over the keys ``[j0, j1)`` of
    ``p``'s batch elements, or None where the compiled walk does not apply
    (:func:`_stack_walk`: every element a view with the same strides, so the first tells)."""
    found = _stack_walk(p, (0,) * len(p.batch_shape))
    return None if found is None else StackWalks(p, i0, i1, j0, j1, found)


class StackWalks:
    """The compiled walk (:func:`._task_kernels.forward_stack`) of the queries ``[i0, i1)``
    over the keys ``[j0, j1)`` of stacks of ``p``'s batch elements (``found``: the library and
    kernel :func:`_stack_walk` gives; made by :func:`stack_walks`): what the stacks share (the
    kernel and its library, the window band, the tile width, the row groups, the operands'
    row steps) made once, and each stack's call by :meth:`call`.

    The kernel reads each element's queries in place where CBLAS could (rows of the
    accumulation dtype), else from one stacked copy in it (made when the call runs), and
    scales them itself."""

    def __init__(self, p, i0, i1, j0, j1, found):
        self.p, self.i0, self.i1, self.j0, self.j1 = p, i0, i1, j0, j1
        acc_t = p.acc_dtype
        self.blas, self.kernel = found
        size = acc_t.itemsize
        rows = p.q[(0,) * len(p.batch_shape)][i0:i1]    # every element's: the same strides
        self.in_place = p.q.flags.aligned and self.blas.reads_rows(rows, acc_t)
        self.q_row, self.ldq = i0 * rows.strides[0], rows.strides[0] // size
        self.ldk, self.ldv = p.k.strides[-2] // size, p.v.strides[-2] // size
        self.width = key_tile(i1 - i0, *blocks(acc_t))
        self.span_rows = group_rows(i1 - i0, SPAN_ROWS)
        self.lo, self.hi = band_columns(query_diagonals(p, i0, i1), *p.window, 0, j1)
        self.batch = None   # every batch element's (q, k, v) addresses, for runs of them

    def _addresses(self, elements):
        """The addresses of the ``elements``' queries (their row 0), keys and values: for a
        run of the batch whose axes merge, slices of the whole batch's, made once."""
        p = self.p
        if isinstance(elements, ElementRun) and elements.shape == p.batch_shape:
            if self.batch is None:
                whole = ElementRun(p.batch_shape, 0, p.nbatch)
                self.batch = [whole.addresses(x) for x in (p.q, p.k, p.v)]
            if all(a is not None for a in self.batch):
                return [a[elements.start:elements.stop] for a in self.batch]
        return [batch_addresses(x, elements) for x in (p.q, p.k, p.v)]

    def call(self, elements, m, l, finite, out=None):
        """The call of the stack of batch ``elements`` (G of them), made and not run:
        ``run``; ``run()`` runs it and returns the normalised outputs ``(G, i1 - i0, Dv)``
        (in ``out`` where given: C-ordered, of the accumulation dtype, its values not read).
        ``m``, ``l`` ((G, n), C-ordered; -inf and 0 in) are updated in place, and ``finite``
        ((G,)) set to whether each element's output was finite before its division (the
        others are for the caller to redo). What it makes is small (addresses, the slopes);
        the output (unless ``out``) and the score tile are allocated when it runs, so that a
        call's stacks, made together, hold no more than the threads running them."""
        p, acc_t = self.p, self.p.acc_dtype
        g, n, d, i0, i1 = len(elements), self.i1 - self.i0, p.d, self.i0, self.i1
        j0, j1, width, in_place = self.j0, self.j1, self.width, self.in_place
        qs, ks, vs = self._addresses(elements)
        queries = (qs + self.q_row, self.ldq)
        keys, values = (ks, self.ldk), (vs, self.ldv)
        band, slopes, stack = (self.lo, self.hi), element_slopes(p, elements), self.kernel
        scale, gemm, wide = acc_t.type(p.scale), self.blas.address(acc_t), self.blas.wide
        span_rows = self.span_rows

        def run():
            if in_place:
                q, ldq = queries
            else:                   # read through its addresses: `copy` lives until the end
                copy = np.stack([p.q[b][i0:i1] for b in elements], dtype=acc_t)
                q, ldq = copy.ctypes.data + np.arange(g, dtype=np.int64) * copy.strides[0], d
            o = np.empty((g, n, p.dv), dtype=acc_t) if out is None else out
            scores = np.empty(n * min(width, j1 - j0), dtype=acc_t)     # the widest tile's
            stack(q, ldq, scale, np.empty((n, d), dtype=acc_t), *keys, *values, m, l, o,
                  finite, scores, j0, j1, width, *band, span_rows, gemm, wide, slopes,
                  i0 + p.diagonal_offset)
            return o

        return run


def element_slopes(p, elements):
    """The ALiBi slopes of the batch ``elements``, in the accumulation dtype; empty without
    the term."""
    if p.alibi_slopes is None:
        return np.empty(0, dtype=p.acc_dtype)
    view = elements.view(p.alibi_slopes, 0) if isinstance(elements, ElementRun) else None
    if view is not None:
        return view
    index = tuple(batch_index(elements).T)
    return p.alibi_slopes[index].reshape(len(elements))               # () batch: one slope


def _stack_walk(p, element):
    """``(library, kernel)`` of the compiled walk of a stack (:func:`._task_kernels.forward_stack`)
    of ``p``'s batch elements, or None where it does not apply. Every element is a view of one
    array with the same strides, so ``element``'s keys and values tell for all; the scaled
    queries, in a C-ordered scratch of the accumulation dtype with the keys' head dimension,
    are read wherever the keys are."""
    if not (p.k.flags.aligned and p.v.flags.aligned):
        return None
    return compiled_task(p.acc_dtype, "forward_stack", (p.k[element], p.v[element]))


def plain_score(p):
    """True when the logits are ``scale * q . k`` under the window band alone: no soft cap and
    no array option but ``kv_lengths`` (which only shortens the key range)."""
    return _score_without(p, ("kv_lengths",))


def walk_score(p):
    """True when the forward's compiled walk (:func:`._task_kernels.forward_walk`) takes the
    logits: :func:`plain_score`'s, or those plus ALiBi's term."""
    return _score_without(p, ("kv_lengths", "alibi_slopes"))


def _score_without(p, allowed):
    return p.softcap is None and all(getattr(p, name, None) is None
                                     for name in _options.array_options()
                                     if name not in allowed)


def key_range(p, b, i0, i1):
    """Keys ``[j0, j1)`` that any of the queries ``[i0, i1)`` of batch element ``b`` may see:
    the window and causal band, and never a key at or past ``kv_lengths``."""
    j0, j1 = _semantics.visible_key_range(i0, i1, p.lq, p.lk, p.window, p.diagonal_offset)
    kv_len = p.lk if p.kv_lengths is None else int(p.kv_lengths[b])
    return j0, max(j0, min(j1, kv_len))


# --------------------------------------------------------------------------------------------
# one task


def attend(p, b, i0, i1, j_lo, j_hi):
    """One task of :func:`attention` for drivers that make their own task list (the packed
    batches of :mod:`.numpy_varlen`): normalised ``(out, lse)`` in the accumulation dtype of
    queries ``[i0, i1)`` of batch element ``b`` over keys ``[j_lo, j_hi)``."""
    return _attend(p, b, i0, i1, j_lo, j_hi)


def _attend(p, b, i0, i1, j_lo, j_hi):
    """Normalised ``(out, lse)`` in the accumulation dtype for queries ``[i0, i1)`` of batch
    element ``b`` over keys ``[j_lo, j_hi)``."""
    acc_t = p.acc_dtype
    # Plain products first: a NaN or inf that reaches a product stays in the unnormalised
    # output (a sum, rescaled by factors <= 1, never cancels it), so one check of the (n, Dv)
    # result stands for a check of every tile's product. Only then is the task redone with the
    # per-tile path where a non-finite value reaches only the rows that see it.
    walked = _compiled_walk(p, b, i0, i1, j_lo, j_hi)
    if walked is not None:
        o, lse, finite = walked
        if finite:
            return o, lse
    else:
        m, l, o = _online(p, b, i0, i1, j_lo, j_hi, careful=False)
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(o).all()
        if finite:
            return _normalised(m, l, o, acc_t)
    m, l, o = _online(p, b, i0, i1, j_lo, j_hi, careful=True)
    return _normalised(m, l, o, acc_t)


def _compiled_walk(p, b, i0, i1, j_lo, j_hi):
    """``(out, lse, finite)`` of queries ``[i0, i1)`` of batch element ``b`` over keys
    ``[j_lo, j_hi)`` as one compiled call (:func:`_compiled_walks` of the one element): the
    scaling, the walk and the normalisation with no Python between them; ``finite`` False
    when the output was not (the caller redoes the block by the careful path). None (nothing
    done) where the compiled walk does not apply."""
    acc_t = p.acc_dtype
    if (not walk_score(p) or tile_kernel(acc_t) is None
            or copy_is_large(p.q[b][i0:i1], acc_t)):
        return None
    n = i1 - i0
    m = np.full((1, n), -np.inf, dtype=acc_t)
    l = np.zeros((1, n), dtype=acc_t)
    walked = _compiled_walks(p, [b], i0, i1, j_lo, j_hi, m, l)
    if walked is None:
        return None
    o, finite = walked
    return o[0], _lse(m[0], l[0], acc_t), bool(finite[0])


def _normalised(m, l, o, acc_t):
    """``(o / l, m + log(l))`` of online-softmax states (any leading shape; ``o`` divided in
    place): 0 and ``-inf`` for a row that sees no key, NaN for a row whose sum is NaN."""
    seen = l > 0
    if seen.all():                    # every row saw a key (and no sum is NaN): one pass
        o /= l[..., None]
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(o, l[..., None], out=o, where=seen[..., None])
            o[~seen] = 0
            o[np.isnan(l)] = np.nan
    return o, _lse(m, l, acc_t)


def _lse(m, l, acc_t):
    """``m + log(l)`` in ``acc_t``: ``-inf`` for a row that sees no key (``l`` 0), NaN for a
    NaN sum; the compiled stacks divide their outputs themselves and take only this."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (m + np.log(l)).astype(acc_t, copy=False)


def _online(p, b, i0, i1, j_lo, j_hi, careful):
    """The online-softmax state ``(m, l, o)`` after keys ``[j_lo, j_hi)``, by the Python loop
    over the tiles (every score term; the compiled walk, :func:`_compiled_walk`, takes the
    plain score); ``careful``: each tile's P·V through :func:`visible_product` (else a plain
    product)."""
    acc_t = p.acc_dtype
    n = i1 - i0
    # Scores and the running max stay in natural units: any finite score is representable,
    # whereas folding log2(e) in would overflow scores above max / 1.44. Only s - m <= 0 is
    # exponentiated (np.exp: twice as fast as np.exp2 for float32, measured).
    pipeline = ScorePipeline(p, b, i0, i1)
    v = p.v[b]
    m = np.full(n, -np.inf, dtype=acc_t)
    l = np.zeros(n, dtype=acc_t)
    o = np.zeros((n, p.dv), dtype=acc_t)
    kernel = tile_kernel(acc_t)
    width = key_tile(n, *blocks(acc_t))
    for js in range(j_lo, j_hi, width):
        je = min(js + width, j_hi)
        # a tile the window band crosses (the diagonal tile of causal attention): both
        # products over the columns each group of rows may see, not over the whole tile
        spans = None if careful else pipeline.row_spans(js, width, je - js,
                                                        group_rows(n, SPAN_ROWS))
        # the kernel takes the window band from lo and hi, with no pass over the tile
        s = pipeline.logits(js, je, window=kernel is None, spans=spans)
        # rescale running state; s becomes p = exp(s - m)
        if kernel is not None:
            kernel(s, m, l, o, *pipeline.window_columns(js, width))  # m, l, o in place
        else:
            m = _softmax_tile_ufuncs(s, m, l, o)
        # accumulate P·V: values at keys a row cannot see must not reach it (0 * NaN)
        vt = blas_ready(v[js:je], acc_t)
        if careful:
            visible_product(s, vt, lambda js=js, je=je: pipeline.visible(js, je), add_to=o)
        elif spans is None:
            product(s, vt, o, add=True)
        else:
            for r0, r1, c0, c1 in spans:
                product(s[r0:r1, c0:c1], vt[c0:c1], o[r0:r1], add=True)
    return m, l, o


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

