"""Compiled task loops of the NumPy engine (numba): a query block's whole walk over its key
tiles, the BLAS products called from compiled code.

The engine's Python loop (:func:`cuonline.engines.numpy._online`) spends, per key tile, tens
of microseconds between its calls (the score pipeline, the window band, a ctypes call of about
7 µs per product, a new score tile), more on the diagonal tile of causal attention, whose
products run per group of 128 rows, and it holds the GIL meanwhile, so the engine's threads
wait on each other. :func:`forward_walk` runs a query block's walk in one compiled call that
holds no GIL: for each tile, ``q kᵀ`` by ``cblas_?gemm`` (over the columns each group of rows
may see, :meth:`.numpy_scores.ScorePipeline.row_spans`' rule), the tile kernel
:func:`._tile_kernels.online_softmax_tile`, and ``P v`` added into the output by
``cblas_?gemm``, with one score buffer for the task; :func:`forward_stack` runs it for each
element of a stack of short sequences (:func:`cuonline.engines.numpy.attend_stacked`), one
call per stack. :func:`backward_block` does the same for
the query tiles of one key block of the backward (:mod:`.numpy_backward`): its five products
and :func:`._tile_kernels.backward_tile`; :func:`backward_stack` runs it for each element of a
stack of short sequences. The products are the Python loop's calls on the same
library with the same shapes, transposes and leading dimensions (:func:`.cblas.layout_of`, the
one map from views to CBLAS's arguments, compiled here too), so the results are the same to
the bit; ``tests/test_task_kernels.py`` compares them. Measured on a 2-core AMD EPYC
(docs/performance.md, machine B's kind): 0.8-1.0 of the Python loop's time on one core,
0.65-0.99 on two threads, the most for causal attention.

They take the plain score only (the scale and the window band; ``kv_lengths`` shortens the
key range before them), or it with ALiBi's term (:func:`_add_alibi`, after each tile's
product), and operands whose rows CBLAS reads in place; the backward's also every
operand finite and every row seeing a key, and it hands a tile whose P or dS is not finite
back to the Python loop, which keeps NaN in the rows it belongs to. Every other case is the
Python loop's.

The library is called through its function's address (:meth:`.cpu_blas.Cblas.address`),
passed as an integer, so that the compiled code is cached on disk like the tile kernels' and
serves any library: :func:`_gemm` is an LLVM ``inttoptr`` and a C call of CBLAS's row-major
``?gemm``, compiled for 32- and for 64-bit integers, the flag ``wide`` choosing. That cache
is dropped when ``_tile_kernels.py`` or ``cblas.py`` changes as well as this file
(:func:`_stamped_with`; numba's own rule looks at this file only).
"""

from __future__ import annotations

import hashlib

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from . import _tile_kernels, cblas
from ._tile_kernels import (backward_tile, clip, compiled, flush_subnormals,
                            full_vector_width, normalise_rows, restore_subnormals,
                            online_softmax_tile)
from .cblas import ROW_MAJOR, layout_of

_layout = numba.njit(layout_of)


@intrinsic
def _gemm(typingctx, address, wide, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc):
    """``cblas_?gemm(RowMajor, trans_a, trans_b, m, n, k, 1, a, lda, b, ldb, beta, c, ldc)``
    of the function at ``address``; ``wide``: its integers are 64-bit (else 32). ``a``, ``b``,
    ``c``: addresses; the dtype is ``beta``'s."""
    if beta not in (types.float32, types.float64) or not all(
            isinstance(x, types.Integer) for x in (address, trans_a, trans_b, m, n, k, a, lda,
                                                   b, ldb, c, ldc)):
        return None

    def codegen(context, builder, sig, args):
        real = ir.FloatType() if beta == types.float32 else ir.DoubleType()
        i32, ptr = ir.IntType(32), real.as_pointer()
        address_, wide_, ta, tb, m_, n_, k_, a_, lda_, b_, ldb_, beta_, c_, ldc_ = args
        a_, b_, c_ = (builder.inttoptr(x, ptr) for x in (a_, b_, c_))
        with builder.if_else(wide_) as (w64, w32):
            for branch, bits in ((w64, 64), (w32, 32)):
                with branch:
                    blasint = ir.IntType(bits)

                    def integer(x):
                        return builder.trunc(x, blasint) if bits < 64 else x

                    fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, blasint, blasint,
                                                           blasint, real, ptr, blasint, ptr,
                                                           blasint, real, ptr, blasint])
                    fn = builder.inttoptr(address_, fnty.as_pointer())
                    builder.call(fn, [i32(ROW_MAJOR), builder.trunc(ta, i32),
                                      builder.trunc(tb, i32), integer(m_), integer(n_),
                                      integer(k_), real(1.0), a_, integer(lda_), b_,
                                      integer(ldb_), beta_, c_, integer(ldc_)])
        return context.get_dummy_value()

    i64 = types.int64
    sig = types.none(i64, types.boolean, i64, i64, i64, i64, i64, i64, i64, i64, i64, beta,
                     i64, i64)
    return sig, codegen


