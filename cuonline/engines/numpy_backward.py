"""The NumPy engine's backward pass: the FlashAttention-2 backward, tiled, deterministic.

For one batch element with logits ``s`` (every score term of the forward, then masking),
``P = exp(s - lse)`` is recomputed tile by tile from the forward's ``lse``, and with
``Delta_i = rowsum(dO_i * O_i)`` (the Delta trick: ``sum_j P_ij dP_ij = dO_i . O_i``)

    dV  += P^T dO          dP = dO V^T          dS = P * (dP - Delta)

``dS`` is the gradient of the logit; through the soft cap's derivative ``1 - tanh^2`` it
becomes the gradient of the capped part (the content score, or the whole logit with
``softcap_bias``). The bias terms take their part of it (summed over each block, along each
clamped diagonal), the content part gives ``dQ += dS K`` and ``dK += dS^T Q`` (times
``scale``) and the relative-logit gradients.

Work: the batch elements are cut into groups that share no gradient slot (an input broadcast
over batch elements joins them: a bias shared by every head makes one group of all heads), and
each group is one task on the CPU engines' thread pool (:mod:`.cpu_runtime`). A task walks its
batch elements in C order, their keys in blocks of ``BLOCK_K`` and, inside each, the queries
that may see them in tiles of ``BLOCK_Q`` (both sized from the machine's L2, see
:func:`blocks`), adding each tile's part straight into the gradients. A batch of short
sequences runs as stacks of groups instead, each stack one compiled call (:func:`_stacks`).
Each tile's logits come from the forward's score pipeline (:mod:`.numpy_scores`), so that
``exp(s - lse)`` is the forward's ``P``; each row's sum of it tells an ``lse`` of other inputs
(:mod:`cuonline._lse_check`). No gradient slot is
written by two tasks, and within a task the order of every sum is fixed, so the results are
bitwise identical for every ``workers`` and every run. Extra memory is a few tiles and one copy
of a batch element's queries and output gradient per task (a stack's, of its elements' queries,
output gradients and outputs: at most ``SLICE_BYTES``): never an ``Lq x Lk`` array.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .. import _lse_check, _semantics
from .._gradients import Gradients, gradients_of
from .cpu_blas import batch_addresses, batch_index, compiled_task, product
from .cpu_runtime import (ElementRun, cache_sizes, cores_for, run_tasks, score_tile, stacks_of,
                          tile_kernel, workers)
from .numpy import element_slopes, walk_score
from .numpy_scores import (SLICE_BYTES, ScorePipeline, band_columns, blas_ready,
                           group_rows, query_diagonals, skewed, spanned_product,
                           visible_product)

if TYPE_CHECKING:
    from .._validate import BackwardProblem

# The float32 tile shape from this machine's L2 (cpu_runtime.score_tile with two live tiles, P
# and dS, so that both stay in L2 while the five matrix products stream through them: 512 x 256
# on a 1 MiB L2); other dtypes take theirs from blocks() (256 x 256 float64). Set to other
# values, BLOCK_Q and BLOCK_K fix the shape for every dtype (tests do).
BLOCK_Q, BLOCK_K = score_tile(cache_sizes()["L2"], 4, live_tiles=2)
_MACHINE_TILE = (BLOCK_Q, BLOCK_K)


# The most rows per group of a tile the window band crosses (as the forward's SPAN_ROWS).
SPAN_ROWS = 128


def blocks(dtype):
    """``(BLOCK_Q, BLOCK_K)``: query rows and keys per tile for gradients of ``dtype``."""
    rows, keys = score_tile(cache_sizes()["L2"], np.dtype(dtype).itemsize, live_tiles=2)
    return (rows if BLOCK_Q == _MACHINE_TILE[0] else BLOCK_Q,
            keys if BLOCK_K == _MACHINE_TILE[1] else BLOCK_K)


def attention_backward(bp: BackwardProblem) -> Gradients:
    """Gradients of the backward problem ``bp`` (a :class:`cuonline._validate.BackwardProblem`).

    Returns a :class:`cuonline.Gradients` of NumPy arrays, each of the shape and dtype that
    ``bp.targets`` gives for its input.
    """
    p = bp.forward
    acc = p.acc_dtype
    targets = bp.targets
    n_workers = workers() if p.workers is None else p.workers
    tasks = _plan(p, targets)
    # stacks of elements with slots of their own zero them as they come (_compiled_stack):
    # the gradients of q, k and v, the only ones a stack takes
    zeroed = not (set(targets) == {"q", "k", "v"} and _own_slots(p.batch_shape, targets)
                  and all(part == "stack" for _, part, _, _ in tasks))
    buffers = _gradient_buffers({name: t.padded(len(p.batch_shape))
                                 for name, t in targets.items()}, acc, zeroed)
    # each row's sum of P and, for rows given lse = -inf, whether the row sees a key: written
    # by the one task that owns the row's dQ (disjoint rows), checked once all are done
    sums = RowSums(p)
    run_tasks(tasks, lambda task: _run_task(bp, task, buffers, sums), n_workers,
              cost=lambda task: _task_area(p, task))
    sums.check(bp)
    # dQ and dK were summed without the scale (it is folded into the scaled queries for dK)
    buffers["q"] *= acc.type(p.scale)
    grads = {name: targets[name].finish(buffers[name]) for name in targets}
    return gradients_of(grads)


def _gradient_buffers(shapes, dtype, zeroed=True):
    """``{name: zeros of shape}`` as views of one allocation, each a multiple of 64 bytes
    from its start (``zeroed`` False: left as the allocator gives them, for callers that
    zero each slot before adding into it; 6 MB of zeros took 0.24 ms on machine C).

    Gradient buffers of a few MB each, allocated one by one, come from fresh pages where the
    C library's allocator maps them anew (it returns blocks above its threshold to the
    system on release): each 4 KiB page then faults on its first write, inside the
    products of the walk, and two threads faulting at once contend in the kernel. Measured
    on machine C (N 128, H 64, float32): 3260 faults and 23-28 ms a call on two threads,
    against 6 ms where the allocator happened to reuse its memory. One allocation past 4 MiB
    is one NumPy asks the kernel to back with huge pages (where the kernel does so): a few
    faults."""
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    step = max(1, 64 // dtype.itemsize)
    offsets, total = {}, 0
    for name, size in sizes.items():
        offsets[name] = total
        total += -(-size // step) * step
    block = (np.zeros if zeroed else np.empty)(total, dtype=dtype)
    return {name: block[offsets[name]:offsets[name] + sizes[name]].reshape(shapes[name])
            for name in shapes}


def _own_slots(batch_shape, targets):
    """Whether every batch element has a gradient slot of its own in every target (no input
    broadcast along a batch axis)."""
    nb = len(batch_shape)
    return all(t.padded(nb)[:nb] == tuple(batch_shape) for t in targets.values())


def _run_task(bp, task, buffers, sums):
    """Add one task's gradients (a task of :func:`_plan`) into ``buffers``."""
    elements, part, key_block, query_block = task
    done = skip = 0
    if part == "stack":
        (done, skip), part = _compiled_stack(bp, elements, buffers, sums), "all"
    for b in elements[done:]:
        _one_batch_element(bp, b, buffers, sums, part, key_block, query_block, skip)
        skip = 0


