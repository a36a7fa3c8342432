"""Packing lists of sequences end to end, and back: :func:`pack` and :func:`unpack`.

The packed layout is FlashAttention's: the sequences' rows one after another along the length
axis, and ``cu_seqlens`` (``B + 1`` int64 boundaries, 0 first) saying where each begins.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import _arrays
from ._validate import check_cu_seqlens

__all__ = ["pack", "refuse_in_binding", "unpack"]


def _axis(axis: Any, ndim: int, what: str) -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"`axis` must be an int, got {type(axis).__name__} {axis!r}")
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"`axis` {axis} is out of range for {what} with {ndim} dimensions")
    return axis % ndim


def pack(seqs: Any, *, axis: int = -2) -> tuple[Any, np.ndarray]:
    """Concatenate sequences of different lengths along their length axis.

    Parameters
    ----------
    seqs : sequence of arrays
        ``B >= 1`` NumPy or CuPy arrays (one library), of shapes ``S + (L_b, D)`` with the
        same ``S``, ``D`` and dtype: sequence ``b`` has ``L_b`` rows (0 allowed).
    axis : int, optional
        The length axis. Default -2 (``S + (L, D)``: queries, keys, values, `rel_q`); -1
        packs ``S + (L,)`` arrays such as ``lse``.

    Returns
    -------
    packed : array, shape ``S + (sum_b L_b, D)``
        The sequences end to end, in the library and dtype of `seqs`.
    cu_seqlens : numpy.ndarray of int64, shape (B + 1,)
        ``[0, L_0, L_0 + L_1, ...]``: sequence ``b`` is ``packed[..., cu_seqlens[b]:
        cu_seqlens[b + 1], :]``. Pass it as :func:`cuonline.attention`'s `cu_seqlens_q`
        (or `cu_seqlens_k`).

    Raises
    ------
    TypeError
        `seqs` not a list or tuple of arrays, arrays of different libraries or dtypes.
    ValueError
        No sequence, or shapes that differ outside the length axis.

    See Also
    --------
    unpack : the inverse.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> rng = np.random.default_rng(0)
    >>> seqs = [rng.standard_normal((4, n, 8)) for n in (30, 7, 12)]   # (heads, L_b, D)
    >>> x, cu = cuonline.pack(seqs)
    >>> x.shape, cu
    ((4, 49, 8), array([ 0, 30, 37, 49]))
    >>> out = cuonline.attention(x, x, x, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    >>> [o.shape for o in cuonline.unpack(out, cu)]
    [(4, 30, 8), (4, 7, 8), (4, 12, 8)]
    """
    if not isinstance(seqs, (list, tuple)):
        raise TypeError(f"`seqs` must be a list or tuple of arrays, got {type(seqs).__name__}")
    if not seqs:
        raise ValueError("`seqs` must hold at least one sequence, got none")
    named = {f"seqs[{b}]": x for b, x in enumerate(seqs)}
    xp = _arrays.namespace(**named)
    arrays = [xp.asarray(x) for x in seqs]
    first = arrays[0]
    ax = _axis(axis, first.ndim, "`seqs[0]`")
    for b, x in enumerate(arrays):
        if x.dtype != first.dtype:
            raise TypeError(f"`seqs[{b}]` has dtype {x.dtype} but `seqs[0]` has {first.dtype}; "
                            f"convert them to one dtype first")
        if x.ndim != first.ndim or x.shape[:ax] + x.shape[ax + 1:] != (
                first.shape[:ax] + first.shape[ax + 1:]):
            raise ValueError(
                f"`seqs[{b}]` has shape {tuple(x.shape)} but `seqs[0]` has "
                f"{tuple(first.shape)}: the shapes must agree except along axis {axis} "
                f"(the length)")
    lengths = [x.shape[ax] for x in arrays]
    cu_seqlens = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    return xp.concatenate(arrays, axis=ax), cu_seqlens


def unpack(packed: Any, cu_seqlens: Any, *, axis: int = -2) -> list:
    """Split a packed array into its sequences: the inverse of :func:`pack`.

    Parameters
    ----------
    packed : array, shape ``S + (total, D)``
        Sequences end to end along `axis` (any array with a ``shape`` and slicing: NumPy, CuPy,
        torch, JAX).
    cu_seqlens : 1-D integer array, shape (B + 1,)
        Boundaries: 0 first, non-decreasing, ``total`` last.
    axis : int, optional
        The length axis. Default -2; -1 for ``S + (total,)`` arrays such as ``lse``.

    Returns
    -------
    list of B arrays
        Views ``packed[..., cu_seqlens[b]:cu_seqlens[b + 1], :]`` (no copy).

    Raises
    ------
    TypeError
        A `cu_seqlens` that is not an integer array.
    ValueError
        A `cu_seqlens` that is not 1-D, does not start at 0, decreases or does not end at the
        length of `packed` along `axis`.

    Examples
    --------
    >>> import numpy as np, cuonline
    >>> parts = cuonline.unpack(np.arange(10.0).reshape(5, 2), [0, 2, 2, 5])
    >>> [p.shape for p in parts]
    [(2, 2), (0, 2), (3, 2)]
    """
    shape = tuple(packed.shape)
    ax = _axis(axis, len(shape), "`packed`")
    cu = check_cu_seqlens(cu_seqlens, "cu_seqlens", shape[ax], f"packed.shape[{axis}]")
    lead = (slice(None),) * ax
    return [packed[lead + (slice(int(a), int(b)),)] for a, b in zip(cu[:-1], cu[1:])]


def refuse_in_binding(options: Any, framework: str) -> None:
    """ValueError for a packed batch given to a framework binding (``cuonline.torch``,
    ``cuonline.jax``): their traced programs need the boundaries' values when built, which
    they do not have yet."""
    given = [n for n in ("cu_seqlens_q", "cu_seqlens_k") if getattr(options, n) is not None]
    if given:
        raise ValueError(
            f"the {framework} binding does not yet take packed batches ({', '.join(given)} "
            f"given): call cuonline.attention on the arrays (it takes {framework} arrays and "
            f"answers in kind, without gradients), or pad the batch")
