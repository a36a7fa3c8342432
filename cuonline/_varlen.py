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

__all__ = ["host_boundaries", "pack", "unpack"]


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


def host_boundaries(options: Any, framework: str, is_traced: Any) -> Any:
    """``options`` with `cu_seqlens_q` and `cu_seqlens_k` as nested tuples of Python values
    read on the host, for a framework binding (``cuonline.torch``, ``cuonline.jax``): the
    boundaries decide how much work each sequence is and the shapes of the work, so a traced
    program needs their values when it is built. A traced value of the framework
    (``is_traced(value)``) is a TypeError naming the argument; everything else (NumPy,
    lists, torch tensors, JAX arrays outside a trace) is read here and checked by
    validation, as :func:`cuonline.attention` checks it."""
    changes = {}
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        value = getattr(options, name)
        if value is None:
            continue
        if is_traced(value):
            raise TypeError(
                f"`{name}` is a traced {framework} value, but the sequence boundaries decide "
                f"the shape of the work, so they must be known when the program is built: "
                f"pass a NumPy array or a list (closed over, or a static argument as a tuple), "
                f"not an argument of the traced function")
        if isinstance(value, (list, tuple)):
            changes[name] = _nested_tuple(value)   # as given (torch.compile traces this)
            continue
        if _arrays.library(value) not in (None, "numpy"):
            value = value.tolist()         # torch, JAX, CuPy: read on the host
        try:
            host = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"`{name}` must be a 1-D integer array of sequence boundaries, "
                            f"got {type(value).__name__}: {exc}") from None
        changes[name] = _nested_tuple(host.tolist())
    return options.replace(**changes) if changes else options


def _nested_tuple(x: Any) -> Any:
    """Lists and tuples as tuples, NumPy scalars as Python values: hashable, and written
    back by their repr. Booleans and floats stay what they are, for validation to refuse."""
    if isinstance(x, (list, tuple)):
        return tuple(_nested_tuple(e) for e in x)
    return x.item() if isinstance(x, np.generic) else x