def _plan(p, targets):
    """The tasks: ``(batch elements, part, key block, query block)``.

    With at least as many groups (:func:`_groups`) as cores, a task is one group, all of it
    (``part`` "all": the five products of each tile once), or, for a batch of short sequences,
    a stack of groups (``part`` "stack", see :func:`_stacks`). With fewer, the work is cut finer
    in two kinds of task that write disjoint gradients: "kv" tasks, one per group of elements
    sharing ``k``/``v`` and block of ``BLOCK_K`` keys, give dK and dV; "q" tasks, one per
    group of the others and block of ``BLOCK_Q`` queries (all queries when a bias-like
    gradient of one task would overlap another's: a broadcast row, a block or distance table),
    give dQ and the bias-like gradients. Each tile's scores and dS are then computed twice
    (seven products instead of five), in the same order and tiles as the single-task form,
    so every plan gives the same bits; the plan counts the cores, never ``workers``.
    """
    groups = _groups(p.batch_shape, targets)
    block_q, block_k = blocks(p.acc_dtype)
    n_tiles = -(-p.lq // block_q) * -(-p.lk // block_k)
    if len(groups) >= workers() or n_tiles < 2:
        stacks = _stacks(p, groups)
        if stacks is not None:
            return [(elements, "stack", None, None) for elements in stacks]
        return [(g, "all", None, None) for g in groups]
    tasks = []
    kv = {n: targets[n] for n in ("k", "v")}
    for g in _groups(p.batch_shape, kv):
        tasks += [(g, "kv", j0, None) for j0 in range(0, p.lk, block_k)]
    others = {n: t for n, t in targets.items() if n not in kv}
    padded = {n: t.padded(len(p.batch_shape)) for n, t in others.items()}
    # a query block's bias-like gradients are its own rows only for a full-row bias
    split_rows = (p.rel_bias is None and p.rel_q is None and p.bias_block is None
                  and (p.bias is None or padded["bias"][-2] == p.lq))
    for g in _groups(p.batch_shape, others):
        if split_rows:
            tasks += [(g, "q", None, i0) for i0 in range(0, p.lq, block_q)]
        else:
            tasks.append((g, "q", None, None))
    return tasks


def _stacks(p, groups):
    """The groups joined into stacks of consecutive groups (each stack's elements in the
    groups' order: the order of their sums), or None where a task per group is as good.

    A batch element of a short sequence is a few tiles of five small products each, and a
    task per element spends as long in Python around them as in them (at L = 128, one tile:
    68 us of each 162 us). A stack runs its elements' tiles in one compiled call
    (:func:`._task_kernels.backward_stack`); there are as many stacks as cores, or a
    multiple of that where a stack would pass :func:`stack_limit`
    (:func:`.cpu_runtime.stacks_of`).
    """
    most = stack_limit(p) if p.nbatch >= 2 else 0
    if most < 2:
        return None
    runs = stacks_of(p.nbatch, most, cores_for(p.nbatch * p.lq * p.lk, 2 * p.d + 3 * p.dv))
    if p.nbatch < 2 * len(runs):
        return None
    if len(groups) == p.nbatch:
        # every group one element (no gradient slot shared): the runs themselves
        return [ElementRun(p.batch_shape, a, z) for a, z in runs]
    # whole groups, a new stack once the last one has reached the end of its run
    stacks, filled = [], 0
    for g in groups:
        if not stacks or filled >= runs[len(stacks) - 1][1]:
            stacks.append([])
        stacks[-1] += g
        filled += len(g)
    return stacks


def stack_limit(p):
    """The most batch elements of ``p`` one stack (:func:`stacked_gradients`) may hold: the
    plain score (or it with ALiBi's term) over every key (no ``kv_lengths``), the stacked
    copies of the elements' queries, output gradients and outputs within ``SLICE_BYTES`` (at
    most 5 elements of N 1024, D 64 in float32; none of N 4096, whose elements are long
    enough alone); 0 where the elements may not run as stacks."""
    if (not walk_score(p) or p.kv_lengths is not None or p.lq == 0
            or tile_kernel(p.acc_dtype, "backward_stack") is None):
        return 0
    return SLICE_BYTES // max(p.lq * (p.d + 2 * p.dv) * p.acc_dtype.itemsize, 1)


def stacked_gradients(bp, elements, buffers, sums):
    """Add the gradients of the batch ``elements`` (at most :func:`stack_limit`'s, in C order;
    no other task may write their gradient slots) into ``buffers`` and their rows' sums of
    ``P`` into ``sums``, in one compiled call where it applies (:func:`_compiled_stack`), else
    one by one: for drivers that make their own task list (the packed batches of
    :mod:`.numpy_varlen`)."""
    _run_task(bp, (elements, "stack" if stack_limit(bp.forward) else "all", None, None),
              buffers, sums)


def _span_rows(p):
    """Rows per group of the tiles the window band crosses (``numpy_scores.group_rows`` of a
    whole tile's rows), the same for every tile of ``p`` and every path: the compiled blocks,
    the compiled stacks and the Python loop take the same groups, so the same bits."""
    return group_rows(min(blocks(p.acc_dtype)[0], p.lq), SPAN_ROWS)


def _block_tiles(p, j0, j1, query_block=None):
    """``[(i0, i1, js, je), ...]``: the query tiles that see a key of the block ``[j0, j1)``
    (only the one from ``query_block``, unless None) and the keys ``[js, je)`` of the block
    that any of their rows may see."""
    block_q = blocks(p.acc_dtype)[0]
    r0, r1 = _visible_query_range(j0, j1, p)
    tiles = []
    for i0 in range(r0 // block_q * block_q, r1, block_q):
        if query_block is not None and i0 != query_block:
            continue
        i1 = min(i0 + block_q, p.lq)
        a, z = _semantics.visible_key_range(i0, i1, p.lq, p.lk, p.window, p.diagonal_offset)
        js, je = max(a, j0), min(z, j1)
        if js < je:
            tiles.append((i0, i1, js, je))
    return tiles


def _task_area(p, task):
    """The score places a task of :func:`_plan` visits (its elements times the places of its
    key or query block the window band leaves visible): the pool starts the largest first."""
    group, part, j0, i0 = task
    block_q, block_k = blocks(p.acc_dtype)
    if part == "q" and i0 is not None:
        rows = [(i0, min(i0 + block_q, p.lq))]
    else:
        rows = [(a, min(a + block_q, p.lq)) for a in range(0, p.lq, block_q)]
    keys = (0, p.lk) if part != "kv" else (j0, min(j0 + block_k, p.lk))
    area = 0
    for a, z in rows:
        lo, hi = _semantics.visible_key_range(a, z, p.lq, p.lk, p.window, p.diagonal_offset)
        area += (z - a) * max(0, min(hi, keys[1]) - max(lo, keys[0]))
    return len(group) * area


def _groups(batch_shape, targets):
    """The batch elements cut into the finest groups such that the batch elements adding into
    one gradient slot (of any input) share a group; each group in C order, the groups in the
    C order of their first element. The plan depends on the problem only, never on the
    thread count."""
    elements = list(np.ndindex(*batch_shape))
    if len(elements) < 2:
        return [elements] if elements else []
    if _own_slots(batch_shape, targets):
        return [[b] for b in elements]      # a slot of every gradient per element
    index = np.indices(batch_shape, dtype=np.intp).reshape(len(batch_shape), len(elements))
    slots = []                  # per input, the flat slot each element adds into
    for t in targets.values():
        lead = np.array(t.padded(len(batch_shape))[:len(batch_shape)], dtype=np.intp)
        slots.append(np.ravel_multi_index(np.where(lead[:, None] == 1, 0, index), lead))
    # each element's group: the first (smallest) element joined to it through shared slots,
    # found by passing the least label through every slot until nothing changes
    label = np.arange(len(elements))
    while True:
        joined = label
        for slot in slots:
            least = np.full(slot.max(initial=0) + 1, len(elements))
            np.minimum.at(least, slot, joined)
            joined = least[slot]
        if np.array_equal(joined, label):
            break
        label = joined
    groups = {}
    for n, first in enumerate(label.tolist()):
        groups.setdefault(first, []).append(elements[n])
    return [groups[r] for r in sorted(groups)]


def _visible_query_range(j0, j1, p):
    """Half-open query range ``[i0, i1)`` of the rows that may see a key of ``[j0, j1)``:
    row ``i`` sees key ``j`` only if ``-left <= j - (i + diag) <= right``."""
    left, right = p.window
    diag = p.diagonal_offset
    i0 = 0 if right is None else max(0, j0 - diag - right)
    i1 = p.lq if left is None else min(p.lq, j1 - 1 - diag + left + 1)
    return i0, max(i0, i1)


class _Element:
    """The per-batch-element data of one task: queries, output gradient, lse, Delta and the
    score pipeline of each query tile."""

    def __init__(self, bp, b):
        p = bp.forward
        acc = p.acc_dtype
        self.b = b
        self.qs = blas_ready(p.q[b], acc) * acc.type(p.scale)       # (Lq, D), scaled
        self.do = np.ascontiguousarray(blas_ready(bp.dout[b], acc))   # (Lq, Dv)
        self.delta = _delta(self.do, np.ascontiguousarray(blas_ready(bp.out[b], acc)))
        # the right-hand operands of the products, checked once: finite ones take the plain
        # product (see visible_product)
        self.qs_finite = bool(np.isfinite(self.qs).all())
        self.do_finite = bool(np.isfinite(self.do).all())
        lse = np.array(bp.lse[b], dtype=acc)
        self.dead = lse == -np.inf
        # a row that sees no key (lse = -inf) gets P = exp(s - inf) = 0 everywhere, never
        # exp(-inf - (-inf)) = NaN
        lse[lse == -np.inf] = np.inf
        self.lse = lse
        self.k, self.v = p.k[b], p.v[b]
        self.kv_len = p.lk if p.kv_lengths is None else int(p.kv_lengths[b])
        self._pipelines = {}
        self._band = None
        # the compiled key blocks' case: the plain score (ALiBi's term added in the block),
        # every row seeing a key
        self.plain = walk_score(p) and not self.dead.any()

    def band(self, p):
        """``(lo, hi)``: row ``i`` may see the keys ``[lo[i], hi[i])`` by the window band."""
        if self._band is None:
            self._band = ScorePipeline(p, self.b, 0, p.lq, self.qs).window_columns(0, p.lk)
        return self._band

    def pipeline(self, p, i0, i1):
        """The score pipeline of queries ``[i0, i1)`` (built once per query tile)."""
        pipeline = self._pipelines.get(i0)
        if pipeline is None:
            pipeline = self._pipelines[i0] = ScorePipeline(p, self.b, i0, i1, self.qs[i0:i1])
        return pipeline


def _delta(do, out):
    """``Delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij`` of C-ordered ``(..., Lq, Dv)``
    arrays (each row summed as one contiguous run: the same bits stacked or not)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.einsum("...ij,...ij->...i", do, out)


class RowSums:
    """Each row's sum of ``P = exp(s - lse)`` over its keys, to tell an ``lse`` that belongs to
    other inputs (see :mod:`cuonline._lse_check`). ``sums`` and ``sees`` (``batch_shape +
    (lq,)``): arrays to add into (views of a larger problem's), or None for zeros of their own.
    """

    def __init__(self, p, sums=None, sees=None):
        shape = p.batch_shape + (p.lq,)
        self.sums = np.zeros(shape, dtype=p.acc_dtype) if sums is None else sums
        self.sees = np.zeros(shape, dtype=bool) if sees is None else sees
        self.ones = np.ones(blocks(p.acc_dtype)[1], dtype=p.acc_dtype)

    def check(self, bp):
        p = bp.forward
        lengths = None if p.kv_lengths is None else np.asarray(p.kv_lengths)
        n_keys = p.lk if lengths is None else lengths[..., None]
        terms = p.q.shape[-1] + (0 if p.rel_q is None else p.rel_q.shape[-1])
        def products():                 # only where a row is past the bound of R = 0
            return _lse_check.product_bound(np, p.q, p.k, p.scale, kv_lengths=lengths,
                                            rel_q=p.rel_q, rel_k=p.rel_k)

        _lse_check.check_row_sums(np, self.sums, np.broadcast_to(bp.lse, self.sums.shape),
                                  acc_dtype=p.acc_dtype, n_keys=n_keys, logit_terms=terms,
                                  products=products, sees_keys=self.sees)


def _one_batch_element(bp, b, buffers, sums, part="all", key_block=None, query_block=None,
                       skip=0):
    """Add batch element ``b``'s gradients into ``buffers`` (the padded gradient arrays):
    ``part`` "kv" (dK, dV), "q" (dQ and the bias-like terms) or "all", over the key block
    starting at ``key_block`` and the query block starting at ``query_block`` (None: all),
    leaving out its first ``skip`` tiles (in the order they are added: a compiled stack added
    them, and its next tile was not finite)."""
    p = bp.forward
    acc = p.acc_dtype
    e = _Element(bp, b)
    t = bp.targets
    slots = {name: t[name].slot(b) for name in t}
    dq, dk, dv = (buffers[n][slots[n]] for n in ("q", "k", "v"))     # (Lq, D), (Lk, D), (Lk, Dv)
    kv_part, q_part = part in ("all", "kv"), part in ("all", "q")
    block_k, span_rows = blocks(acc)[1], _span_rows(p)
    for j0 in range(0, e.kv_len, block_k):                 # keys past kv_lengths: never read
        if key_block is not None and j0 != key_block:
            continue
        j1 = min(j0 + block_k, e.kv_len)
        k_blk = blas_ready(e.k[j0:j1], acc)                           # (bk, D)
        v_blk = blas_ready(e.v[j0:j1], acc)                           # (bk, Dv)
        k_finite = bool(np.isfinite(k_blk).all())
        tiles = _block_tiles(p, j0, j1, query_block)
        done = min(skip, len(tiles))
        skip -= done
        if not done and e.do_finite and e.qs_finite and k_finite:
            done = _compiled_block(p, e, tiles, k_blk, v_blk, j0, (dq, dk, dv), sums,
                                   kv_part, q_part)
        for i0, i1, js, je in tiles[done:]:
            kt, vt = k_blk[js - j0:je - j0], v_blk[js - j0:je - j0]
            pipeline = e.pipeline(p, i0, i1)
            seen = _Visibility(pipeline, js, je, kt)
            # a tile the window band crosses (causal: the diagonal), with finite operands:
            # every product over the columns each group of rows may see
            spans = None
            if e.do_finite and e.qs_finite and k_finite:
                spans = pipeline.row_spans(js, je - js, je - js, span_rows)
            prob, ds, ds_content, row_sums = _tile(p, e, pipeline, i0, i1, js, je, kt, vt,
                                                   seen, spans)
            if q_part:                         # this task owns the rows' dQ: their sums too
                if row_sums is None:
                    row_sums = prob @ sums.ones[:je - js]          # BLAS: 4x np.sum's speed
                sums.sums[b][i0:i1] += row_sums
                if e.dead[i0:i1].any():
                    sums.sees[b][i0:i1] |= seen().any(axis=1)
            if kv_part and spans is not None:
                for r0, r1, c0, c1 in spans:
                    product(prob[r0:r1, c0:c1].T, e.do[i0 + r0:i0 + r1], dv[js + c0:js + c1],
                            add=True)
                    product(ds_content[r0:r1, c0:c1].T, e.qs[i0 + r0:i0 + r1],
                            dk[js + c0:js + c1], add=True)
            elif kv_part:
                # dV += P^T dO; dK += dS^T (scale Q)
                visible_product(prob.T, e.do[i0:i1], seen.transposed, e.do_finite,
                                add_to=dv[js:je])
                visible_product(ds_content.T, e.qs[i0:i1], seen.transposed, e.qs_finite,
                                add_to=dk[js:je])
            if q_part:
                _bias_gradients(p, pipeline, buffers, slots, ds, i0, js, je)
                _relative_logit_gradients(p, pipeline, buffers, slots, ds_content, i0, js,
                                          seen)
                # dQ += dS K (scaled later)
                if spans is None:
                    visible_product(ds_content, kt, seen, k_finite, add_to=dq[i0:i1])
                else:
                    for r0, r1, c0, c1 in spans:
                        product(ds_content[r0:r1, c0:c1], kt[c0:c1], dq[i0 + r0:i0 + r1],
                                add=True)


def _compiled_block(p, e, tiles, k_blk, v_blk, j0, grads, sums, kv_part, q_part):
    """The ``tiles`` of one key block (keys from ``j0``) in one compiled call
    (:func:`._task_kernels.backward_block`: the same products and tile kernel as the loop of
    :func:`_one_batch_element`, so the same bits), where it applies: the plain score (ALiBi's
    term too), every row seeing a key, operands and gradients whose rows CBLAS reads in place
    and a BLAS library loaded for CBLAS; the caller has checked that Q, dO and K are finite.
    Returns how many tiles it did (0: it did not apply; fewer than all: a tile's P or dS was
    not finite, and the caller's loop does the rest)."""
    acc = p.acc_dtype
    # backward_block compiles backward_tile within it
    found = (None if not tiles or not e.plain
             else compiled_task(acc, "backward_block", (e.qs, e.do, k_blk, v_blk) + grads))
    if found is None:
        return 0
    blas, kernel = found
    n = max(i1 - i0 for i0, i1, _, _ in tiles)
    w = max(je - js for _, _, js, je in tiles)
    lo, hi = e.band(p)

    def rows(x, first=0):         # the address of row 0 (of a block from row `first`)
        return [x.ctypes.data - first * x.strides[0], x.strides[0] // acc.itemsize]

    dq, dk, dv = grads
    return kernel(np.array(tiles, dtype=np.int64).reshape(-1, 4),
                  *rows(e.qs), *rows(e.do), *rows(k_blk, j0), *rows(v_blk, j0),
                  e.qs.shape[1], e.do.shape[1], *rows(dq), *rows(dk), *rows(dv),
                  e.lse, e.delta, sums.sums[e.b], lo, hi, np.empty(n * w, acc),
                  np.empty(n * w, acc), np.empty(n, acc), _span_rows(p), kv_part, q_part,
                  blas.address(acc), blas.wide, p.alibi_slopes is not None,
                  acc.type(0 if p.alibi_slopes is None else p.alibi_slopes[e.b]),
                  p.diagonal_offset)


def _compiled_stack(bp, elements, buffers, sums):
    """Add the gradients of the batch ``elements`` (a stack of :func:`_stacks`), in order, in
    one compiled call (:func:`._task_kernels.backward_stack`: each element's tile, products
    and tile kernel those of :func:`_compiled_block` for the element alone, so the same bits),
    where it applies: the rows CBLAS reads in place (the first element's tells for all: one
    array's views with the same strides). The kernel scales each element's queries itself
    and stops at the first element whose scaled queries, output gradient or keys are not all
    finite or whose row sees no key. Where every element has gradient slots of its own, the
    buffers need not come zeroed: each element's are zeroed as its turn comes (by the kernel,
    or here for those it does not reach). Returns ``(elements done, tiles done of the next
    one)`` (``(0, 0)``: it did not apply, or stopped at once); the caller does the rest with
    :func:`_one_batch_element`."""
    p = bp.forward
    own = _own_slots(p.batch_shape, bp.targets)
    done, skip = _stack_kernel(bp, elements, buffers, sums, p.lk if own else 0)
    if own:                   # the slots of the elements the kernel did not reach: zeroed
        _zero_slots(bp, buffers, elements[done + (skip > 0):])
    return done, skip


def _zero_slots(bp, buffers, elements):
    """Zero the gradient slots of the batch ``elements`` (each element's its own)."""
    for name, buffer in buffers.items():
        view = elements.view(buffer) if isinstance(elements, ElementRun) else None
        if view is not None:
            view[...] = 0
        else:
            for b in elements:
                buffer[bp.targets[name].slot(b)] = 0


def _stack_kernel(bp, elements, buffers, sums, clear):
    """:func:`_compiled_stack`'s call of the kernel, ``clear`` its argument of that name."""
    p = bp.forward
    acc = p.acc_dtype
    first = elements[0]
    grads = [buffers[n][bp.targets[n].slot(first)] for n in ("q", "k", "v")]

    def gathered(x, tail=2):               # (G, ...): a view where a run's batch axes merge
        view = elements.view(x, tail) if isinstance(elements, ElementRun) else None
        return x[tuple(batch_index(elements).T)] if view is None else view

    def stacked(x):                        # (G, L, D) in the accumulation dtype, C-ordered
        return np.ascontiguousarray(gathered(x), dtype=acc)

    do = stacked(bp.dout)
    found = compiled_task(acc, "backward_stack", (do[0], p.k[first], p.v[first], *grads))
    if found is None or not (p.k.flags.aligned and p.v.flags.aligned):
        return 0, 0
    (blas, stack), size = found, acc.itemsize
    # the queries, scaled by the kernel: read in place where CBLAS could read them, else from
    # one stacked copy in the accumulation dtype
    if p.q.flags.aligned and blas.reads_rows(p.q[first], acc):
        queries = batch_addresses(p.q, elements), p.q.strides[-2] // size
    else:
        copy = stacked(p.q)
        queries = (copy.ctypes.data + np.arange(len(elements), dtype=np.int64) * copy.strides[0],
                   p.d)
    lse = np.ascontiguousarray(gathered(np.broadcast_to(bp.lse, p.batch_shape + (p.lq,)), 1),
                               dtype=acc)
    if not lse.flags.writeable:          # a read-only array is another type to the kernel
        lse = lse.copy()
    delta = _delta(do, stacked(bp.out))
    block_k = blocks(acc)[1]
    tiles = np.array([t for j0 in range(0, p.lk, block_k)
                      for t in _block_tiles(p, j0, min(j0 + block_k, p.lk))],
                     dtype=np.int64).reshape(-1, 4)
    if not len(tiles):                  # no row sees a key (an lse of -inf was expected)
        return 0, 0
    lo, hi = band_columns(query_diagonals(p, 0, p.lq), *p.window, 0, p.lk)
    n, w = int((tiles[:, 1] - tiles[:, 0]).max()), int((tiles[:, 3] - tiles[:, 2]).max())
    # the rows' sums added into the stack's own rows of `sums` where they are one C-ordered
    # slice, else into zeros added there after
    run = elements.view(sums.sums, 1) if isinstance(elements, ElementRun) else None
    direct = run is not None and run.flags.c_contiguous and run.dtype == acc
    row_sums = run if direct else np.zeros(lse.shape, dtype=acc)

    def rows(x):                     # each element's row-0 address (a gradient: its slot's)
        return batch_addresses(x, elements), x.strides[-2] // size

    done, skip = stack(tiles, *queries, acc.type(p.scale), np.empty((p.lq, p.d), acc),
                       do.ctypes.data, do.shape[2], do.strides[0], *rows(p.k), *rows(p.v), p.d,
                       p.dv, *rows(buffers["q"]), *rows(buffers["k"]), *rows(buffers["v"]),
                       clear, lse, delta, row_sums, lo, hi, np.empty(n * w, acc),
                       np.empty(n * w, acc), np.empty(n, acc), _span_rows(p),
                       blas.address(acc), blas.wide, element_slopes(p, elements),
                       p.diagonal_offset)
    if not direct:          # the sums of the elements done and of the tiles done of the next
        added = done + (skip > 0)
        if run is not None:
            run[:added] += row_sums[:added]
        else:
            for g, b in enumerate(elements[:added]):
                sums.sums[b] += row_sums[g]
    return done, skip


class _Visibility:
    """The (n, w) boolean "row may see key" of a tile, computed only when asked (only the paths
    for non-finite numbers and rows given lse = -inf need it), and its skew into the layout
    of the tile's band of distances."""

    def __init__(self, pipeline, js, je, kt):
        self._args = (pipeline, js, je, kt)
        self._visible = None

    def __call__(self):
        if self._visible is None:
            pipeline, js, je, kt = self._args
            self._visible = pipeline.visible(js, je, kt)
        return self._visible

    def transposed(self):
        return self().T

    def band(self):
        """(n, n + w - 1): whether row ``i`` sees the distance of band entry ``t`` in this
        tile (False where no key of the tile lies at that distance from the row)."""
        n, w = self().shape
        out = np.zeros((n, n + w - 1), dtype=bool)
        _skew(out)[...] = self()
        return out

    def band_transposed(self):
        return self.band().T


def _tile(p, e, pipeline, i0, i1, js, je, kt, vt, seen, spans=None):
    """One tile's ``(P, dS, dS_content, row_sums)``: the probabilities, the gradient of the
    logit, the gradient of the content score (they differ only under a soft cap of the content
    score) and each row's sum of P (None: not computed here). ``spans``: the products over
    those columns of each group of rows only (see ScorePipeline.row_spans)."""
    s, tanh = pipeline.logits(js, je, kt, tanh=True, spans=spans)
    with np.errstate(invalid="ignore", over="ignore"):
        ds = spanned_product(e.do[i0:i1], vt, spans)   # dP = dO V^T
    kernel = tile_kernel(s.dtype, "backward_tile")
    row_sums = None if kernel is None else np.empty(i1 - i0, dtype=s.dtype)
    # P = exp(s - lse) and dS = P * (dP - Delta) in one sweep (status 1: all finite, 2: some
    # dS not finite), unless a row's max is above its lse or NaN (0: nothing written)
    status = 0 if kernel is None else kernel(s, e.lse[i0:i1], ds, e.delta[i0:i1], row_sums)
    done = status == 1
    if status == 0:
        row_sums = None
        # P = exp(s - lse): s becomes P
        with np.errstate(invalid="ignore"):
            s -= e.lse[i0:i1, None]
        np.exp(s, out=s)
        with np.errstate(invalid="ignore", over="ignore"):
            # dS = P * (dP - Delta)
            ds -= e.delta[i0:i1, None]
            ds *= s
            done = np.isfinite(np.sum(ds))
    if not done:
        # NaN or inf in V, dO, O, lse or the scores reaches P or dS at invisible places
        # (0 * NaN, exp(-inf - NaN)): those have no gradient, so NaN stays where it belongs
        row_sums = None                                # summed after the clearing
        hidden = ~seen()
        np.copyto(ds, 0, where=hidden)
        np.copyto(s, 0, where=hidden)
    if tanh is None:
        return s, ds, ds, row_sums
    # d/dx c tanh(x / c) = 1 - tanh^2
    np.multiply(tanh, tanh, out=tanh)
    np.subtract(1, tanh, out=tanh)
    if p.softcap_bias:
        ds *= tanh                                     # every term sits under the cap
        return s, ds, ds, row_sums
    return s, ds, ds * tanh, row_sums


# --------------------------------------------------------------------------------------------
# gradients of the score terms


def _add_tail(buffer, slot, g, starts):
    """``buffer[slot][starts...] += g``, summing ``g`` over each trailing axis along which the
    input was broadcast (buffer length 1)."""
    region = buffer[slot]
    index = []
    for axis, start in enumerate(starts):
        if region.shape[axis] == 1:                    # broadcast: (one tile row or not)
            g = g.sum(axis=axis, keepdims=True) if g.shape[axis] != 1 else g
            start = 0
        index.append(slice(start, start + g.shape[axis]))
    region[tuple(index)] += g


def _bias_gradients(p, pipeline, buffers, slots, ds, i0, js, je):
    """The gradients of ``bias`` (or the block bias) and ``rel_bias`` from the tile's ``dS``."""
    if p.bias is not None and p.bias_block is None:
        _add_tail(buffers["bias"], slots["bias"], ds, (i0, js))
    elif p.bias is not None:
        # bias[I, J] is added to every score of block (I, J): its gradient is the block's sum
        r, c = p.bias_block
        rows = np.unique(np.r_[0, np.arange(-i0 % r, ds.shape[0], r)])  # rows starting a block
        cols = np.unique(np.r_[0, np.arange(-js % c, je - js, c)])
        g = np.add.reduceat(np.add.reduceat(ds, rows, axis=0), cols, axis=1)
        _add_tail(buffers["bias"], slots["bias"], g, (i0 // r, js // c))
    if p.rel_bias is not None:
        # rel_bias[rb + clip(delta)] is added along each diagonal of the tile: sum dS along
        # the diagonals (band entry t = (j - js) - (i - i0) + n - 1), then by table entry
        index = pipeline.band_index(js, je, p.rel_bias_radius)
        _scatter(buffers["rel_bias"], slots["rel_bias"], index, _diagonal_sums(ds))


def _relative_logit_gradients(p, pipeline, buffers, slots, ds, i0, js, seen):
    """``rel_q`` and ``rel_k`` gradients of the term ``rel_q[i] . rel_k[rk + clip(delta)]``."""
    if p.rel_q is None:
        return
    n, w = ds.shape
    index, band = pipeline.relative_band(js, js + w)                 # (nb,), (nb, Dr)
    band = blas_ready(band, p.acc_dtype)
    # the forward adds products[i, t] = rel_q[i] . band[t] at t = (j - js) - (i - i0) + n - 1:
    # the gradient of the (n, nb) products is dS skewed into that layout, zero elsewhere. A
    # table row no seen place uses (NaN there is allowed) must not reach the other gradient.
    g = np.zeros((n, n + w - 1), dtype=p.acc_dtype)
    _skew(g)[...] = ds
    _add_tail(buffers["rel_q"], slots["rel_q"], visible_product(g, band, seen.band), (i0, 0))
    _scatter(buffers["rel_k"], slots["rel_k"], index,
             visible_product(g.T, pipeline.rel_q, seen.band_transposed))


def _skew(g):
    """The writable (n, w) view ``v[i, j] = g[i, j - i + n - 1]`` of an (n, n + w - 1) ``g``."""
    n, nb = g.shape
    return skewed(g.reshape(-1), n, nb - 1, nb - n + 1, writeable=True)


def _diagonal_sums(ds):
    """``out[t] = sum of ds[i, j]`` over ``j - i + n - 1 = t``: (n + w - 1,)."""
    n, w = ds.shape
    g = np.zeros((n, n + w - 1), dtype=ds.dtype)
    _skew(g)[...] = ds
    return g.sum(axis=0)


def _scatter(buffer, slot, index, values):
    """``buffer[slot][..., index, ...] += values`` along the table axis, repeated entries (the
    clamped distances) summed in order."""
    np.add.at(buffer[slot], index, values)
