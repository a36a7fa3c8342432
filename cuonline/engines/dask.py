"""Attention and merge on Dask arrays: a lazy graph of per-chunk calls and a fixed merge tree.

``cuonline.attention`` hands a call here when any argument is a Dask array. The call is
validated once, on zero-memory NumPy stand-ins of the arguments' shapes and dtypes, so every
error is the one the NumPy engine would raise; then a graph is built:

* batch chunks and query chunks map: each output block ``(b, i)`` is its own reduction;
* key chunks reduce: the task for key chunk ``j`` calls ``cuonline.attention`` on its chunks
  with ``q_offset``/``k_offset`` set from the chunk positions (causal, window, ALiBi and the
  relative terms read only ``delta = key position - query position``, so every chunk scores
  exactly as the whole call would) and returns its ``(out, lse)`` state; the states of one
  output block are merged by a tree of fixed fan-in :data:`SPLIT_EVERY` in key order, so the
  rounding does not depend on scheduling;
* a key chunk that no query of a query chunk can see (above the causal diagonal, outside the
  window, at or past every ``kv_lengths`` of the batch chunk when ``kv_lengths`` is concrete)
  gets no task at all; an output block with no visible key chunk gets zeros and ``-inf``;
* packed batches (``cu_seqlens_q``, ``cu_seqlens_k``, NumPy boundaries that shape the graph):
  a task for each pair that some sequence spans, making the calls of :func:`_varlen_calls`
  (the sequences whole in both chunks as one packed call, each sequence a chunk boundary cuts
  as a plain call on its piece with its position in the sequence as offsets), its rows of
  the other sequences 0 and ``-inf``; then the same merge tree.

:func:`attention_backward` runs the backward pass on the same graph, each task's gradients
split into one piece per gradient and summed by one tree per gradient. :func:`softmax` is the
softmax family's graph: blocks map, and a chunked softmax axis merges per-block ``(m, l)``
states by a fixed tree. Each task runs the engine of its chunks' library: NumPy chunks the
NumPy engine, CuPy chunks the CUDA kernels. ``import cuonline`` imports this module but not
Dask: Dask is imported on the first Dask call.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import numpy as np

from .. import _lse_check, _options, _validate
from .._gradients import GRADIENT_FIELDS
from .._semantics import accumulation_dtype, visible_key_range
from .merge import merge_states
from .softmax import stats as softmax_stats

__all__ = ["SPLIT_EVERY", "attention", "attention_backward", "attention_stats", "is_dask_call",
           "is_dask_merge", "is_dask_softmax", "merge", "softmax"]

#: Fan-in of the merge tree over key chunks. Fixed, so that the order of the floating-point
#: merges (and hence the result, to the last bit) is a property of the chunking alone.
SPLIT_EVERY = 8

# The logical axes of each array argument's trailing dimensions, after the batch axes; an
# argument with fewer dimensions takes the rightmost of them, as NumPy broadcasting does.
# "q"/"k": the query/key axis (chunked); "qb"/"kb": the block bias's coarse axes (chunked
# with the query/key axis); "whole": one chunk (head dimensions, relative tables indexed by
# distance). The array options' layouts are rows of the options table.
_LAYOUT = {
    "q": ("q", "whole"),
    "k": ("k", "whole"),
    "v": ("k", "whole"),
    **{name: _options.array_layout(name) for name in _options.array_options()},
    # the backward pass's: per query chunk
    "dout": ("q", "whole"),
    "out": ("q", "whole"),
    "lse": ("q",),
}
_OPTION_ARRAYS = _options.array_options()
#: The differentiable arguments and their fields of cuonline.Gradients.
_GRADIENT_OF = GRADIENT_FIELDS
# keywords the graph sets per task (the positions, and return_lse); every other keyword goes
# to each task as it came
_POSITIONAL = (*(n for n in _options.names() if _options.option_kind(n) == "position"),
               "return_lse")


def _is_dask_array(x) -> bool:
    # by module name, so that recognising a Dask array never imports Dask
    return type(x).__module__.startswith("dask.array")


# values that are never Dask arrays, passed over without a look at their module: a call's
# two dozen arguments are mostly these (a generator over all of them took 5 us a call)
_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, tuple, np.ndarray})


def is_dask_call(arguments) -> bool:
    """Whether any value of ``arguments`` (a call's bound arguments) is a Dask array."""
    for x in arguments.values():
        if type(x) not in _PLAIN_TYPES and _is_dask_array(x):
            return True
    return False


def is_dask_merge(states) -> bool:
    """Whether any array of the ``(out, lse)`` ``states`` of a merge is a Dask array."""
    return any(_is_dask_array(x) for s in states if isinstance(s, (tuple, list)) for x in s)


# --------------------------------------------------------------------------------------------
# attention


def attention(chunk_attention: Callable[..., Any], /, q: Any, k: Any, v: Any,
              **options: Any) -> Any:
    """``cuonline.attention`` on Dask arrays: returns Dask arrays ``out`` (and ``lse`` with
    ``return_lse``), nothing computed.

    ``chunk_attention`` is ``cuonline.attention`` itself, which each task calls on its chunks
    (passed in, since engines do not import the API layer). ``options`` are the call's other
    keywords, all of them: the array options are chunked to match the queries and keys, the
    position keywords (causal, window, offsets) are rewritten per task from the chunk
    positions, and every other keyword goes to each task unchanged, except ``workers=None``,
    which becomes 1: Dask's workers are the parallelism, one BLAS thread per task. A packed
    batch's boundaries (NumPy or lists; a Dask array is a TypeError) plan the pairs' calls.
    """
    import dask.array as da
    from dask.task_spec import Task, TaskRef

    arrays = {"q": q, "k": k, "v": v}
    p = _validate_on_stand_ins(arrays, options, _validate.validate_attention)
    plan = _plan(da, arrays, options, p, chunk_attention)
    chunk_name = f"cuonline-attention-chunk-{plan.token}"
    merge_name = f"cuonline-attention-merge-{plan.token}"
    task_options = dict(plan.task_options, return_lse=True)
    dsk, states = {}, {}
    for b, iq, i0, i1, visible in plan.blocks:
        parts = []
        for jk, j0 in visible:
            key = (chunk_name, *b, iq, jk)
            refs = [TaskRef(r) for r in plan.reads(b, iq, jk)]
            if plan.calls is not None:
                dsk[key] = Task(key, _chunk_varlen_state, chunk_attention, task_options,
                                plan.calls[iq, jk], i1 - i0, plan.names, *refs)
            else:
                per_task = dict(task_options, q_offset=p.diagonal_offset + i0, k_offset=j0)
                dsk[key] = Task(key, _chunk_state, chunk_attention, per_task, j0, plan.names,
                                *refs)
            parts.append(key)
        if not parts:
            key = (merge_name, *b, iq, "empty")
            shape = tuple(c[t] for c, t in zip(plan.batch_chunks, b)) + (i1 - i0,)
            q_ref = TaskRef(_block_key(plan.arrays["q"], "q", p, b, iq, 0))
            dsk[key] = Task(key, _empty_state, q_ref, shape, p.dv, p.acc_dtype)
            parts.append(key)
        states[b + (iq,)] = _reduce_tree(dsk, merge_name, b + (iq,), parts, _merge_group,
                                         Task, TaskRef)

    out, lse = _state_arrays(da, f"cuonline-attention-{plan.token}", dsk,
                             list(plan.arrays.values()), states,
                             tuple(plan.batch_chunks) + (plan.axis_chunks["q"],), p.dv, p.dtype,
                             p.acc_dtype, plan.arrays["q"]._meta)
    return (out, lse) if p.return_lse else out


def attention_backward(chunk_backward: Callable[..., Any], /, dout: Any, q: Any, k: Any,
                       v: Any, out: Any, lse: Any, **options: Any) -> Any:
    """``cuonline.attention_backward`` on Dask arrays: a :class:`cuonline.Gradients` of Dask
    arrays, nothing computed.

    The graph of :func:`attention`, with a task per visible (query chunk, key chunk) pair
    that calls ``chunk_backward`` (``cuonline.attention_backward``) on its chunks, the global
    `out` and `lse` of its queries and the chunk positions: FlashAttention-2's backward needs
    nothing else of the other chunks, so each task's gradients are exact contributions. The
    gradient of an input block is the sum of the contributions of the tasks that read it, in
    a fixed tree (``SPLIT_EVERY``, in task order) in the accumulation dtype; a block no task
    reads (keys no query sees) gets zeros. Each task's gradients are split into one piece per
    gradient as soon as it ends, and each tree reads only its gradient's pieces, so computing
    one gradient alone keeps no other gradient's blocks alive. Every gradient is a Dask array
    of its input's shape and chunks, whatever library the input came in. A packed batch's
    tasks make their pair's calls, each call's gradients at its rows (the tables summed).
    """
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph
    from dask.task_spec import Task, TaskRef

    from .._gradients import Gradients

    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    p = _validate_on_stand_ins(arrays, options, _validate.validate_attention_backward).forward
    # the chunks each differentiable Dask input came in, which its gradient takes back
    given_chunks = {n: x.chunks for n, x in {**arrays, **options}.items()
                    if n in _GRADIENT_OF and _is_dask_array(x)}
    plan = _plan(da, arrays, options, p, chunk_backward)
    name = f"cuonline-attention-backward-{plan.token}"
    dsk: dict[Any, Any] = {}
    readers: dict[tuple, list] = {}
    for b, iq, i0, i1, visible in plan.blocks:
        for jk, j0 in visible:
            key = (f"{name}-chunk", *b, iq, jk)
            reads = plan.reads(b, iq, jk)
            if plan.calls is not None:
                dsk[key] = Task(key, _chunk_varlen_gradients, chunk_backward,
                                plan.task_options, plan.calls[iq, jk], plan.names,
                                *(TaskRef(r) for r in reads))
            else:
                per_task = dict(plan.task_options, q_offset=p.diagonal_offset + i0,
                                k_offset=j0)
                dsk[key] = Task(key, _chunk_gradients, chunk_backward, per_task, j0,
                                plan.names, *(TaskRef(r) for r in reads))
            # one piece per gradient, split off at once: a gradient's sum reads only its own
            # pieces, so computing one gradient does not keep the others' blocks alive
            for arg, read in zip(plan.names, reads):
                if arg in _GRADIENT_OF:
                    field = _GRADIENT_OF[arg]
                    piece = (f"{name}-{field}-piece", *b, iq, jk)
                    dsk[piece] = Task(piece, _take_gradient, TaskRef(key), field,
                                      _accumulation_of(p, plan.arrays[arg], arg))
                    readers.setdefault((arg, read), []).append(piece)

    graph = HighLevelGraph.from_collections(f"{name}-state", dsk,
                                            dependencies=list(plan.arrays.values()))
    gradients = {}
    for arg, field in _GRADIENT_OF.items():
        x = plan.arrays.get(arg)
        if x is None:
            continue
        dtype = _gradient_dtype(p, x, arg)
        out_name, layer = f"{name}-{field}", {}
        for index in itertools.product(*(range(n) for n in x.numblocks)):
            block, key = (x.name, *index), (out_name, *index)
            parts = readers.get((arg, block))
            if not parts:
                layer[key] = Task(key, _zeros_of, TaskRef(block), dtype)
                continue
            total = _reduce_tree(dsk, f"{name}-sum-{field}", index, parts, _sum_arrays,
                                 Task, TaskRef)
            layer[key] = Task(key, _cast, TaskRef(total), dtype)
        gradients[field] = da.Array(
            _with_layer(graph, out_name, layer, f"{name}-state"), out_name, chunks=x.chunks,
            meta=np.empty_like(x._meta, shape=(0,) * x.ndim, dtype=dtype))
        if given_chunks.get(arg, x.chunks) != x.chunks:
            # the graph refined the input's chunks (k's with v's, say): back to the input's
            gradients[field] = gradients[field].rechunk(given_chunks[arg])
    return Gradients(**{f: gradients.get(f) for f in _GRADIENT_OF.values()})


def _gradient_dtype(p, x, arg):
    """The dtype of the gradient of argument ``arg`` (Dask array ``x``): the inputs' dtype for
    q, k and v, the argument's own (native byte order) for the others."""
    return p.dtype if arg in ("q", "k", "v") else np.dtype(x.dtype).newbyteorder("=")


def _accumulation_of(p, x, arg):
    return accumulation_dtype(_gradient_dtype(p, x, arg))


class _Plan:
    """What the forward and backward graphs share: the arguments as Dask arrays chunked to
    match, the output blocks with their visible key chunks, the per-task keywords."""

    def __init__(self, p, arrays, batch_chunks, axis_chunks, blocks, task_options, token,
                 calls=None):
        self.p, self.arrays, self.batch_chunks, self.axis_chunks = p, arrays, batch_chunks, \
            axis_chunks
        self.blocks, self.task_options, self.token = blocks, task_options, token
        # packed batches: {(query chunk, key chunk): its calls (_varlen_calls)}, else None
        self.calls = calls
        self.names = tuple(arrays)

    def reads(self, b, iq, jk):
        """The keys of the blocks that the task of (batch block b, query chunk iq, key chunk
        jk) reads, one per argument in ``names`` order."""
        return [_block_key(self.arrays[n], n, self.p, b, iq, jk) for n in self.names]


def _plan(da, arrays, options, p, chunk_function):
    """Chunk the arguments (``arrays``: the positional ones; the array options are moved
    out of ``options``) and list every output block's visible key chunks."""
    from dask.base import tokenize

    for name in _OPTION_ARRAYS:
        arrays[name] = options.pop(name, None)
    varlen = p.cu_seqlens_q is not None
    # the boundaries shape the graph (validated in p); the tasks get their own slices
    arrays["cu_seqlens_q"] = arrays["cu_seqlens_k"] = None
    # a concrete kv_lengths as validated (batch shape, clipped): its values prune key chunks
    concrete_lengths = p.kv_lengths is not None and not _is_dask_array(arrays["kv_lengths"])
    if concrete_lengths:
        arrays["kv_lengths"] = np.asarray(p.kv_lengths)
    arrays = {n: _as_dask(da, x) for n, x in arrays.items() if x is not None}

    batch_chunks = _batch_chunks(arrays, p.batch_shape)
    q_chunks = arrays["q"].chunks[-2]
    k_chunks = _refine([arrays["k"].chunks[-2], arrays["v"].chunks[-2]])
    axis_chunks = {"q": q_chunks, "k": k_chunks}
    if p.bias_block is not None:
        # a chunk of the block bias must start at a block: align the boundaries to blocks
        r, c = p.bias_block
        axis_chunks["q"], axis_chunks["qb"] = _align(q_chunks, r)
        axis_chunks["k"], axis_chunks["kb"] = _align(k_chunks, c)
    arrays = {n: _rechunk(x, n, p, batch_chunks, axis_chunks) for n, x in arrays.items()}

    task_options = {n: x for n, x in options.items() if n not in _POSITIONAL}
    task_options.update(causal=False, window=None if p.window == (None, None) else p.window)
    if task_options.get("workers") is None:
        task_options["workers"] = 1
    calls = None
    if varlen:
        calls = _varlen_calls(p, axis_chunks, options.get("q_offset"),
                              options.get("k_offset", 0))
    token = tokenize(*(x.name for x in arrays.values()), sorted(task_options.items(), key=str),
                     p.diagonal_offset, chunk_function.__module__, chunk_function.__qualname__,
                     p.cu_seqlens_q, p.cu_seqlens_k, options.get("q_offset"),
                     options.get("k_offset", 0))

    q_bounds, k_bounds = _bounds(axis_chunks["q"]), _bounds(axis_chunks["k"])
    if varlen:
        blocks = [(b, iq, q_bounds[iq], q_bounds[iq + 1],
                   [(jk, k_bounds[jk]) for jk in range(len(k_bounds) - 1) if (iq, jk) in calls])
                  for b in itertools.product(*(range(len(c)) for c in batch_chunks))
                  for iq in range(len(q_bounds) - 1)]
        return _Plan(p, arrays, batch_chunks, axis_chunks, blocks, task_options, token, calls)
    b_bounds = [_bounds(c) for c in batch_chunks]
    blocks = []
    for b in itertools.product(*(range(len(c)) for c in batch_chunks)):
        kv_max = p.lk
        if concrete_lengths:
            where = tuple(slice(bb[t], bb[t + 1]) for bb, t in zip(b_bounds, b))
            kv_max = int(np.max(p.kv_lengths[where], initial=0))
        for iq in range(len(q_bounds) - 1):
            i0, i1 = q_bounds[iq], q_bounds[iq + 1]
            lo, hi = visible_key_range(i0, i1, p.lq, p.lk, p.window, p.diagonal_offset)
            hi = min(hi, kv_max)
            # key chunks no query of this block sees get no task
            visible = [(jk, k_bounds[jk]) for jk in range(len(k_bounds) - 1)
                       if k_bounds[jk] < hi and k_bounds[jk + 1] > lo]
            blocks.append((b, iq, i0, i1, visible))
    return _Plan(p, arrays, batch_chunks, axis_chunks, blocks, task_options, token)


def _varlen_calls(p, axis_chunks, q_offset, k_offset):
    """The calls of each (query chunk, key chunk) pair of a packed batch that some sequence
    spans: ``{(iq, jk): [(qa, qb, ka, kb, cu_q, cu_k, q_offset, k_offset), ...]}``, rows
    ``[qa, qb)`` of the query chunk against rows ``[ka, kb)`` of the key chunk.

    A sequence wholly inside both chunks is one of the pair's packed call on its run of
    whole sequences (their boundaries ``cu_q``, ``cu_k``, local to the run), with the call's
    own offsets: each sequence keeps the diagonal it has in the whole call. A sequence that a
    chunk boundary cuts (at most the first and the last of each chunk) is a plain call on its
    piece, its position in the sequence passed as the piece's diagonal (``q_offset``, with
    ``k_offset = 0``): query ``qs + i`` of sequence ``b`` faces key ``qs + i + d_b``, which
    is the piece's key ``i + d_b + qs - ks``. Every term reads only that distance, so each
    piece scores as the sequence does in the whole call. Pieces no query of which sees a key
    (causal, window) are left out; a pair left with no call has no task.
    """
    cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
    q_bounds, k_bounds = np.asarray(_bounds(axis_chunks["q"])), np.asarray(
        _bounds(axis_chunks["k"]))
    # (iq, jk) -> [(b, whole, qa, qb, ka, kb, shift)]: rows local to the chunks, and the
    # piece's first query minus its first key in the sequence's own positions
    pieces: dict = {}
    for b, diagonal in enumerate(p.sequence_diagonals):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if q0 == q1 or k0 == k1:
            continue                  # nothing to compute: its queries keep 0 and -inf
        first_q = int(np.searchsorted(q_bounds, q0, side="right")) - 1
        last_q = int(np.searchsorted(q_bounds, q1 - 1, side="right")) - 1
        first_k = int(np.searchsorted(k_bounds, k0, side="right")) - 1
        last_k = int(np.searchsorted(k_bounds, k1 - 1, side="right")) - 1
        for iq in range(first_q, last_q + 1):
            a, e = max(q0, int(q_bounds[iq])), min(q1, int(q_bounds[iq + 1]))
            if a == e:
                continue              # an empty chunk
            for jk in range(first_k, last_k + 1):
                c, f = max(k0, int(k_bounds[jk])), min(k1, int(k_bounds[jk + 1]))
                if c == f:
                    continue
                # in the sequence's own positions: queries [a - q0, e - q0), keys [c - k0, ...)
                lo, hi = visible_key_range(a - q0, e - q0, q1 - q0, k1 - k0, p.window, diagonal)
                if hi <= c - k0 or lo >= f - k0 or lo >= hi:
                    continue
                whole = (a, e, c, f) == (q0, q1, k0, k1)
                piece = (b, whole, a - int(q_bounds[iq]), e - int(q_bounds[iq]),
                         c - int(k_bounds[jk]), f - int(k_bounds[jk]), a - q0 - (c - k0))
                pieces.setdefault((iq, jk), []).append(piece)
    calls = {}
    for pair, members in pieces.items():
        calls[pair] = []
        wholes = [m for m in members if m[1]]
        if wholes:
            # one packed call over the run of whole sequences, the empty ones between included
            b0, b1 = wholes[0][0], wholes[-1][0]
            iq, jk = pair
            run_q = cq[b0:b1 + 2] - cq[b0]
            run_k = ck[b0:b1 + 2] - ck[b0]
            qa, ka = int(cq[b0] - q_bounds[iq]), int(ck[b0] - k_bounds[jk])
            calls[pair].append((qa, qa + int(run_q[-1]), ka, ka + int(run_k[-1]), run_q, run_k,
                                q_offset, k_offset))
        for b, whole, qa, qb, ka, kb, shift in members:
            if not whole:
                calls[pair].append((qa, qb, ka, kb, None, None,
                                    p.sequence_diagonals[b] + shift, 0))
    return calls


def _validate_on_stand_ins(arrays, options, validate):
    """The call's problem, from ``validate`` (``validate_attention`` or
    ``validate_attention_backward``) on zero-memory NumPy stand-ins of the array arguments
    (one validation, one set of error messages for every engine)."""
    for name, value in options.items():
        if name not in _OPTION_ARRAYS and (_is_dask_array(value)
                                           or getattr(value, "ndim", 0) > 0):   # scalars pass
            raise TypeError(f"`{name}` is an array, which the Dask engine cannot chunk; pass "
                            f"it as a scalar or compute the call without Dask arrays")
    arrays = dict(arrays, **{n: options.get(n) for n in _OPTION_ARRAYS})
    backend = _stand_in_backend(arrays, options.get("backend", "auto"))
    stand_ins = {}
    for name, x in arrays.items():
        if x is None or (not hasattr(x, "shape") and not _is_dask_array(x)):
            stand_ins[name] = x                # None, lists, scalars: validated as they are
        elif name == "kv_lengths" and isinstance(x, np.ndarray):
            stand_ins[name] = x                # small: its values are checked and used
        elif name in _validate.CU_SEQLENS:
            stand_ins[name] = x                # host integers that shape the graph (a Dask
                                               # array is refused by validation, by name)
        else:
            stand_ins[name] = _stand_in(x, f"`{name}`", name)
    options = {n: x for n, x in options.items() if n not in _OPTION_ARRAYS}
    return validate(**stand_ins, **dict(options, backend=backend))


def _stand_in_backend(arrays, backend):
    """The backend to validate NumPy stand-ins of ``arrays`` (a dict of the arguments) with.

    Mixed libraries and ``numpy.ma`` chunks raise the errors of the in-memory call. CuPy
    chunks, perhaps on a client without a GPU: the backend is checked against CuPy here and
    the rest validated with ``"auto"``; each task checks its own CUDA limits."""
    # the boundaries of a packed batch are host integers of any library, read by value
    xp = _validate.array_namespace(**{n: (x._meta if _is_dask_array(x) else x)
                                      for n, x in arrays.items()
                                      if n not in _validate.CU_SEQLENS})
    if xp is np:
        return backend
    _validate.check_backend(backend, xp)
    return "auto"


def _stand_in(x, label, name):
    """A zero-memory NumPy array of ``x``'s shape and dtype; a Dask ``x`` of unknown chunk
    sizes (after boolean indexing) is a ValueError naming it (``label``; ``name`` in the
    suggested call)."""
    if any(isinstance(n, float) and math.isnan(n) for n in x.shape):
        raise ValueError(f"{label} has unknown chunk sizes (shape {x.shape}); call "
                         f"{name}.compute_chunk_sizes() first")
    return np.broadcast_to(np.zeros((), dtype=x.dtype), x.shape)


def _as_dask(da, x):
    if _is_dask_array(x):
        return x
    return da.asarray(x if hasattr(x, "shape") else np.asarray(x))


def _batch_chunks(arrays, batch_shape):
    """The chunks of each batch axis: the refinement of those of `q`, `k` and `v` on the axis,
    where they are not broadcast (the options follow them)."""
    chunks = []
    for t, size in enumerate(batch_shape):
        seen = []
        for x in (arrays["q"], arrays["k"], arrays["v"]):
            axis = x.ndim - 2 - (len(batch_shape) - t)      # batch axes align to the right
            if axis >= 0 and x.shape[axis] == size:
                seen.append(x.chunks[axis])
        chunks.append(_refine(seen) if seen else (size,))
    return chunks


def _refine(chunkings):
    """The coarsest chunking whose boundaries include every boundary of ``chunkings`` (all of
    one axis): splitting chunks is a slice, merging them would be a copy."""
    cuts = sorted({c for chunks in chunkings for c in _bounds(chunks)})
    return tuple(b - a for a, b in zip(cuts, cuts[1:])) or (0,)


def _align(chunks, block):
    """``chunks`` of an axis with boundaries moved down to multiples of ``block``, and the
    matching chunks of the coarse (one entry per block) axis."""
    n = sum(chunks)
    cuts = sorted({c // block * block for c in _bounds(chunks)[:-1]} | {0, n})
    fine = tuple(b - a for a, b in zip(cuts, cuts[1:])) or (0,)
    coarse_cuts = [c // block for c in cuts[:-1]] + [-(-n // block)]
    return fine, tuple(b - a for a, b in zip(coarse_cuts, coarse_cuts[1:])) or (0,)


def _bounds(chunks):
    return [0, *itertools.accumulate(chunks)]


def _axis_kinds(x, name, p):
    """The logical axis of each dimension of argument ``name``: a batch index or a kind.

    Aligned from the right, as NumPy broadcasts: a 1-d ``bias`` of shape ``(Lk,)`` is a key
    axis and a ``dout`` of shape ``(Dv,)`` a head axis, whatever the lengths."""
    layout = _LAYOUT[name]
    if name == "bias" and p.bias_block is not None:
        layout = ("qb", "kb")
    kinds = list(range(len(p.batch_shape))) + list(layout)
    return kinds[len(kinds) - x.ndim:]


def _rechunk(x, name, p, batch_chunks, axis_chunks):
    """``x`` chunked as the graph needs: batch and sequence axes as the output's, broadcast
    (length-1) and "whole" axes in one chunk."""
    target = []
    for size, kind in zip(x.shape, _axis_kinds(x, name, p)):
        chunks = batch_chunks[kind] if isinstance(kind, int) else axis_chunks.get(kind)
        target.append((size,) if chunks is None or sum(chunks) != size else tuple(chunks))
    target = tuple(target)
    return x if x.chunks == target else x.rechunk(target)


def _block_key(x, name, p, b, iq, jk):
    """The key of the block of ``x`` that output block ``(b, iq)`` and key chunk ``jk`` read."""
    index = []
    for chunks, kind in zip(x.chunks, _axis_kinds(x, name, p)):
        if len(chunks) == 1:
            index.append(0)                    # one chunk: broadcast, whole or unsplit
        elif isinstance(kind, int):
            index.append(b[kind])
        else:
            index.append(iq if kind in ("q", "qb") else jk)
    return (x.name, *index)


def _reduce_tree(dsk, name, where, parts, combine, Task, TaskRef):
    """Add to ``dsk`` the tasks that reduce the results ``parts`` with ``combine`` (in order,
    fan-in SPLIT_EVERY; a group of one passes up as it is); return the key of the result."""
    level = 0
    while len(parts) > 1:
        reduced = []
        for g in range(0, len(parts), SPLIT_EVERY):
            group = parts[g:g + SPLIT_EVERY]
            if len(group) == 1:
                reduced.append(group[0])
                continue
            key = (name, *where, level, g // SPLIT_EVERY)
            dsk[key] = Task(key, combine, *(TaskRef(s) for s in group))
            reduced.append(key)
        parts, level = reduced, level + 1
    return parts[0]


def _state_arrays(da, name, dsk, deps, states, chunks, dv, out_dtype, lse_dtype, meta):
    """Dask arrays ``out`` and ``lse`` over the states ``{block index: key}`` of ``dsk``."""
    from dask.highlevelgraph import HighLevelGraph
    from dask.task_spec import Task, TaskRef

    state_name, lse_name = f"{name}-state", f"{name}-lse"
    graph = HighLevelGraph.from_collections(state_name, dsk, dependencies=deps)
    out_layer = {(name, *i, 0): Task((name, *i, 0), _take_out, TaskRef(s), out_dtype)
                 for i, s in states.items()}
    out = da.Array(_with_layer(graph, name, out_layer, state_name), name,
                   chunks=chunks + ((dv,),),
                   meta=np.empty_like(meta, shape=(0,) * (len(chunks) + 1), dtype=out_dtype))
    lse_layer = {(lse_name, *i): Task((lse_name, *i), _take_lse, TaskRef(s))
                 for i, s in states.items()}
    lse = da.Array(_with_layer(graph, lse_name, lse_layer, state_name), lse_name,
                   chunks=chunks,
                   meta=np.empty_like(meta, shape=(0,) * len(chunks), dtype=lse_dtype))
    return out, lse


def _with_layer(graph, name, layer, depends_on):
    from dask.highlevelgraph import HighLevelGraph

    return HighLevelGraph({**graph.layers, name: layer},
                          {**graph.dependencies, name: {depends_on}})


# the tasks (module-level functions: pickled by reference for distributed workers)


def _chunk_state(chunk_attention, options, j0, names, *blocks):
    """One (query chunk, key chunk) pair: ``(out, lse)`` over the chunk's keys."""
    arrays = dict(zip(names, blocks))
    lengths = arrays.get("kv_lengths")
    if lengths is not None:
        xp = _validate.array_namespace(q=arrays["q"])
        lengths = xp.asarray(lengths)
        # keys [j0, j1) are this chunk's 0 .. j1 - j0; a negative length is left for the
        # call to refuse with its usual message
        arrays["kv_lengths"] = xp.where(lengths < 0, lengths, xp.maximum(lengths - j0, 0))
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    return chunk_attention(q, k, v, **arrays, **options)


def _chunk_gradients(chunk_backward, options, j0, names, *blocks):
    """One (query chunk, key chunk) pair of the backward pass: its Gradients."""
    arrays = dict(zip(names, blocks))
    lengths = arrays.get("kv_lengths")
    if lengths is not None:
        xp = _validate.array_namespace(q=arrays["q"])
        lengths = xp.asarray(lengths)
        arrays["kv_lengths"] = xp.where(lengths < 0, lengths, xp.maximum(lengths - j0, 0))
    positional = [arrays.pop(n) for n in ("dout", "q", "k", "v", "out", "lse")]
    with _lse_check.partial_keys():            # the global lse, this chunk's keys
        return chunk_backward(*positional, **arrays, **options)


def _rows(x, a, b, n, axis=-2):
    """Rows ``[a, b)`` of ``x`` along ``axis`` of length ``n`` (an axis of length 1 that
    broadcasts against it stays as it is)."""
    if x.shape[axis] != n:
        return x
    index = (Ellipsis, slice(a, b)) + (slice(None),) * (-1 - axis)
    return x[index]


def _varlen_keywords(options, call):
    qa, qb, ka, kb, cu_q, cu_k, q_offset, k_offset = call
    return dict(options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_offset=q_offset,
                k_offset=k_offset)


def _varlen_parts(arrays, call, n_q, n_k):
    """The arguments of one call of a packed pair: its rows of the query-chunked and
    key-chunked blocks, the rest as they are."""
    qa, qb, ka, kb = call[:4]
    parts = {}
    for name, x in arrays.items():
        kinds = _LAYOUT[name]
        if "q" in kinds:
            axis = kinds.index("q") - len(kinds)
            parts[name] = _rows(x, qa, qb, n_q, axis) if x.ndim >= -axis else x
        elif "k" in kinds:
            axis = kinds.index("k") - len(kinds)
            parts[name] = _rows(x, ka, kb, n_k, axis) if x.ndim >= -axis else x
        else:
            parts[name] = x
    return parts


def _chunk_varlen_state(chunk_attention, options, calls, n_q, names, *blocks):
    """One (query chunk, key chunk) pair of a packed batch: ``(out, lse)`` over the chunk's
    keys, from its calls (:func:`_varlen_calls`), in the accumulation dtype; rows of no call
    (their sequence has no visible key in the chunk) get 0 and ``-inf``."""
    arrays = dict(zip(names, blocks))
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    xp = _validate.array_namespace(q=q)
    n_k = k.shape[-2]
    out = lse = None
    for call in calls:
        parts = _varlen_parts(arrays, call, n_q, n_k)
        o, s = chunk_attention(parts.pop("q"), parts.pop("k"), parts.pop("v"), **parts,
                               **_varlen_keywords(options, call))
        if out is None:
            out = xp.zeros(o.shape[:-2] + (n_q, o.shape[-1]), dtype=s.dtype)
            lse = xp.full(o.shape[:-2] + (n_q,), -np.inf, dtype=s.dtype)
        out[..., call[0]:call[1], :] = o
        lse[..., call[0]:call[1]] = s
    return out, lse


def _chunk_varlen_gradients(chunk_backward, options, calls, names, *blocks):
    """One (query chunk, key chunk) pair of the backward of a packed batch: a Gradients of
    its blocks' shapes, each call's gradients at its rows (the tables' summed), in the
    accumulation dtype of each gradient."""
    from .._gradients import Gradients

    arrays = dict(zip(names, blocks))
    xp = _validate.array_namespace(q=arrays["q"])
    n_q, n_k = arrays["q"].shape[-2], arrays["k"].shape[-2]
    totals = {name: xp.zeros(x.shape, dtype=accumulation_dtype(x.dtype))
              for name, x in arrays.items() if name in _GRADIENT_OF}
    for call in calls:
        parts = _varlen_parts(arrays, call, n_q, n_k)
        positional = [parts.pop(n) for n in ("dout", "q", "k", "v", "out", "lse")]
        with _lse_check.partial_keys():        # the global lse, this chunk's keys
            g = chunk_backward(*positional, **parts, **_varlen_keywords(options, call))
        for name, total in totals.items():
            kinds = _LAYOUT[name]
            grad = getattr(g, _GRADIENT_OF[name])
            if "q" in kinds or "k" in kinds:
                side = "q" if "q" in kinds else "k"
                a, b = (call[0], call[1]) if side == "q" else (call[2], call[3])
                axis = kinds.index(side) - len(kinds)
                index = (Ellipsis, slice(a, b)) + (slice(None),) * (-1 - axis)
                total[index] += grad
            else:
                total += grad
    return Gradients(**{f: totals.get(n) for n, f in _GRADIENT_OF.items()})


def _take_gradient(gradients, field, acc_dtype):
    """One gradient of a task's Gradients, in the accumulation dtype of the sums."""
    return getattr(gradients, field).astype(acc_dtype, copy=False)


def _sum_arrays(*arrays):
    total = arrays[0]
    for x in arrays[1:]:
        total = total + x
    return total


def _zeros_of(block, dtype):
    """The gradient of a block no task reads: zeros of its shape, in its library."""
    xp = _validate.array_namespace(block=block)
    return xp.zeros(block.shape, dtype=dtype)


def _cast(x, dtype):
    return x.astype(dtype, copy=False)


def _merge_group(*states):
    """Merge states of one query block; the outputs in the accumulation dtype of ``lse``,
    so a 16-bit output is rounded once, at the end, not at every level of the tree."""
    xp = _validate.array_namespace(out=states[0][0])
    lse_dtype = states[0][1].dtype
    return merge_states(xp, [o.astype(lse_dtype, copy=False) for o, _ in states],
                        [s for _, s in states])


def _empty_state(q, shape, dv, acc_dtype):
    """The state of queries that see no key: output 0, ``lse = -inf``."""
    xp = _validate.array_namespace(q=q)
    return xp.zeros(shape + (dv,), dtype=acc_dtype), xp.full(shape, -np.inf, dtype=acc_dtype)


def _take_out(state, dtype):
    return state[0].astype(dtype, copy=False)


def _take_lse(state):
    return state[1]


# --------------------------------------------------------------------------------------------
# softmax, log_softmax, logsumexp


def is_dask_softmax(x, mask=None) -> bool:
    """Whether ``x`` or ``mask`` of a call of the softmax family is a Dask array."""
    return _is_dask_array(x) or _is_dask_array(mask)


def softmax(chunk_function, /, x, axis=-1, *, mask=None, mode="softmax", keepdims=False,
            backend="auto"):
    """``cuonline.softmax``, ``log_softmax`` or ``logsumexp`` (``mode``) on Dask arrays: a
    Dask array of the result, nothing computed.

    Validated at once on zero-memory stand-ins (the in-memory call's errors). Blocks map
    along the other axes. Where `axis` is one chunk, each block is one call of
    ``chunk_function`` (the public function of ``mode``, which the engines cannot import) on
    its block and `mask` block, so the result is the in-memory call's. Where `axis` is
    chunked, each block gives its state ``(m, l)`` (the slice's max, ``-inf`` where nothing is
    visible, and ``sum(exp(x - m))``, in the accumulation dtype); the states of one slice
    merge exactly, ``m = max m_i``, ``l = sum l_i exp(m_i - m)``, by a tree of fixed fan-in
    :data:`SPLIT_EVERY` in block order; each block then gives ``exp(x - m) / l`` or
    ``(x - m) - log(l)`` (``m + log(l)`` for logsumexp), as the NumPy engine does, in the
    array operations of the chunks' library.
    """
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
    from dask.task_spec import Task, TaskRef

    backend_checked = _stand_in_backend({"x": x, "mask": mask}, backend)
    stand_ins = {n: (_stand_in(a, f"`{n}`", n) if hasattr(a, "shape") else a)
                 for n, a in (("x", x), ("mask", mask))}
    p = _validate.validate_axis_input(stand_ins["x"], axis, stand_ins["mask"], backend_checked,
                                      mode=mode, keepdims=keepdims)
    axis, dtype = p.axis, p.dtype
    x = _as_dask(da, x)
    arrays = [x]
    if mask is not None:
        arrays.append(da.broadcast_to(_as_dask(da, mask), x.shape).rechunk(x.chunks))
    name = f"cuonline-{mode.replace('_', '-')}-" + tokenize(
        *(a.name for a in arrays), axis, mode, p.keepdims, backend,
        chunk_function.__module__, chunk_function.__qualname__)
    reduces = mode == "logsumexp"
    out_chunks = list(x.chunks)
    if reduces:
        out_chunks[axis] = (1,)

    dsk = {}
    others = [range(n) if a != axis else range(1) for a, n in enumerate(x.numblocks)]
    for other in itertools.product(*others):
        def reads(j, other=other):
            index = other[:axis] + (j,) + other[axis + 1:]
            return index, [TaskRef((a.name, *index)) for a in arrays]

        if x.numblocks[axis] == 1:
            index, refs = reads(0)
            key = (name, *index)
            dsk[key] = Task(key, _softmax_call, chunk_function, mode, axis, True, backend,
                            *refs)
            continue
        parts = []
        for j in range(x.numblocks[axis]):
            index, refs = reads(j)
            key = (f"{name}-state", *index)
            dsk[key] = Task(key, _softmax_state, axis, *refs)
            parts.append(key)
        state = TaskRef(_reduce_tree(dsk, f"{name}-merge", other, parts, _merge_softmax_states,
                                     Task, TaskRef))
        if reduces:
            key = (name, *other)
            dsk[key] = Task(key, _logsumexp_of_state, dtype, state)
            continue
        for j in range(x.numblocks[axis]):
            index, refs = reads(j)
            key = (name, *index)
            dsk[key] = Task(key, _softmax_finish, mode, dtype, state, *refs)

    graph = HighLevelGraph.from_collections(name, dsk, dependencies=arrays)
    result = da.Array(graph, name, chunks=tuple(out_chunks),
                      meta=np.empty_like(x._meta, shape=(0,) * x.ndim, dtype=dtype))
    return result.squeeze(axis) if reduces and not p.keepdims else result


def _softmax_call(chunk_function, mode, axis, keepdims, backend, x, mask=None):
    """The in-memory call on one block whose `axis` is whole."""
    extra = {"keepdims": keepdims} if mode == "logsumexp" else {}
    return chunk_function(x, axis, mask=mask, backend=backend, **extra)


def _softmax_state(axis, x, mask=None):
    """``(m, l)`` of a block along `axis` (with keepdims), in the accumulation dtype: ``m``
    the max of the visible entries (``-inf`` if none), ``l = sum(exp(x - m))``."""
    xp = _validate.array_namespace(x=x)
    _, shift, total = softmax_stats(xp, x, axis, mask)
    # stats shifts a slice with nothing visible by 0 (total 0); its max is -inf, so that a
    # merge does not scale the other blocks' sums against 0
    return xp.where(total == 0, -np.inf, shift), total


def _merge_softmax_states(*states):
    """One ``(m, l)`` of the states of consecutive blocks of a slice: ``m = max m_i``,
    ``l = sum l_i exp(m_i - m)``. A NaN (or, from a ``+inf`` entry, a NaN ``l``) stays NaN."""
    xp = _validate.array_namespace(m=states[0][0])
    tops = xp.stack([m for m, _ in states])
    top = tops.max(axis=0)
    shift = xp.where(xp.isinf(top), 0, top)        # no -inf - (-inf) where nothing is visible
    with np.errstate(invalid="ignore", over="ignore"):
        total = (xp.stack([l for _, l in states]) * xp.exp(tops - shift)).sum(axis=0)
    return top, total


def _finite_shift(top):
    xp = _validate.array_namespace(m=top)
    return xp.where(top == -np.inf, 0, top)        # as the NumPy engine: no -inf - (-inf)


def _softmax_finish(mode, dtype, state, x, mask=None):
    """softmax or log_softmax of one block from the merged state of its slices."""
    xp = _validate.array_namespace(x=x)
    top, total = state
    xa = x.astype(top.dtype, copy=False)
    if mask is not None:
        xa = xp.where(mask, xa, -np.inf)
    # a slice with nothing visible has l = 0: divided by (log of) 1, it stays 0 (-inf)
    norm = xp.where(total == 0, 1, total)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = xa - _finite_shift(top)
        out = xp.exp(d) / norm if mode == "softmax" else d - xp.log(norm)
    return out.astype(dtype, copy=False)


def _logsumexp_of_state(dtype, state):
    xp = _validate.array_namespace(m=state[0])
    top, total = state
    with np.errstate(divide="ignore", invalid="ignore"):
        return (_finite_shift(top) + xp.log(total)).astype(dtype, copy=False)


# --------------------------------------------------------------------------------------------
# merge


def merge(*states):
    """``cuonline.merge`` of states some of whose arrays are Dask arrays: an elementwise
    merge of the blocks (chunks of the states unified), returning Dask ``(out, lse)``."""
    import dask.array as da
    from dask.base import tokenize
    from dask.task_spec import Task, TaskRef

    metas, stand_ins = {}, []
    for n, state in enumerate(states):
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            stand_ins.append(state)            # refused by validate_merge with its message
            continue
        pair = []
        for i, x in enumerate(state):
            metas[f"states[{n}][{i}]"] = x._meta if _is_dask_array(x) else x
            if x is not None and hasattr(x, "shape") and hasattr(x, "dtype"):
                x = _stand_in(x, f"state {n}: `{('out', 'lse')[i]}`", f"states[{n}][{i}]")
            pair.append(x)
        stand_ins.append(tuple(pair))
    _validate.validate_merge(stand_ins)
    _validate.array_namespace(**metas)       # mixed libraries: the in-memory message

    pairs = [(_as_dask(da, o), _as_dask(da, s)) for o, s in states]
    ndim = pairs[0][1].ndim
    chunks = tuple(_refine([x.chunks[a] for pair in pairs for x in pair]) for a in range(ndim))
    dv = pairs[0][0].shape[-1]
    flat = []
    for o, s in pairs:
        flat += [o.rechunk(chunks + ((dv,),)), s.rechunk(chunks)]
    token = tokenize(*(x.name for x in flat))
    name = f"cuonline-merge-{token}"
    dsk, keys = {}, {}
    for index in itertools.product(*(range(len(c)) for c in chunks)):
        refs = [TaskRef((x.name, *index, 0) if j % 2 == 0 else (x.name, *index))
                for j, x in enumerate(flat)]
        key = (f"{name}-merge", *index)
        dsk[key] = Task(key, _merge_blocks, *refs)
        keys[index] = key
    out_dtype, lse_dtype = (np.dtype(x.dtype).newbyteorder("=") for x in flat[:2])
    return _state_arrays(da, name, dsk, flat, keys, chunks, dv, out_dtype, lse_dtype,
                         flat[0]._meta)


def _merge_blocks(*flat):
    """``cuonline.merge`` of one block of every state: ``flat`` is out0, lse0, out1, ..."""
    xp = _validate.array_namespace(out=flat[0])
    native = [x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("=")) for x in flat]
    return merge_states(xp, native[0::2], native[1::2])


# --------------------------------------------------------------------------------------------
# attention_stats (issue 21)

# the query weights of `received` follow the queries
_LAYOUT["query_weights"] = ("q",)
#: attention_stats' own keywords (the rest are the score options and backend, workers)
_STATS_KEYWORDS = ("entropy", "received", "query_weights", "top_k", "rows")
# the row statistics of AttentionStats, and whether each has a top_k axis
_ROW_FIELDS = {"lse": False, "entropy": False, "max_weight": False, "argmax": False,
               "top_indices": True, "top_weights": True}


def attention_stats(stats_class, /, q, k, **options):
    """``cuonline.attention_stats`` on Dask arrays: an ``AttentionStats`` (``stats_class``)
    of Dask arrays, nothing computed.

    The graph of :func:`attention` without values: a task per visible (query chunk, key
    chunk) pair computes the row state of its chunks (:class:`.numpy_stats.RowState`: the
    online-softmax state with the entropy's sum, the first key of the max and the best
    ``top_k`` keys, its key indices moved to the whole call's), and the states of a query
    chunk merge exactly, in key order, by a fixed tree; the merged state gives the row
    statistics. ``received``: a task per visible pair adds ``w^T P`` of its queries with their
    global ``lse``, summed per key chunk over the query chunks by a fixed tree. ``rows``
    (a NumPy array or list) are computed per pair from ``lse`` and placed in the order given.
    A packed batch's pairs make their calls (:func:`_varlen_calls`), their row states placed
    at the calls' rows (:func:`.numpy_varlen.place_rows`).
    """
    import dask.array as da
    from dask.task_spec import Task, TaskRef

    own = {n: options.pop(n, None) for n in _STATS_KEYWORDS}
    own["entropy"] = True if own["entropy"] is None else own["entropy"]
    own["received"] = False if own["received"] is None else own["received"]
    own["top_k"] = 0 if own["top_k"] is None else own["top_k"]
    if _is_dask_array(own["rows"]):
        raise TypeError("`rows` must be a NumPy array or a list with Dask inputs (its values "
                        "shape the graph), got a Dask array; pass rows.compute()")
    k = _as_dask(da, k)
    arrays = {"q": q, "k": k, "v": k[..., :0]}   # the statistics read no values
    p = _validate_on_stand_ins(dict(arrays), dict(options), _validate.validate_attention)
    metas = {n: (x._meta if _is_dask_array(x) else x) for n, x in (("q", q), ("k", k))}
    if _validate.array_namespace(**metas) is not np:
        raise ValueError("attention_stats on Dask arrays runs the NumPy engine on each chunk "
                         "(its row states merge across chunks); pass NumPy chunks "
                         "(x.map_blocks(cupy.asnumpy))")
    if options.get("backend") in ("cupy", "emulate"):
        raise ValueError(f"attention_stats on Dask arrays runs the NumPy engine on each chunk "
                         f"(its row states merge across chunks), got "
                         f"backend={options['backend']!r}; pass backend='auto' or 'numpy', "
                         f"or call it on NumPy or CuPy arrays for the CUDA kernels")
    weights = own["query_weights"]
    q_stand_in = _stand_in(q, "`q`", "q") if hasattr(q, "shape") else np.asarray(q)
    sp = _validate.validate_attention_stats(
        q_stand_in, _stand_in(k, "`k`", "k"), _options.Options(backend=options.get("backend",
                                                                                   "auto")),
        entropy=own["entropy"], received=own["received"], top_k=own["top_k"], rows=own["rows"],
        query_weights=(_stand_in(weights, "`query_weights`", "query_weights")
                       if _is_dask_array(weights) else weights))
    if weights is not None:
        arrays["query_weights"] = weights
    plan = _plan(da, arrays, options, p, _chunk_row_state)
    name = f"cuonline-attention-stats-{plan.token}"
    batch_sizes = plan.batch_chunks
    q_chunks, k_chunks = plan.axis_chunks["q"], plan.axis_chunks["k"]
    k_bounds = _bounds(k_chunks)

    def sizes(b):
        return tuple(c[t] for c, t in zip(batch_sizes, b))

    dsk, finished, lse_keys = {}, {}, {}
    row_options = dict(entropy=sp.entropy, top_k=sp.top_k)
    for b, iq, i0, i1, visible in plan.blocks:
        parts = []
        for jk, j0 in visible:
            key = (f"{name}-rows", *b, iq, jk)
            refs = [TaskRef(r) for r in plan.reads(b, iq, jk)]
            if plan.calls is not None:
                dsk[key] = Task(key, _chunk_varlen_row_state, plan.task_options, row_options,
                                plan.calls[iq, jk], i1 - i0, j0, plan.names, *refs)
            else:
                per_task = dict(plan.task_options, q_offset=p.diagonal_offset + i0,
                                k_offset=j0)
                dsk[key] = Task(key, _chunk_row_state, per_task, row_options, j0, plan.names,
                                *refs)
            parts.append(key)
        if not parts:
            key = (f"{name}-rows", *b, iq, "empty")
            dsk[key] = Task(key, _empty_row_state, math.prod(sizes(b)) * (i1 - i0), sp.top_k,
                            p.acc_dtype, sp.entropy)
            parts.append(key)
        state = _reduce_tree(dsk, f"{name}-merge", b + (iq,), parts, _merge_row_states,
                             Task, TaskRef)
        key = (f"{name}-finish", *b, iq)
        dsk[key] = Task(key, _finish_rows, TaskRef(state), sizes(b) + (i1 - i0,))
        finished[b + (iq,)] = key
        lse_keys[b, iq] = (f"{name}-lse-of", *b, iq)
        dsk[lse_keys[b, iq]] = Task(lse_keys[b, iq], _take_field, TaskRef(key), "lse")

    received_parts, row_parts = {}, {}
    rows = None if sp.rows is None else np.asarray(sp.rows)
    for b, iq, i0, i1, visible in plan.blocks:
        local = None if rows is None else np.flatnonzero((rows >= i0) & (rows < i1))
        for jk, j0 in visible:
            per_task = dict(plan.task_options, q_offset=p.diagonal_offset + i0, k_offset=j0)
            reads = [TaskRef(r) for r in plan.reads(b, iq, jk)]
            # packed batches: the pair's calls instead of its positions
            varlen = None if plan.calls is None else (plan.task_options, plan.calls[iq, jk],
                                                      i1 - i0)
            if sp.received:
                key = (f"{name}-received-part", *b, iq, jk)
                if varlen:
                    dsk[key] = Task(key, _chunk_varlen_received, *varlen, plan.names,
                                    TaskRef(lse_keys[b, iq]), *reads)
                else:
                    dsk[key] = Task(key, _chunk_received, per_task, j0, plan.names,
                                    TaskRef(lse_keys[b, iq]), *reads)
                received_parts.setdefault(b + (jk,), []).append(key)
            if local is not None and local.size:
                key = (f"{name}-weights-part", *b, iq, jk)
                if varlen:
                    dsk[key] = Task(key, _chunk_varlen_weights, *varlen, rows[local] - i0,
                                    plan.names, TaskRef(lse_keys[b, iq]), *reads)
                else:
                    dsk[key] = Task(key, _chunk_weights, per_task, j0, rows[local] - i0,
                                    plan.names, TaskRef(lse_keys[b, iq]), *reads)
                row_parts.setdefault(b + (jk,), []).append((local, key))

    graph_deps = list(plan.arrays.values())
    from dask.highlevelgraph import HighLevelGraph

    graph = HighLevelGraph.from_collections(f"{name}-state", dsk, dependencies=graph_deps)
    batch_keys = list(itertools.product(*(range(len(c)) for c in batch_sizes)))
    fields = {}
    for field, has_k in _ROW_FIELDS.items():
        if (field == "entropy" and not sp.entropy) or (has_k and not sp.top_k):
            fields[field] = None
            continue
        dtype = np.int64 if field in ("argmax", "top_indices") else p.acc_dtype
        out_name = f"{name}-{field}"
        tail = (0,) if has_k else ()
        layer = {(out_name, *i, *tail): Task((out_name, *i, *tail), _take_field, TaskRef(f),
                                             field) for i, f in finished.items()}
        chunks = tuple(batch_sizes) + (q_chunks,) + (((sp.top_k,),) if has_k else ())
        fields[field] = da.Array(_with_layer(graph, out_name, layer, f"{name}-state"),
                                 out_name, chunks=chunks,
                                 meta=np.empty((0,) * len(chunks), dtype=dtype))
    for field, parts_of, tail in (("received", received_parts, ()),
                                  ("weights", row_parts, (0,))):
        if (field == "received" and not sp.received) or (field == "weights" and rows is None):
            fields[field] = None
            continue
        out_name, layer = f"{name}-{field}", {}
        for b in batch_keys:
            for jk in range(len(k_chunks)):
                key = (out_name, *b, *tail, jk)
                width = k_bounds[jk + 1] - k_bounds[jk]
                parts = parts_of.get(b + (jk,), [])
                if field == "received":
                    shape = sizes(b) + (width,)
                    if not parts:
                        layer[key] = Task(key, np.zeros, shape, p.acc_dtype)
                        continue
                    total = _reduce_tree(dsk, f"{name}-received-sum", b + (jk,), parts,
                                         _sum_arrays, Task, TaskRef)
                    layer[key] = Task(key, _cast, TaskRef(total), p.acc_dtype)
                else:
                    shape = sizes(b) + (rows.size, width)
                    layer[key] = Task(key, _place_rows, shape, p.acc_dtype,
                                      [pos for pos, _ in parts],
                                      *(TaskRef(r) for _, r in parts))
        graph = HighLevelGraph.from_collections(f"{name}-state", dsk, dependencies=graph_deps)
        chunks = tuple(batch_sizes) + (((rows.size,),) if tail else ()) + (k_chunks,)
        fields[field] = da.Array(_with_layer(graph, out_name, layer, f"{name}-state"),
                                 out_name, chunks=chunks,
                                 meta=np.empty((0,) * len(chunks), dtype=p.acc_dtype))
    return stats_class(**fields)


def _stats_task_problem(options, j0, names, blocks, **stats):
    """The StatsProblem of one (query chunk, key chunk) pair: its chunks, its positions, its
    keys' share of ``kv_lengths``."""
    from .._options import Options

    arrays = dict(zip(names, blocks))
    lengths = arrays.get("kv_lengths")
    if lengths is not None:
        lengths = np.asarray(lengths)
        arrays["kv_lengths"] = np.where(lengths < 0, lengths, np.maximum(lengths - j0, 0))
    q, k = arrays.pop("q"), arrays.pop("k")
    arrays.pop("v")
    weights = arrays.pop("query_weights", None)
    if stats.get("received"):
        stats["query_weights"] = weights
    return _validate.validate_attention_stats(q, k, Options(**arrays, **options), **stats)


def _chunk_row_state(options, row_options, j0, names, *blocks):
    """One pair's RowState, its key indices those of the whole call."""
    from . import numpy_stats

    sp = _stats_task_problem(options, j0, names, blocks, **row_options)
    return numpy_stats.row_state(sp).shifted(j0)


def _chunk_received(options, j0, names, lse, *blocks):
    """One pair's ``w^T P`` over its keys, with its queries' global ``lse``."""
    from . import numpy_stats

    sp = _stats_task_problem(options, j0, names, blocks, entropy=False, received=True)
    p = sp.scores
    return numpy_stats.received(p, lse, sp.query_weights, p.workers or 1)


def _chunk_weights(options, j0, rows, names, lse, *blocks):
    """The rows ``rows`` (local indices) of one pair's P."""
    from . import numpy_stats

    sp = _stats_task_problem(options, j0, names, blocks, entropy=False)
    p = sp.scores
    return numpy_stats.weights_of_rows(p, lse, np.asarray(rows, dtype=np.int64), p.workers or 1)


def _call_stats_problem(options, call, parts, **stats):
    """The StatsProblem of one call of a packed pair (:func:`_varlen_calls`) on its
    ``parts`` (:func:`_varlen_parts`)."""
    from .._options import Options

    parts = dict(parts)
    q, k = parts.pop("q"), parts.pop("k")
    parts.pop("v")
    weights = parts.pop("query_weights", None)
    if stats.get("received"):
        stats["query_weights"] = weights
    return _validate.validate_attention_stats(
        q, k, Options(**parts, **_varlen_keywords(options, call)), **stats)


def _stats_engine(sp):
    """The module that runs the passes of ``sp``: the packed driver for a packed call."""
    from . import numpy_stats, numpy_varlen

    return numpy_stats if sp.scores.cu_seqlens_q is None else numpy_varlen


def _chunk_varlen_row_state(options, row_options, calls, n_q, j0, names, *blocks):
    """The RowState of the query chunk of a packed pair over its keys, from its calls (rows
    of no call: a row that saw nothing), key indices those of the whole call."""
    from .numpy_stats import RowState
    from .numpy_varlen import place_rows

    arrays = dict(zip(names, blocks))
    n_k = arrays["k"].shape[-2]
    state = None
    for call in calls:
        sp = _call_stats_problem(options, call, _varlen_parts(arrays, call, n_q, n_k),
                                 **row_options)
        batch = sp.scores.batch_shape
        part = _stats_engine(sp).row_state(sp, sp.scores.workers or 1).shifted(j0 + call[2])
        if state is None:
            state = RowState(math.prod(batch) * n_q, sp.top_k, sp.scores.acc_dtype,
                             sp.entropy)
        place_rows(state, part, batch, n_q, slice(call[0], call[1]))
    return state


def _chunk_varlen_received(options, calls, n_q, names, lse, *blocks):
    """``w^T P`` of a packed pair over its key chunk, with its queries' global ``lse``."""
    arrays = dict(zip(names, blocks))
    n_k = arrays["k"].shape[-2]
    total = None
    for call in calls:
        sp = _call_stats_problem(options, call, _varlen_parts(arrays, call, n_q, n_k),
                                 entropy=False, received=True)
        p = sp.scores
        got = _stats_engine(sp).received(p, lse[..., call[0]:call[1]], sp.query_weights,
                                         p.workers or 1)
        if total is None:
            total = np.zeros(got.shape[:-1] + (n_k,), dtype=got.dtype)
        total[..., call[2]:call[3]] += got
    return total


def _chunk_varlen_weights(options, calls, n_q, rows, names, lse, *blocks):
    """The rows ``rows`` (local to the query chunk) of a packed pair's P over its key
    chunk, 0 where a row's sequence has no keys in the chunk."""
    arrays = dict(zip(names, blocks))
    n_k = arrays["k"].shape[-2]
    rows = np.asarray(rows, dtype=np.int64)
    batch = np.broadcast_shapes(arrays["q"].shape[:-2], arrays["k"].shape[:-2])
    acc = accumulation_dtype(arrays["q"].dtype)
    out = np.zeros(batch + (rows.size, n_k), dtype=acc)
    for call in calls:
        where = np.flatnonzero((rows >= call[0]) & (rows < call[1]))
        if not where.size:
            continue
        sp = _call_stats_problem(options, call, _varlen_parts(arrays, call, n_q, n_k),
                                 entropy=False)
        p = sp.scores
        out[..., where, call[2]:call[3]] = _stats_engine(sp).weights_of_rows(
            p, lse[..., call[0]:call[1]], rows[where] - call[0], p.workers or 1)
    return out


def _empty_row_state(n, top_k, acc_dtype, entropy):
    from .numpy_stats import RowState

    return RowState(n, top_k, acc_dtype, entropy)


def _merge_row_states(*states):
    """Merge the states of one query chunk over consecutive key chunks, in key order."""
    import copy

    merged = copy.copy(states[0])              # the inputs stay as they are
    for later in states[1:]:
        merged.merge(later)
    return merged


def _finish_rows(state, shape):
    from .numpy_stats import finished

    return finished(state, shape)


def _take_field(fields, name):
    return fields[name]


def _place_rows(shape, dtype, positions, *pieces):
    """The block of the requested rows: each piece's rows at their positions, zeros where no
    query chunk that holds the row sees these keys."""
    out = np.zeros(shape, dtype=dtype)
    for where, piece in zip(positions, pieces):
        out[..., where, :] = piece
    return out
