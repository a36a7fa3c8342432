"""Packed variable-length batches on the NumPy engines (``cu_seqlens_q``, ``cu_seqlens_k``).

No new numerics. The forward and the backward run the whole batch as one task list on the
pool (:func:`.cpu_runtime.run_tasks`): a unit is one query block of one batch element of one
sequence (forward, :func:`.numpy.attend`) or one batch element of one sequence (backward,
:func:`.numpy_backward.stacked_gradients`), or a stack of a sequence's elements (forward:
where each is one query block, :func:`.numpy.attend_stacked`; backward: as many as one stack holds;
one compiled call, the bits of a unit per element where the compiled loops run), on the sequence's own :class:`cuonline._validate.Problem`
(:func:`sequence_problem`: views of its rows, no copy),
writing straight into the packed results; consecutive short units share a task
(``TASK_WORK``). Every unit writes rows no other unit writes and the task list depends on the
problem only, so the results are the same for every ``workers``. A backward over 256
proteins of distinct lengths is then one pool run of thousands of tasks, not hundreds of
small engine calls, each with its own copies of the rows and its own tail of idle workers.

With fewer units than cores (a few long sequences), and for the statistics
(:mod:`.numpy_stats`), the sequences are grouped by their shape, each group is stacked into
one batch axis (a copy of its rows) and handed to the NumPy engine as an ordinary
:class:`cuonline._validate.Problem`, whose results are scattered back into the packed layout
(the engine then splits long key ranges among the cores). Either way the work is
``sum_b len_q(b) * len_k(b)`` and no tile crosses two sequences.

A group is the sequences that share their query length and diagonal (:func:`cuonline.
_semantics.sequence_diagonals`). At the default offsets the diagonal is ``len_k - len_q``, so
a group shares both lengths exactly; with an explicit ``q_offset`` the keys of a group are
padded to its longest and the padding is cut off with ``kv_lengths`` (never read).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._gradients import Gradients, Target, gradients_of
from . import numpy as numpy_forward
from . import numpy_backward
from .cpu_runtime import ElementRun, stacks_of

if TYPE_CHECKING:
    from .._validate import BackwardProblem, Problem, StatsProblem

__all__ = ["Group", "attention", "attention_backward", "attention_stats", "groups",
           "place_rows", "received", "row_state", "sequence_problem", "weights_of_rows"]


@dataclass(frozen=True)
class Group:
    """Sequences of one shape, stacked as a batch axis of ``len(sequences)`` elements."""

    sequences: tuple           # indices b into the packed batch
    lq: int                    # every sequence's query length
    lk: int                    # the longest key length (the others padded to it)
    diagonal: int              # every sequence's diagonal offset
    index_q: np.ndarray        # (G, lq): packed query rows of each sequence
    index_k: np.ndarray        # (G, lk): packed key rows (padding repeats a valid row)
    lengths_k: np.ndarray      # (G,): each sequence's own key length

    @property
    def padded(self) -> bool:
        return bool((self.lengths_k != self.lk).any())


def groups(p) -> list:
    """The groups of problem ``p``'s sequences, in the order of their first sequence; a
    sequence without queries is in none (it has nothing to compute)."""
    cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
    by_shape: dict = {}
    for b, diagonal in enumerate(p.sequence_diagonals):
        lq = int(cq[b + 1] - cq[b])
        if lq:
            by_shape.setdefault((lq, diagonal), []).append(b)
    out = []
    for (lq, diagonal), members in by_shape.items():
        lengths_k = np.array([int(ck[b + 1] - ck[b]) for b in members], dtype=np.int64)
        lk = int(lengths_k.max())
        index_q = cq[members][:, None] + np.arange(lq)
        # padded key rows point at the sequence's first row (or row 0): any valid row, never
        # read past kv_lengths
        offsets = np.minimum(np.arange(lk), np.maximum(lengths_k[:, None] - 1, 0))
        index_k = np.minimum(ck[members][:, None] + offsets, max(p.lk - 1, 0))
        out.append(Group(tuple(members), lq, lk, diagonal, index_q, index_k, lengths_k))
    return out


def _gather(x, index, batch_shape):
    """Rows ``index`` (G, L) of ``x`` (``batch_shape + (N,) + tail``, a view broadcast to the
    batch) as ``batch_shape + (G, L) + tail``: batch axes the view broadcast are gathered once
    and broadcast again, not copied per element."""
    nb = len(batch_shape)
    base = x[tuple(slice(0, 1) if x.strides[a] == 0 else slice(None) for a in range(nb))]
    rows = np.take(base, index, axis=nb)
    return np.broadcast_to(rows, batch_shape + index.shape + x.shape[nb + 1:])


def _per_element(x, count, batch_shape):
    """A per-batch array (``batch_shape + tail``) repeated for the ``count`` sequences of a
    group: ``batch_shape + (count,) + tail``, a broadcast view."""
    nb = len(batch_shape)
    return np.broadcast_to(np.expand_dims(x, nb), batch_shape + (count,) + x.shape[nb:])


def _sub_problem(p, g: Group):
    """The :class:`cuonline._validate.Problem` of group ``g``: an ordinary batch of
    ``p.batch_shape + (G,)`` elements, no cu_seqlens."""
    batch = p.batch_shape
    sub_batch = batch + (len(g.sequences),)
    kv_lengths = None
    if g.padded:
        kv_lengths = np.ascontiguousarray(np.broadcast_to(g.lengths_k, sub_batch))
    alibi = None
    if p.alibi_slopes is not None:
        alibi = np.ascontiguousarray(_per_element(p.alibi_slopes, len(g.sequences), batch))
    tables = {name: None if getattr(p, name) is None
              else _per_element(getattr(p, name), len(g.sequences), batch)
              for name in ("rel_bias", "rel_k")}
    return dataclasses.replace(
        p, batch_shape=sub_batch, lq=g.lq, lk=g.lk,
        q=_gather(p.q, g.index_q, batch), k=_gather(p.k, g.index_k, batch),
        v=_gather(p.v, g.index_k, batch),
        rel_q=None if p.rel_q is None else _gather(p.rel_q, g.index_q, batch),
        kv_lengths=kv_lengths, alibi_slopes=alibi, diagonal_offset=g.diagonal,
        cu_seqlens_q=None, cu_seqlens_k=None, sequence_diagonals=None, **tables,
    )


# --------------------------------------------------------------------------------------------
# one task list for the whole packed batch

# Score entries (rows x keys) of work below which consecutive units (one batch element of one
# sequence, or one query block of it) share a task: a 50-residue protein is tens of
# microseconds of products against the per-task Python of fetching its slices.
TASK_WORK = 1 << 17


def sequence_problem(p, b: int):
    """The :class:`cuonline._validate.Problem` of sequence ``b`` of the packed problem ``p``
    alone: its rows of ``q``, ``k``, ``v`` and ``rel_q`` as views (no copy), its own diagonal,
    no cu_seqlens."""
    cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
    q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
    return dataclasses.replace(
        p, lq=q1 - q0, lk=k1 - k0, q=p.q[..., q0:q1, :], k=p.k[..., k0:k1, :],
        v=p.v[..., k0:k1, :], rel_q=None if p.rel_q is None else p.rel_q[..., q0:q1, :],
        kv_lengths=None, diagonal_offset=p.sequence_diagonals[b], cu_seqlens_q=None,
        cu_seqlens_k=None, sequence_diagonals=None)


def _batched(units, work):
    """``units`` cut into consecutive runs of at least ``TASK_WORK`` score entries each
    (``work[n]`` is unit ``n``'s), the last run whatever is left: the task list, each task
    ``(units, its work)``. Depends on the problem only, so the results do not depend on the
    thread count."""
    tasks, current, total = [], [], 0
    for unit, w in zip(units, work):
        current.append(unit)
        total += w
        if total >= TASK_WORK:
            tasks.append((current, total))
            current, total = [], 0
    if current:
        tasks.append((current, total))
    return tasks


def _run_batched(units, work, run, n_workers):
    """``run(units of a task)`` for every task of :func:`_batched` on the pool, the tasks with
    the most work first (sequences of a packed batch differ in length)."""
    from .cpu_runtime import run_tasks

    run_tasks(_batched(units, work), lambda task: run(task[0]), n_workers,
              cost=lambda task: task[1])


def attention(p: Problem) -> tuple[Any, Any]:
    """``(out, lse)`` of the packed problem ``p``: ``out`` ``S + (total_q, Dv)``, ``lse``
    ``S + (total_q,)`` (None unless ``p.return_lse``); a query of a sequence without keys
    gets 0 and ``-inf``.

    One task list on the pool: a unit is one query block (:func:`.numpy.blocks`) of one batch
    element of one sequence, over the keys its rows may see (:func:`.numpy.key_range`), or,
    where each element of a sequence is one query block, a stack of its elements
    (:func:`.numpy.stack_limit`, :func:`.numpy.attend_stacked`: one compiled call), and
    short units share a task. With fewer units than cores (a few long sequences), the
    sequences go by shape through :func:`.numpy.attention`, which splits key ranges."""
    from .cpu_runtime import workers

    batch = p.batch_shape
    block_q = numpy_forward.blocks(p.acc_dtype)[0]
    subs: dict = {}
    # (sequence, element index or a slice of consecutive elements, i0, i1, j0, j1)
    units: list[tuple] = []
    work: list[int] = []
    for b in range(len(p.cu_seqlens_q) - 1):
        lq = int(p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b])
        if not lq:
            continue
        sub = subs[b] = sequence_problem(p, b)
        stacked = numpy_forward.stack_limit(sub) if sub.nbatch >= 2 else None
        if stacked is not None and stacked[2] >= 2:
            # every element one query block: its elements in stacks
            j0, j1, most = stacked
            for a, z in stacks_of(sub.nbatch, most, 1):
                units.append((b, slice(a, z), 0, lq, j0, j1))     # consecutive elements
                work.append((z - a) * lq * (j1 - j0))
            continue
        step = min(block_q, lq)
        for e in np.ndindex(*batch):
            for i0 in range(0, lq, step):
                i1 = min(i0 + step, lq)
                j0, j1 = numpy_forward.key_range(sub, e, i0, i1)
                if j1 > j0:                    # else the row sees nothing: 0 and -inf
                    units.append((b, e, i0, i1, j0, j1))
                    work.append((i1 - i0) * (j1 - j0))
    if len(units) < workers():
        return _grouped_attention(p)
    out = np.zeros(batch + (p.lq, p.dv), dtype=p.dtype)
    lse = np.full(batch + (p.lq,), -np.inf, dtype=p.acc_dtype)
    # a run of consecutive elements of the (fresh, C-ordered) results: one slice
    flat_out, flat_lse = out.reshape((-1, p.lq, p.dv)), lse.reshape((-1, p.lq))

    def run(task):
        for b, e, i0, i1, j0, j1 in task:
            rows = slice(int(p.cu_seqlens_q[b]) + i0, int(p.cu_seqlens_q[b]) + i1)
            if isinstance(e, slice):                      # a stack of elements
                flat_out[e, rows], flat_lse[e, rows] = numpy_forward.attend_stacked(
                    subs[b], ElementRun(batch, e.start, e.stop), i0, i1, j0, j1)
            else:
                out[e][rows], lse[e][rows] = numpy_forward.attend(subs[b], e, i0, i1, j0, j1)

    n_workers = workers() if p.workers is None else p.workers
    _run_batched(units, work, run, n_workers)
    return out, (lse if p.return_lse else None)


def _grouped_attention(p: Problem) -> tuple[Any, Any]:
    """:func:`attention` by one :func:`.numpy.attention` call per group of sequences."""
    batch = p.batch_shape
    out = np.zeros(batch + (p.lq, p.dv), dtype=p.dtype)
    lse = np.full(batch + (p.lq,), -np.inf, dtype=p.acc_dtype) if p.return_lse else None
    for g in groups(p):
        rows = g.index_q.reshape(-1)
        o, s = numpy_forward.attention(_sub_problem(p, g))
        out[..., rows, :] = o.reshape(batch + (-1, p.dv))
        if lse is not None:
            lse[..., rows] = s.reshape(batch + (-1,))
    return out, lse


def attention_backward(bp: BackwardProblem) -> Gradients:
    """:class:`cuonline.Gradients` of the packed backward problem ``bp``: each gradient packed
    (and shaped) like its input; the keys of a sequence without queries get zeros.

    One task list on the pool: a unit is a stack of a sequence's batch elements (as many as
    :func:`.numpy_backward.stack_limit` allows, else one) on the sequence's problem
    (:func:`.numpy_backward.stacked_gradients`, one compiled call where it applies), adding
    straight into the packed gradients' rows of those elements: no two units share a gradient
    row; short units share a task. The tables shared by every sequence (``rel_bias``, ``rel_k``) take
    one buffer per sequence, summed in sequence order. Each row's sum of ``P`` is checked
    once for the whole batch. With fewer units than cores, the sequences go by shape through
    :func:`.numpy_backward.attention_backward`, which splits each into key and query blocks.
    """
    from .cpu_runtime import workers

    p = bp.forward
    acc, batch, nb = p.acc_dtype, p.batch_shape, len(p.batch_shape)
    cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
    sequences = [b for b in range(len(cq) - 1) if cq[b + 1] > cq[b]]
    lengths_q, lengths_k = np.diff(cq), np.diff(ck)
    if len(sequences) * p.nbatch < workers():
        return _grouped_backward(bp)
    full = {"q": np.zeros(batch + (p.lq, p.d), acc), "k": np.zeros(batch + (p.lk, p.d), acc),
            "v": np.zeros(batch + (p.lk, p.dv), acc)}
    if "rel_q" in bp.targets:
        full["rel_q"] = np.zeros(batch + (p.lq, p.dr), acc)
    tables = [name for name in ("rel_bias", "rel_k") if name in bp.targets]
    sums = numpy_backward.RowSums(p)
    calls = {}
    for b in sequences:
        sub = sequence_problem(p, b)
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        rows = {"q": slice(q0, q1), "rel_q": slice(q0, q1), "k": slice(k0, k1),
                "v": slice(k0, k1)}
        buffers = {name: full[name][..., rows[name], :] for name in full}
        buffers.update({name: np.zeros(batch + getattr(p, name).shape[nb:], acc)
                        for name in tables})
        targets = {name: Target(shape=buffers[name].shape, dtype=acc,
                                tail=bp.targets[name].tail) for name in buffers}
        sub_bp = dataclasses.replace(
            bp, forward=sub, dout=bp.dout[..., q0:q1, :], out=bp.out[..., q0:q1, :],
            lse=bp.lse[..., q0:q1], targets=targets)
        calls[b] = (sub_bp, buffers, numpy_backward.RowSums(
            sub, sums.sums[..., q0:q1], sums.sees[..., q0:q1]))
    # a unit: a sequence's elements, as many as one stack holds (one where none may stack)
    elements = list(np.ndindex(*batch))
    units = [(b, elements[a:z]) for b in sequences for a, z in stacks_of(
        len(elements), numpy_backward.stack_limit(calls[b][0].forward), 1)]
    work = [len(e) * int(lengths_q[b] * lengths_k[b]) for b, e in units]

    def run(task):
        for b, stack in task:
            numpy_backward.stacked_gradients(calls[b][0], stack, calls[b][1], calls[b][2])

    n_workers = workers() if p.workers is None else p.workers
    _run_batched(units, work, run, n_workers)
    _check_row_sums(bp, sums, lengths_q, lengths_k)
    for name in tables:                        # shared by every sequence: in sequence order
        full[name] = np.zeros(batch + getattr(p, name).shape[nb:], acc)
        for b in sequences:
            full[name] += calls[b][1][name]
    full["q"] *= acc.type(p.scale)             # summed without the scale, as numpy_backward
    reduced = {name: bp.reduce(name, grad) for name, grad in full.items()}
    return gradients_of(reduced)


def _check_row_sums(bp, sums, lengths_q, lengths_k) -> None:
    """The check of :mod:`cuonline._lse_check` on the packed rows' sums of ``P``: each row
    with its own sequence's key count and product bound ``R`` (the largest key norm of its
    own sequence)."""
    from .. import _lse_check

    p = bp.forward
    n_keys = np.repeat(lengths_k, lengths_q)                         # (total_q,)

    def products():                     # only where a row is past the bound of R = 0
        return _lse_check.product_bound(np, p.q, p.k, p.scale, rel_q=p.rel_q, rel_k=p.rel_k,
                                        sequences=(p.cu_seqlens_q, p.cu_seqlens_k))

    terms = p.d + p.dr
    _lse_check.check_row_sums(np, sums.sums, np.broadcast_to(bp.lse, sums.sums.shape),
                              acc_dtype=p.acc_dtype, n_keys=n_keys, logit_terms=terms,
                              products=products, sees_keys=sums.sees)


def _grouped_backward(bp: BackwardProblem) -> Gradients:
    """:func:`attention_backward` by one :func:`.numpy_backward.attention_backward` call per
    group of sequences."""
    p = bp.forward
    acc, batch, nb = p.acc_dtype, p.batch_shape, len(p.batch_shape)
    # per batch element, in the accumulation dtype; summed to the shapes as passed at the end
    full = {"q": np.zeros(batch + (p.lq, p.d), acc), "k": np.zeros(batch + (p.lk, p.d), acc),
            "v": np.zeros(batch + (p.lk, p.dv), acc)}
    for name in ("rel_bias", "rel_q", "rel_k"):
        if name in bp.targets:
            full[name] = np.zeros(getattr(p, name).shape, acc)
    for g in groups(p):
        sub = _sub_problem(p, g)
        targets = {name: Target(shape=getattr(sub, name).shape, dtype=acc,
                                tail=bp.targets[name].tail) for name in full}
        grads = numpy_backward.attention_backward(dataclasses.replace(
            bp, forward=sub, dout=_gather(bp.dout, g.index_q, batch),
            out=_gather(bp.out, g.index_q, batch), lse=_gather(bp.lse, g.index_q, batch),
            targets=targets))
        rows_q = g.index_q.reshape(-1)
        full["q"][..., rows_q, :] = grads.dq.reshape(batch + (-1, p.d))
        if "rel_q" in full:
            full["rel_q"][..., rows_q, :] = grads.drel_q.reshape(batch + (-1, p.dr))
        # padded keys (past a sequence's own length) receive nothing
        real = (np.arange(g.lk) < g.lengths_k[:, None]).reshape(-1)
        rows_k = g.index_k.reshape(-1)[real]
        for name, grad, width in (("k", grads.dk, p.d), ("v", grads.dv, p.dv)):
            full[name][..., rows_k, :] = grad.reshape(batch + (-1, width))[..., real, :]
        # the tables are shared by every sequence: each group adds its sum, in group order
        for name, grad in (("rel_bias", grads.drel_bias), ("rel_k", grads.drel_k)):
            if name in full:
                full[name] += grad.sum(axis=nb)
    reduced = {name: bp.reduce(name, grad) for name, grad in full.items()}
    return gradients_of(reduced)


def attention_stats(sp: StatsProblem) -> dict:
    """The fields of :class:`cuonline.AttentionStats` of the packed statistics problem
    ``sp``: row statistics packed like the queries (``S + (total_q,)``, key indices those of
    the packed keys), ``received`` like the keys (``S + (total_k,)``; keys of a sequence
    without queries receive 0), ``weights`` ``S + (len(rows), total_k)`` (0 outside each
    row's sequence). A query of a sequence without keys gets what a row that sees no key gets
    (``lse = -inf``, entropy 0, argmax -1, ...)."""
    from . import numpy_stats
    from .cpu_runtime import workers

    p = sp.scores
    n_workers = workers() if p.workers is None else p.workers
    result = numpy_stats.finished(row_state(sp, n_workers), p.batch_shape + (p.lq,))
    result.update(received=None, weights=None)
    if sp.received:
        result["received"] = received(p, result["lse"], sp.query_weights, n_workers)
    if sp.rows is not None:
        result["weights"] = weights_of_rows(p, result["lse"], np.asarray(sp.rows), n_workers)
    return result


def row_state(sp: StatsProblem, n_workers=None):
    """Pass 1 of the statistics of a packed problem (:func:`.numpy_stats.row_state` per
    group): the :class:`.numpy_stats.RowState` of every packed query, rows in C order of
    ``S + (total_q,)``, key indices those of the packed keys; a query of a sequence without
    keys (or of no group) keeps the state of a row that saw nothing."""
    from . import numpy_stats

    p = sp.scores
    batch = p.batch_shape
    state = numpy_stats.RowState(math.prod(batch) * p.lq, sp.top_k, p.acc_dtype, sp.entropy)
    for g in groups(p):
        sub = _sub_problem(p, g)
        part = numpy_stats.row_state(dataclasses.replace(
            sp, scores=sub, received=False, query_weights=None, rows=None), n_workers)
        # a sequence's key j is packed key cu_seqlens_k[b] + j
        first_key = p.cu_seqlens_k[list(g.sequences)][:, None]            # (G, 1)
        shift = np.broadcast_to(first_key, batch + (len(g.sequences), g.lq)).reshape(-1)
        part.arg = np.where(part.arg < 0, -1, part.arg + shift)
        part.top_i = np.where(part.top_i < 0, -1, part.top_i + shift[:, None])
        place_rows(state, part, batch, p.lq, g.index_q.reshape(-1))
    return state


def place_rows(state, part, batch, n_rows, rows) -> None:
    """Write the :class:`.numpy_stats.RowState` ``part`` (rows in C order of ``batch +
    (m,)``) into rows ``rows`` (an index array or a slice of ``m`` rows) of ``state`` (rows
    in C order of ``batch + (n_rows,)``)."""
    elements = math.prod(batch)
    if not elements:
        return
    count = part.m.shape[0] // elements
    where = (slice(None),) * len(batch) + (rows,)
    for name in ("m", "l", "u", "arg", "top_s", "top_i"):
        target = getattr(state, name)
        if target is None:
            continue
        tail = target.shape[1:]
        view = target.reshape(batch + (n_rows,) + tail)      # contiguous: a view
        view[where] = getattr(part, name).reshape(batch + (count,) + tail)


def received(p: Problem, lse, query_weights, n_workers):
    """``sum_i w_i P_ij`` of the packed problem ``p`` with its queries' ``lse`` (``S +
    (total_q,)``): ``S + (total_k,)`` in the accumulation dtype, by
    :func:`.numpy_stats.received` per group; keys of a sequence without queries get 0."""
    from . import numpy_stats

    batch = p.batch_shape
    out = np.zeros(batch + (p.lk,), dtype=p.acc_dtype)
    for g in groups(p):
        weights = None if query_weights is None else _gather(query_weights, g.index_q, batch)
        got = numpy_stats.received(_sub_problem(p, g), _gather(lse, g.index_q, batch), weights,
                                   n_workers)
        real = (np.arange(g.lk) < g.lengths_k[:, None]).reshape(-1)
        out[..., g.index_k.reshape(-1)[real]] = got.reshape(batch + (-1,))[..., real]
    return out


def weights_of_rows(p: Problem, lse, rows, n_workers):
    """Rows ``rows`` (1-D, in ``[0, total_q)``) of ``P`` of the packed problem ``p`` with
    its queries' ``lse``: ``S + (len(rows), total_k)``, each row over its own sequence's keys
    (0 elsewhere), by :func:`.numpy_stats.weights_of_rows` per sequence that holds a row."""
    from . import numpy_stats

    batch = p.batch_shape
    out = np.zeros(batch + (rows.size, p.lk), dtype=p.acc_dtype)
    cq = p.cu_seqlens_q
    for g in groups(p):
        sub = _sub_problem(p, g)
        for member, b in enumerate(g.sequences):
            where = np.flatnonzero((rows >= cq[b]) & (rows < cq[b + 1]))
            if not where.size:
                continue
            got = numpy_stats.weights_of_rows(
                _member(sub, member, batch), _gather(lse, g.index_q[member:member + 1], batch)[
                    ..., 0, :], rows[where] - cq[b], n_workers)
            length, start = int(g.lengths_k[member]), int(p.cu_seqlens_k[b])
            out[..., where, start:start + length] = got[..., :length]
    return out


def _member(sub, member, batch):
    """The problem of one sequence (``member``) of a group's problem ``sub``."""
    def take(x, tail):
        return None if x is None else x[(Ellipsis, member) + (slice(None),) * tail]

    return dataclasses.replace(
        sub, batch_shape=batch, q=take(sub.q, 2), k=take(sub.k, 2), v=take(sub.v, 2),
        rel_q=take(sub.rel_q, 2), kv_lengths=take(sub.kv_lengths, 0),
        alibi_slopes=take(sub.alibi_slopes, 0), rel_bias=take(sub.rel_bias, 1),
        rel_k=take(sub.rel_k, 2))