@intrinsic
def _pointer(typingctx, address, like):
    """A pointer to numbers of ``like``'s type at the integer ``address``, for
    :func:`numba.carray`."""
    if not isinstance(address, types.Integer) or not isinstance(like, types.Number):
        return None
    pointer = types.CPointer(like)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


def unowned(a):
    """A view of the C-ordered array ``a`` that holds no reference to its memory (``a``
    itself where it is not C-ordered), for compiled code only: the views taken of it, a row,
    a slice, a tile, then count no references either. Numba counts a view's references to
    its parent's memory with atomic instructions, as many as a loop takes views; in the
    forward stacks of 16-query elements they were 9% of a call. The caller keeps ``a`` alive
    while the view is used (a compiled function's own arguments live until it returns)."""


@intrinsic
def _keep_alive(typingctx, x):
    """Nothing, in code; to numba, a use of ``x``, which it therefore releases no sooner
    (numba frees a variable's memory after its last use): the owner of :func:`unowned` views
    kept until their last use."""
    def codegen(context, builder, sig, args):
        return context.get_dummy_value()

    return types.none(x), codegen


@overload(unowned)
def _unowned_overload(a):
    if not isinstance(a, types.Array):
        return None
    if a.layout != "C":
        return lambda a: a
    kind = a.dtype

    def impl(a):
        return numba.carray(_pointer(a.ctypes.data, kind(0)), a.shape)

    return impl


@numba.njit
def _product(gemm, wide, m, n, k, a, a_step, a_col, b, b_step, b_col, beta, c, c_step, size):
    """``c = a @ b + beta * c`` of an (m, k) ``a`` and a (k, n) ``b`` at the given addresses,
    with rows and columns the given bytes apart (``c``'s columns contiguous): the call
    :func:`.cpu_blas.product` makes for the same views (:func:`.cblas.layout_of`)."""
    ta, lda = _layout(m, k, a_step, a_col, size)
    tb, ldb = _layout(k, n, b_step, b_col, size)
    _, ldc = _layout(m, n, c_step, size, size)
    _gemm(gemm, wide, ta, tb, m, n, k, a, lda, b, ldb, beta, c, ldc)


@numba.njit
def _spans(lo, hi, w, span_rows, c0s, c1s):
    """``ScorePipeline.row_spans``' rule for a tile of ``w`` keys whose row ``i`` sees the
    columns ``[lo[i], hi[i])`` (not clipped): the columns ``[c0s[g], c1s[g])`` that each group
    ``g`` of ``span_rows`` rows may see, and the row count per group; one group of every row
    and column where the groups would cover more than 3/4 of the tile."""
    n = lo.shape[0]
    if n >= 2 * span_rows:
        area = 0
        for g in range((n + span_rows - 1) // span_rows):
            r0, r1 = g * span_rows, min((g + 1) * span_rows, n)
            c0, c1 = w, 0
            for i in range(r0, r1):
                c0 = min(c0, clip(lo[i], 0, w))
                c1 = max(c1, clip(hi[i], 0, w))
            c0s[g], c1s[g] = c0, max(c0, c1)
            area += (r1 - r0) * (c1s[g] - c0)
        if 4 * area <= 3 * n * w:
            return span_rows
    c0s[0], c1s[0] = 0, w
    return n


@numba.njit(fastmath={"nsz"})
def _alibi_term(slope, distance):
    """``-(slope * distance)``, compiled without ``contract``: the product rounds before the
    logit adds it (no FMA), as :meth:`.numpy_scores.ScorePipeline.alibi_band`'s does."""
    return -(slope * distance)


@numba.njit(fastmath=_tile_kernels.FASTMATH)
def _add_alibi(tile, band, slope, key0, diag0, lo, hi):
    """ALiBi's term ``-(slope * |j - (diag0 + i)|)`` added to the columns ``[lo[i], hi[i])``
    (clipped) of each row ``i`` of a tile whose column 0 is key ``key0``: the places its row
    sees (the tile kernel masks the others whatever they hold). The term depends on the
    distance only: the tile's ``n + w - 1`` distances are worked out once, into ``band``, and
    each row adds a slice of them (a product per score took 30% of a plain tile's time)."""
    full_vector_width()
    n, w = tile.shape
    nearest = key0 - (diag0 + n - 1)                    # the distance of row n - 1, column 0
    for t in range(n + w - 1):
        band[t] = _alibi_term(slope, tile.dtype.type(abs(nearest + t)))
    for i in range(n):
        a = clip(lo[i], 0, w)
        b = clip(hi[i], a, w)
        row = tile[i, a:b]
        terms = band[n - 1 - i + a:n - 1 - i + b]
        for j in range(row.shape[0]):
            row[j] += terms[j]


@numba.njit(fastmath=_tile_kernels.FASTMATH, error_model="numpy")
def _walk_scratch(n, span_rows, band, like):
    """The scratch of :func:`forward_walk` for ``n`` query rows, ``(lo, hi, c0s, c1s, band)``:
    ``band`` elements for ALiBi's terms (0 without them), floats of ``like``'s dtype."""
    lo = np.empty(n, dtype=np.int64)
    hi = np.empty(n, dtype=np.int64)
    c0s = np.empty(n // span_rows + 1, dtype=np.int64)
    c1s = np.empty(n // span_rows + 1, dtype=np.int64)
    return lo, hi, c0s, c1s, np.empty(band, dtype=like.dtype)


def _walk_impl(q, ldq, k, ldk, v, ldv, d, m, l, o, s, j_lo, j_hi, width, lo0, hi0, span_rows,
               gemm, wide, alibi, slope, diag0, lo, hi, c0s, c1s, band):
    full_vector_width()              # the tile kernel keeps its width, should LLVM inline it
    n, dv = o.shape
    if n == 0 or j_hi <= j_lo:
        return
    zero, one = s.dtype.type(0), s.dtype.type(1)
    size = s.itemsize
    sa, oa = np.int64(s.ctypes.data), np.int64(o.ctypes.data)
    for js in range(j_lo, j_hi, width):
        w = min(width, j_hi - js)
        for i in range(n):
            lo[i] = lo0[i] - js
            hi[i] = hi0[i] - js
        rows = _spans(lo, hi, w, span_rows, c0s, c1s)
        # q kT over each group's columns; the tile kernel zeroes every column a row does not
        # see, those outside the group's included
        for g in range((n + rows - 1) // rows):
            r0, r1, c0, c1 = g * rows, min((g + 1) * rows, n), c0s[g], c1s[g]
            if c1 > c0:
                _product(gemm, wide, r1 - r0, c1 - c0, d, q + r0 * ldq * size, ldq * size,
                         size, k + (js + c0) * ldk * size, size, ldk * size, zero,
                         sa + (r0 * w + c0) * size, w * size, size)
        tile = s[:n * w].reshape((n, w))        # C-ordered, as the tile kernel is compiled
        if alibi:
            _add_alibi(tile, band, slope, js, diag0, lo, hi)
        online_softmax_tile(tile, m, l, o, lo, hi)
        for g in range((n + rows - 1) // rows):
            r0, r1, c0, c1 = g * rows, min((g + 1) * rows, n), c0s[g], c1s[g]
            if c1 > c0:
                _product(gemm, wide, r1 - r0, dv, c1 - c0, sa + (r0 * w + c0) * size,
                         w * size, size, v + (js + c0) * ldv * size, ldv * size, size, one,
                         oa + r0 * o.strides[0], o.strides[0], size)


# cached as the kernels are, and the tile kernel called as a kernel of its own (not split
# into an uncached helper with its scratch passed in: the processes that compiled such a
# version and those that loaded it from the cache summed the rows' weights in different
# orders, 1-ulp differences between a Dask worker's chunks and its client's)
forward_walk = compiled(_walk_impl)
forward_walk.__doc__ = """The online-softmax state after keys ``[j_lo, j_hi)`` of one query
block, in place: :func:`cuonline.engines.numpy._online`'s loop for the plain score (or it and
ALiBi's term); :func:`forward_stack` calls it for each element of a stack.

Parameters
----------
q, k, v : int
    Addresses of the scaled queries (n, d), and of key row 0 (d columns) and value row 0 (dv
    columns) of the batch element; ``ldq``, ``ldk``, ``ldv``: their row strides in elements
    (each row contiguous).
m, l, o : arrays (n,), (n,), (n, dv), C-ordered
    The running max, sum and unnormalised output, updated.
s : 1-d array of at least ``n * width`` elements
    The score buffer.
width : int
    Keys per tile; tiles start at ``j_lo``.
lo0, hi0 : (n,) int64 arrays
    Row ``i`` may see the keys ``[lo0[i], hi0[i])`` (the window band; not clipped).
span_rows : int
    Rows per group for the products of a tile the band crosses.
gemm, wide : int, bool
    The address of ``cblas_?gemm`` for the dtype of ``s`` and whether its integers are 64-bit.
alibi, slope, diag0 : bool, float of the dtype of ``s``, int
    Whether the logits take ALiBi's term ``-slope * |j - (diag0 + i)|`` (``diag0``: the key
    facing query row 0), added to each tile after its product (:func:`_add_alibi`).
lo, hi, c0s, c1s, band : arrays
    Scratch (:func:`_walk_scratch`): the rows' visible columns of a tile, the groups'
    columns, and ALiBi's distances (empty without ALiBi).
"""


def _forward_stack(qs, ldq, scale, queries, ks, ldk, vs, ldv, m, l, o, finite, s, j_lo, j_hi,
                   width, lo0, hi0, span_rows, gemm, wide, slopes, diag0):
    full_vector_width()              # the inlined loops keep their width
    n, d = queries.shape
    zero = s.dtype.type(0)
    alibi = slopes.shape[0] > 0
    # every array the elements' loops take or pass views of, viewed without reference counts:
    # the arguments (the caller holds them) and the scratch (held to the end below)
    scratch = _walk_scratch(n, span_rows, n + width - 1 if alibi else 0, s)
    lo, hi, c0s, c1s = (unowned(scratch[0]), unowned(scratch[1]), unowned(scratch[2]),
                        unowned(scratch[3]))
    band = unowned(scratch[4])
    m, l, o, s, queries = unowned(m), unowned(l), unowned(o), unowned(s), unowned(queries)
    lo0, hi0 = unowned(lo0), unowned(hi0)
    old = flush_subnormals()         # the products of tiny weights run without assists
    for g in range(m.shape[0]):
        # the element's queries scaled into the scratch, as ScorePipeline scales a task's
        rows = numba.carray(_pointer(qs[g], zero), (n, ldq))
        for i in range(n):
            for c in range(d):
                queries[i, c] = rows[i, c] * scale
        if j_hi <= j_lo:
            o[g] = zero                 # no tile, whose kernel would set each row of o first
        slope = slopes[g] if alibi else zero
        forward_walk(np.int64(queries.ctypes.data), d, ks[g], ldk, vs[g], ldv, d, m[g], l[g],
                     o[g], s, j_lo, j_hi, width, lo0, hi0, span_rows, gemm, wide, alibi, slope,
                     diag0, lo, hi, c0s, c1s, band)
        finite[g] = normalise_rows(l[g], o[g])
    restore_subnormals(old)
    _keep_alive(scratch)


forward_stack = compiled(_forward_stack)
forward_stack.__doc__ = """:func:`forward_walk` for each batch element of a stack, in one call,
with what the Python around a task did: the walk of a batch of short sequences
(:func:`cuonline.engines.numpy.attend_stacked`), the same products and tile kernel per element
as a task of its own, with no Python between the elements.

For each element: its queries times ``scale`` into the scratch ``queries`` (the
multiplications that make a task's scaled copy), the walk, then the output divided by the row
sums in place (:func:`cuonline.engines.numpy._normalised`'s division) after a check that it
is finite.

Parameters
----------
qs : (G,) int64 array
    Addresses of row 0 of each element's queries (unscaled, of the dtype of ``s``), rows
    ``ldq`` elements apart, each row contiguous.
scale : float of the dtype of ``s``
    The score scale.
queries : (n, d) C-ordered array
    Scratch for one element's scaled queries.
ks, vs : (G,) int64 arrays
    Addresses of key row 0 and value row 0 of each element; ``ldk``, ``ldv``: their row
    strides in elements (the same for every element).
m, l, o : arrays (G, n), (G, n), (G, n, dv), C-ordered
    Each element's running max and sum (-inf and 0 in), updated, and its output: any values
    in (the tile kernel sets each row of a walk's first tile, where ``m`` is -inf),
    normalised out.
finite : (G,) bool array
    Set to whether each element's unnormalised output was finite (the caller redoes the
    others by the careful path).
slopes, diag0 : (G,) array of the dtype of ``s`` (or empty), int
    Each element's ALiBi slope (empty: no ALiBi term) and the key facing query row 0.

The other parameters are :func:`forward_walk`'s, shared by the elements (one window band).
"""


@numba.njit(fastmath=_tile_kernels.FASTMATH, error_model="numpy")
def _tiles_scratch(tiles, span_rows, alibi, like):
    """The scratch of :func:`_backward_tiles` for ``tiles``: :func:`_walk_scratch`'s for their
    most rows, ALiBi's band as wide as their widest tile needs."""
    most, widest = 1, 1
    for t in range(tiles.shape[0]):
        most = max(most, tiles[t, 1] - tiles[t, 0])
        widest = max(widest, tiles[t, 3] - tiles[t, 2])
    return _walk_scratch(most, span_rows, most + widest - 1 if alibi else 0, like)


@numba.njit(fastmath=_tile_kernels.FASTMATH, error_model="numpy")
def _backward_tiles(tiles, q, ldq, do, ldo, k, ldk, v, ldv, d, dv, dq, lddq, dk, lddk, dvv,
                    lddv, lse, delta, sums, lo0, hi0, s, ds, row_sums, span_rows, kv_part,
                    q_part, gemm, wide, alibi, slope, diag0, lo, hi, c0s, c1s, band):
    full_vector_width()
    size = s.itemsize
    zero, one = s.dtype.type(0), s.dtype.type(1)
    sa, dsa = np.int64(s.ctypes.data), np.int64(ds.ctypes.data)
    for t in range(tiles.shape[0]):
        i0, i1, js, je = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
        n, w = i1 - i0, je - js
        for i in range(n):
            lo[i] = lo0[i0 + i] - js
            hi[i] = hi0[i0 + i] - js
        rows = _spans(lo[:n], hi[:n], w, span_rows, c0s, c1s)
        groups = (n + rows - 1) // rows
        # S = scale Q K^T and dP = dO V^T over each group's columns, 0 elsewhere; then -inf
        # in S wherever the row may not see the key (the score pipeline's masking)
        for g in range(groups):
            r0, r1, c0, c1 = g * rows, min((g + 1) * rows, n), c0s[g], c1s[g]
            for i in range(r0, r1):
                for j in range(c0):
                    s[i * w + j] = zero
                    ds[i * w + j] = zero
                for j in range(c1, w):
                    s[i * w + j] = zero
                    ds[i * w + j] = zero
            if c1 > c0:
                _product(gemm, wide, r1 - r0, c1 - c0, d, q + (i0 + r0) * ldq * size,
                         ldq * size, size, k + (js + c0) * ldk * size, size, ldk * size,
                         zero, sa + (r0 * w + c0) * size, w * size, size)
                _product(gemm, wide, r1 - r0, c1 - c0, dv, do + (i0 + r0) * ldo * size,
                         ldo * size, size, v + (js + c0) * ldv * size, size, ldv * size,
                         zero, dsa + (r0 * w + c0) * size, w * size, size)
        tile, grad = s[:n * w].reshape((n, w)), ds[:n * w].reshape((n, w))
        if alibi:
            _add_alibi(tile, band, slope, js, diag0 + i0, lo, hi)
        for i in range(n):
            a = clip(lo[i], 0, w)
            tile[i, :a] = -np.inf
            tile[i, max(a, clip(hi[i], 0, w)):] = -np.inf
        # P and dS in place; anything but "all finite" goes back to the caller's loop
        if backward_tile(tile, lse[i0:i1], grad, delta[i0:i1], row_sums[:n]) != 1:
            return t
        if q_part:
            for i in range(n):
                sums[i0 + i] += row_sums[i]
        for g in range(groups):
            r0, r1, c0, c1 = g * rows, min((g + 1) * rows, n), c0s[g], c1s[g]
            if kv_part and c1 > c0:         # dV += P^T dO, dK += dS^T (scale Q)
                _product(gemm, wide, c1 - c0, dv, r1 - r0, sa + (r0 * w + c0) * size, size,
                         w * size, do + (i0 + r0) * ldo * size, ldo * size, size, one,
                         dvv + (js + c0) * lddv * size, lddv * size, size)
                _product(gemm, wide, c1 - c0, d, r1 - r0, dsa + (r0 * w + c0) * size, size,
                         w * size, q + (i0 + r0) * ldq * size, ldq * size, size, one,
                         dk + (js + c0) * lddk * size, lddk * size, size)
        if q_part:                             # dQ += dS K (scaled by the caller)
            for g in range(groups):
                r0, r1, c0, c1 = g * rows, min((g + 1) * rows, n), c0s[g], c1s[g]
                if c1 > c0:
                    _product(gemm, wide, r1 - r0, d, c1 - c0, dsa + (r0 * w + c0) * size,
                             w * size, size, k + (js + c0) * ldk * size, ldk * size, size,
                             one, dq + (i0 + r0) * lddq * size, lddq * size, size)
    return tiles.shape[0]


def _backward_block(tiles, q, ldq, do, ldo, k, ldk, v, ldv, d, dv, dq, lddq, dk, lddk, dvv,
                    lddv, lse, delta, sums, lo0, hi0, s, ds, row_sums, span_rows, kv_part,
                    q_part, gemm, wide, alibi, slope, diag0):
    lo, hi, c0s, c1s, band = _tiles_scratch(tiles, span_rows, alibi, s)
    old = flush_subnormals()
    # under flush-to-zero: the products of tiny weights and gradients run without assists
    done = _backward_tiles(tiles, q, ldq, do, ldo, k, ldk, v, ldv, d, dv, dq, lddq, dk, lddk,
                           dvv, lddv, lse, delta, sums, lo0, hi0, s, ds, row_sums, span_rows,
                           kv_part, q_part, gemm, wide, alibi, slope, diag0, lo, hi, c0s, c1s,
                           band)
    restore_subnormals(old)
    return done


backward_block = compiled(_backward_block)
backward_block.__doc__ = """The tiles of one key block of the backward for the plain score, in
place: :func:`cuonline.engines.numpy_backward._one_batch_element`'s inner loop with every
operand finite and every row seeing a key.

Parameters
----------
tiles : (T, 4) int64 array
    ``(i0, i1, js, je)`` of each tile: query rows ``[i0, i1)`` against keys ``[js, je)``.
q, do, k, v, dq, dk, dvv : int
    Addresses of row 0 of the scaled queries, the output gradient, the keys, the values and
    the three gradients (each row contiguous); ``ld*``: their row strides in elements; ``d``
    and ``dv``: the head dimensions of the queries and of the values.
lse, delta, sums : 1-d arrays of the batch element's rows
    Log-sum-exp, ``Delta = dO . O`` and the rows' sums of P (added to where ``q_part``).
lo0, hi0 : 1-d int64 arrays
    Row ``i`` may see the keys ``[lo0[i], hi0[i])`` (the window band; not clipped).
s, ds, row_sums : 1-d buffers of at least ``rows x keys`` (``rows``) elements of a tile
span_rows : int
    Rows per group for the products of a tile the band crosses.
kv_part, q_part : bool
    Add dK and dV; add dQ and the row sums.
gemm, wide : int, bool
    ``cblas_?gemm``'s address for the dtype and whether its integers are 64-bit.
alibi, slope, diag0 : bool, float of the dtype, int
    Whether the logits take ALiBi's term ``-slope * |j - (diag0 + i)|`` (``diag0``: the key
    facing query row 0), added to each tile's scores as the forward's walk adds it.

Returns
-------
int
    The tiles done: fewer than T where a tile's P or dS was not all finite (nothing of that
    tile added; the caller's loop takes it and the rest).
"""


@numba.njit(fastmath=_tile_kernels.FASTMATH, error_model="numpy")
def _finite_rows(address, rows, ld, width, like):
    """Whether the ``rows`` rows of ``width`` numbers (``ld`` apart) from ``address`` are all
    finite: one vector sum of each number times 0 (NaN once any is NaN or infinite)."""
    zero = like.dtype.type(0)
    x = numba.carray(_pointer(address, zero), (rows, ld))
    check = zero
    for i in range(rows):
        for c in range(width):
            check += x[i, c] * zero
    return check == zero


@numba.njit(fastmath=_tile_kernels.FASTMATH, error_model="numpy")
def _zero_rows(address, rows, ld, width, like):
    """The ``rows`` rows of ``width`` numbers (``ld`` apart) from ``address`` set to 0."""
    zero = like.dtype.type(0)
    x = numba.carray(_pointer(address, zero), (rows, ld))
    for i in range(rows):
        for c in range(width):
            x[i, c] = zero


def _backward_stack(tiles, qs, ldq, scale, queries, do, ldo, do_step, ks, ldk, vs, ldv, d, dv,
                    dqs, lddq, dks, lddk, dvs, lddv, clear, lse, delta, sums, lo0, hi0, s, ds,
                    row_sums, span_rows, gemm, wide, slopes, diag0):
    full_vector_width()
    zero = s.dtype.type(0)
    alibi = slopes.shape[0] > 0
    n = queries.shape[0]
    keys = 0                                    # the keys the tiles read: [0, keys)
    for t in range(tiles.shape[0]):
        keys = max(keys, tiles[t, 3])
    # every array the elements' loops take or pass views of, viewed without reference counts
    # (:func:`_forward_stack`'s reason): the arguments and the scratch, held to the end below
    scratch = _tiles_scratch(tiles, span_rows, alibi, s)
    lo, hi, c0s, c1s = (unowned(scratch[0]), unowned(scratch[1]), unowned(scratch[2]),
                        unowned(scratch[3]))
    band = unowned(scratch[4])
    lse, delta, sums, lo0, hi0 = (unowned(lse), unowned(delta), unowned(sums), unowned(lo0),
                                  unowned(hi0))
    s, ds, row_sums, tiles = unowned(s), unowned(ds), unowned(row_sums), unowned(tiles)
    queries = unowned(queries)
    scaled = np.int64(queries.ctypes.data)
    old = flush_subnormals()
    done, g = tiles.shape[0], 0
    while g < lse.shape[0] and done == tiles.shape[0]:
        # the element's queries times the scale into the scratch, as the Python loop scales
        # them, and its operands checked: anything but finite numbers and rows that see a key
        # goes to the caller's loop, from this element on
        rows = numba.carray(_pointer(qs[g], zero), (n, ldq))
        check = zero
        for i in range(n):
            for c in range(d):
                queries[i, c] = rows[i, c] * scale
                check += queries[i, c] * zero
        finite = check == zero and _finite_rows(do + g * do_step, n, ldo, dv, s)
        finite = finite and _finite_rows(ks[g], keys, ldk, d, s)
        for i in range(n):
            finite = finite and lse[g, i] != -np.inf
        if not finite:
            break
        if clear > 0:                   # the element's own slots, zeroed as it starts
            _zero_rows(dqs[g], n, lddq, d, s)
            _zero_rows(dks[g], clear, lddk, d, s)
            _zero_rows(dvs[g], clear, lddv, dv, s)
        slope = slopes[g] if alibi else zero
        done = _backward_tiles(tiles, scaled, d, do + g * do_step, ldo, ks[g], ldk, vs[g], ldv,
                               d, dv, dqs[g], lddq, dks[g], lddk, dvs[g], lddv, lse[g],
                               delta[g], sums[g], lo0, hi0, s, ds, row_sums, span_rows, True,
                               True, gemm, wide, alibi, slope, diag0, lo, hi, c0s, c1s, band)
        g += 1
    restore_subnormals(old)
    _keep_alive(scratch)
    if done < tiles.shape[0]:
        return g - 1, done
    return g, 0


backward_stack = compiled(_backward_stack)
backward_stack.__doc__ = """:func:`backward_block` for each batch element of a stack, in one
call: the backward of a batch of short sequences
(:func:`cuonline.engines.numpy_backward._stacks`), each element's tiles, products
and tile kernel those of a task of its own, in the stack's order, with no Python between the
elements.

Parameters
----------
tiles : (T, 4) int64 array
    The tiles of every element (one window band), as :func:`backward_block`'s, in the order a
    task per element adds them (key block by key block).
qs, ldq : (G,) int64 array, int
    Addresses of row 0 of each element's queries (unscaled, of the dtype of ``s``), rows
    ``ldq`` elements apart, each row contiguous.
scale : float of the dtype of ``s``
    The score scale.
queries : (n, d) C-ordered array
    Scratch for one element's scaled queries (the multiplications of the Python loop's
    scaled copy).
do, ldo, do_step : int
    Address of element 0's output gradient, its row stride in elements and the step in bytes
    from one element's to the next.
ks, vs, dqs, dks, dvs : (G,) int64 arrays
    Addresses of row 0 of each element's keys, values and gradient slots; ``ld*``: their row
    strides in elements (the same for every element).
clear : int
    0 where the gradient slots come zeroed; else each element's own slots are zeroed as its
    turn comes (its dQ rows and ``clear`` rows of dK and dV, all its keys'), in the cache
    its products then add into, and the slots of the elements not reached are left as
    they are.
lse, delta, sums : (G, n) arrays
    Each element's rows' log-sum-exp, ``Delta`` and sums of P (added to).
slopes, diag0 : (G,) array of the dtype (or empty), int
    Each element's ALiBi slope (empty: no ALiBi term) and the key facing query row 0.

The other parameters are :func:`backward_block`'s; both parts are added.

Returns
-------
(int, int)
    The elements done, and the tiles done of the next one: ``(G, 0)``, or fewer elements
    where the next element's scaled queries, output gradient or keys (those the tiles read)
    were not all finite or a row of it had ``lse = -inf`` (no tile of it done), or a tile of
    it had a P or dS not all finite (its tiles before that one added, nothing of it). The
    caller does the rest of that element and the elements after it.
"""


def _stamped_with(kernels, modules):
    """Make the ``kernels``' on-disk caches stale whenever the source file of one of
    ``modules`` changes, not only their own (numba's rule): the task loops inline the tile
    kernels and CBLAS's layout rule, and a cache keyed on this file alone would go on running
    their old code after an edit of ``_tile_kernels.py`` or ``cblas.py``. The index numba
    keeps beside the compiled code records a stamp of the source file and is dropped when the
    stamp differs; a digest of ``modules``' files is folded into it. Where numba keeps no such
    stamp (no cache here, another numba) or a file cannot be read (a zipped install), nothing
    changes."""
    digest = hashlib.sha256()
    try:
        for module in modules:
            with open(module.__file__, "rb") as f:
                digest.update(f.read())
    except (OSError, TypeError):                # no file, or __file__ None
        return
    for kernel in kernels:
        cache_file = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
        stamp = getattr(cache_file, "_source_stamp", None)
        if stamp is not None:
            cache_file._source_stamp = (stamp, digest.hexdigest())


_stamped_with((forward_walk, forward_stack, backward_block, backward_stack),
              (_tile_kernels, cblas))


def _warm_up_backward(dtype):
    z = np.zeros(1, dtype)
    none = np.zeros(0, np.int64)
    backward_block(np.zeros((0, 4), np.int64), 0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 0, 1, 0, 1, 0, 1,
                   z, z, z, none, none, z, z, z, 128, True, True, 0, False, False,
                   dtype.type(0), 0)


def _warm_up_stack(dtype):
    none = np.zeros(0, np.int64)
    forward_stack(none, 1, dtype.type(1), np.zeros((0, 1), dtype), none, 1, none, 1,
                  np.zeros((0, 0), dtype), np.zeros((0, 0), dtype), np.zeros((0, 0, 1), dtype),
                  np.zeros(0, np.bool_), np.zeros(1, dtype), 0, 1, 1, none, none, 128, 0, False,
                  np.zeros(0, dtype), 0)


def _warm_up_backward_stack(dtype):
    z = np.zeros((0, 1), dtype)
    none = np.zeros(0, np.int64)
    backward_stack(np.zeros((0, 4), np.int64), none, 1, dtype.type(1), np.zeros((0, 1), dtype),
                   0, 1, 0, none, 1, none, 1, 1, 1, none, 1, none, 1, none, 1, 0, z, z, z,
                   none, none, np.zeros(1, dtype), np.zeros(1, dtype), np.zeros(1, dtype), 128,
                   0, False, np.zeros(0, dtype), 0)


_WARM_UP = {"forward_stack": (forward_stack, _warm_up_stack),
            "backward_block": (backward_block, _warm_up_backward),
            "backward_stack": (backward_stack, _warm_up_backward_stack)}


def compile_for(name, dtype):
    """The kernel ``name`` compiled for ``dtype`` (float32 or float64), by calling it once on
    empty arrays; raises whatever numba raises if it cannot."""
    kernel, warm_up = _WARM_UP[name]
    warm_up(np.dtype(dtype))
    return kernel
