"""Argument checks: user input in, a frozen :class:`Problem` out.

Every user-facing error of cuonline is raised here, before any work is done, and names the
argument, what was expected and what came. Engines receive a :class:`Problem` whose arrays are
zero-copy views broadcast to the batch shape, so no engine repeats a check or a broadcast.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays, _semantics
from ._options import Options, array_layout, differentiable_options, names
from .kernels import heuristics as _heuristics
from .kernels.arguments import MAX_REL_RADIUS as _CUDA_MAX_REL_RADIUS
from .kernels.specs import MAX_HEAD_DIM as _CUDA_MAX_HEAD_DIM
from .kernels.specs import STATS_MAX_TOP_K as _CUDA_STATS_MAX_TOP_K

__all__ = [
    "BACKENDS", "Problem", "SoftmaxProblem", "StatsProblem", "array_namespace", "check_backend",
    "check_cu_seqlens", "CU_SEQLENS",
    "validate_attention", "validate_attention_stats", "validate_axis_input", "validate_merge",
]

#: Engine names accepted by ``backend=``; "auto" picks by the array library of the inputs.
BACKENDS = ("auto", "numpy", "cupy", "emulate")
#: Values of ``precision=``: "highest" computes in the accumulation dtype; "tf32" lets the
#: CUDA engine use TF32 tensor cores for float32 inputs.
PRECISIONS = ("highest", "tf32")

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
#: The engines that run cuonline's CUDA kernels.
_CUDA_BACKENDS = ("cupy", "emulate")
#: Modes of the softmax family.
SOFTMAX_MODES = ("softmax", "log_softmax", "logsumexp")


@dataclass(frozen=True)
class Problem:
    """One attention call, checked and normalised; the only input an engine receives.

    Arrays are views broadcast to ``batch_shape`` (zero strides where the user broadcast), never
    copies of the broadcast size. ``bias`` is in ``acc_dtype``; ``kv_lengths`` (int64) and
    ``alibi_slopes`` (``acc_dtype``) are small arrays materialised to ``batch_shape``.
    """

    xp: Any                    # numpy or cupy
    backend: str               # resolved engine: "numpy", "cupy" or "emulate"
    batch_shape: tuple
    lq: int
    lk: int
    d: int
    dv: int
    dtype: np.dtype            # of q, k, v and out
    acc_dtype: np.dtype        # scores, softmax state, lse
    scale: float
    causal: bool
    window: tuple              # (left, right), causal folded in; None = unbounded side
    softcap: float | None
    return_lse: bool
    precision: str             # "highest" or "tf32" (float32 inputs only)
    q: Any                     # batch_shape + (lq, d)
    k: Any                     # batch_shape + (lk, d)
    v: Any                     # batch_shape + (lk, dv)
    bias: Any = None           # batch_shape + (lq, lk), acc_dtype, or None
    mask: Any = None           # batch_shape + (lq, lk), bool, or None
    kv_lengths: Any = None     # batch_shape, int64, values clipped to [0, lk], or None
    alibi_slopes: Any = None   # batch_shape, acc_dtype, or None
    workers: int | None = None  # NumPy engine threads, >= 1; None = every core it may use
    # q_offset - k_offset, clamped (_semantics.diagonal_offset): query i faces key i + diagonal
    diagonal_offset: int = 0
    softcap_bias: bool = False  # the soft cap applies after bias and ALiBi (both not None)
    # (r, c): `bias` is the coarse batch_shape + (ceil(lq / r), ceil(lk / c)) array, or None
    bias_block: tuple | None = None
    rel_bias: Any = None       # batch_shape + (Rb,), acc_dtype, Rb odd, or None
    rel_q: Any = None          # batch_shape + (lq, dr), acc_dtype, or None (with rel_k)
    rel_k: Any = None          # batch_shape + (Rk, dr), acc_dtype, Rk odd, or None
    # packed variable-length batch: (B + 1,) int64 NumPy boundaries of the sequences along
    # the query and key axes (lq, lk are the totals), or None; rel_q is packed like q
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    # per sequence: _semantics.diagonal_offset of a call on the sequence alone (a tuple of
    # ints), or None without cu_seqlens
    sequence_diagonals: tuple | None = None

    @property
    def nbatch(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def rel_bias_radius(self) -> int:
        """``rb``: score (i, j) reads ``rel_bias[rb + clip(delta, -rb, rb)]``; 0 without it."""
        return 0 if self.rel_bias is None else (self.rel_bias.shape[-1] - 1) // 2

    @property
    def rel_k_radius(self) -> int:
        """``rk``: score (i, j) reads ``rel_k[rk + clip(delta, -rk, rk)]``; 0 without it."""
        return 0 if self.rel_k is None else (self.rel_k.shape[-2] - 1) // 2

    @property
    def dr(self) -> int:
        """Width of the relative query/key vectors; 0 without them."""
        return 0 if self.rel_k is None else self.rel_k.shape[-1]

    @property
    def has_window(self) -> bool:
        return self.window != (None, None)


# --------------------------------------------------------------------------------------------
# array libraries


def array_namespace(**named) -> Any:
    """numpy or cupy for the named arguments, which must not mix array libraries
    (:func:`cuonline._arrays.namespace`: the mixed-libraries TypeError names them)."""
    return _arrays.namespace(**named)


def _as_array(xp, x, name):
    if x is None:
        raise TypeError(f"`{name}` must be an array, got None")
    try:
        return xp.asarray(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument's name
        raise TypeError(f"`{name}` must be an array, got {type(x).__name__}: {exc}") from None


def _as_strided(xp, x, shape, strides):
    if xp is np:
        return np.lib.stride_tricks.as_strided(x, shape=shape, strides=strides, writeable=False)
    return xp.lib.stride_tricks.as_strided(x, shape=shape, strides=strides)


def astype_view(xp, x, dtype):
    """``x`` as ``dtype``, converting only the elements that the view ``x`` can reach.

    A broadcast (zero-stride) or overlapping view, such as a Toeplitz bias built with
    ``as_strided`` over ``Lq + Lk - 1`` values, reaches far fewer elements than its size:
    ``x.astype`` would write every element of the view, here only the span of bytes between
    the lowest and the highest element it touches is converted (one 1-d ``astype``), and the
    same view (strides scaled by the itemsize ratio) is rebuilt over it. Memory is
    ``O(min(span, size))``. A view whose span is at least its size is converted as usual.
    """
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    itemsize = x.dtype.itemsize
    if x.size == 0 or any(s % itemsize for s in x.strides):
        return x.astype(dtype)
    lo = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s < 0)   # bytes, <= 0
    hi = sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s > 0)   # bytes, >= 0
    span = (hi - lo) // itemsize + 1
    if span >= x.size:
        return x.astype(dtype)
    # the element at byte offset `lo`: the last index on axes of negative stride, else the first
    first = x[tuple(slice(n - 1, n) if s < 0 else slice(0, 1) for n, s in zip(x.shape, x.strides))]
    reach = _as_strided(xp, first.reshape(-1), (span,), (itemsize,))
    if xp is np:
        # elements between those of the view are converted too and may overflow the new dtype;
        # they are never read, so their warnings would only mislead
        with np.errstate(over="ignore", invalid="ignore"):
            flat = reach.astype(dtype)
    else:
        flat = reach.astype(dtype)
    strides = tuple(s // itemsize * dtype.itemsize for s in x.strides)
    return _as_strided(xp, flat[-lo // itemsize:], x.shape, strides)


def _native_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _clip_python_ints(value, lk):
    """``kv_lengths`` given as Python ints (or nested lists of them) beyond int64 would become an
    object array: values above ``Lk`` mean all keys, so clip them to ``Lk`` first. Anything
    else is returned as it came, for the usual checks."""
    if _arrays.library(value) is not None:
        return value
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - _as_array reports it with the argument's name
        return value
    if arr.dtype != object or not all(
        isinstance(e, numbers.Integral) and not isinstance(e, (bool, np.bool_))
        for e in arr.flat
    ):
        return value
    if arr.size and min(arr.flat) < 0:
        raise ValueError(f"`kv_lengths` must be >= 0, got minimum {min(arr.flat)}")
    return np.array([min(int(e), lk) for e in arr.flat], dtype=np.int64).reshape(arr.shape)


def _native(xp, x):
    """``x`` in native byte order: the same dtype for every rule (precision, accumulation,
    kernel variant). A non-native array is converted (over the span it reaches), since the
    kernels and BLAS read native numbers only."""
    if x.dtype.isnative:
        return x
    return astype_view(xp, x, x.dtype.newbyteorder("="))


def _is_float_dtype(dtype) -> bool:
    return _is_float(np.dtype(dtype))


@functools.lru_cache(maxsize=64)
def _is_float(dtype: np.dtype) -> bool:       # a dtype's name is made on each reading (2 us)
    return dtype.name in _FLOAT_NAMES


def _check_float(x, name, *, label=None):
    """TypeError unless ``x`` has a real floating dtype; ``label`` (default ```name```) is
    how the message names the array."""
    label = f"`{name}`" if label is None else label
    dt = np.dtype(x.dtype)
    if not _is_float_dtype(dt):
        kind = {"b": "boolean", "i": "integer", "u": "unsigned integer", "c": "complex"}.get(
            dt.kind, dt.name
        )
        raise TypeError(
            f"{label} must have a real floating dtype (float16, bfloat16, float32 or float64), "
            f"got {kind} dtype {dt.name}"
        )


def _broadcast_to(xp, x, shape, name, expected):
    try:
        if tuple(x.shape) != tuple(shape) and np.broadcast_shapes(x.shape, shape) != tuple(shape):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"`{name}` of shape {tuple(x.shape)} does not broadcast to {expected} = {tuple(shape)}"
        ) from None
    return broadcast_view(xp, x, shape)


def broadcast_view(xp, x, shape):
    """``xp.broadcast_to(x, shape)``: a read-only view of ``x`` broadcast to ``shape``. A NumPy
    array of that shape already is viewed directly (the engines read the problem's arrays
    through read-only views, one type to the compiled kernels; ``np.broadcast_to`` took
    1.5-5 us of each of a call's three, the most of any step of its validation)."""
    if xp is np and x.shape == shape:
        view = x.view()
        view.flags.writeable = False
        return view
    return xp.broadcast_to(x, shape)


def check_backend(backend, xp) -> str:
    """The engine ``backend=`` names for arrays of namespace ``xp`` (``"auto"`` resolved);
    ValueError for an unknown name, TypeError for one that does not take these arrays."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"`backend` must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}"
        )
    lib = "cupy" if xp is not np else "numpy"
    if backend == "auto":
        return lib
    needs = {"numpy": "numpy", "emulate": "numpy", "cupy": "cupy"}[backend]
    if needs != lib:
        raise TypeError(
            f"backend={backend!r} takes {needs} arrays, got {lib} arrays; "
            f"use backend='auto' or convert the inputs"
        )
    return backend


def _check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be True or False, got {value!r}")
    return bool(value)


def _check_real(value, name, *, positive=False):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"`{name}` must be > 0, got {value}")
    return value


def _check_window(window, lq, lk, diagonal):
    """``(left, right)`` with ints >= 0 or None. A side of ``Lq + Lk + |diagonal - (Lk - Lq)|``
    or more (``Lq + Lk`` at the default offsets) reaches past every key from every query and
    becomes None (unbounded), so no engine does arithmetic with huge sides."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"`window` must be a pair (left, right) of ints or None, got {window!r}")
    sides = []
    for side_name, side in zip(("left", "right"), window):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise TypeError(
                f"`window` {side_name} side must be an int >= 0 or None, got {side!r}"
            )
        if side < 0:
            raise ValueError(f"`window` {side_name} side must be >= 0, got {int(side)}")
        sides.append(None if side >= lq + lk + abs(diagonal - (lk - lq)) else int(side))
    return tuple(sides)


def _check_offset(value, name, *, optional=False):
    """An int position offset (a NumPy int too; not a bool), of any size."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        expected = "an int or None" if optional else "an int"
        raise TypeError(f"`{name}` must be {expected} (a position), got "
                        f"{type(value).__name__} {value!r}")
    return int(value)


def _check_workers(value):
    """``workers=`` as in ``scipy.fft``: None, a positive count, or a negative one counted back
    from ``os.cpu_count()`` (-1 = all of them). Returns None or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`workers` must be an int or None, got {type(value).__name__} {value!r}")
    value = int(value)
    if value == 0:
        raise ValueError("`workers` must be a positive int, a negative int >= -os.cpu_count() "
                         "or None, got 0")
    if value < 0:
        cpus = os.cpu_count() or 1                 # read only here: 20 us on some machines
        if value < -cpus:
            raise ValueError(f"`workers` counts back from os.cpu_count() = {cpus} when "
                             f"negative, so it must be >= {-cpus}, got {value}")
        value += cpus + 1
    return value


def _check_matrix(x, name, dims):
    if x.ndim < 2:
        raise ValueError(
            f"`{name}` must have at least 2 dimensions (..., {dims}), got shape {tuple(x.shape)}"
        )


def _check_bias_block(value):
    """``bias_block=``: None, a positive int r (r x r blocks) or a pair (r, c) of them."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or any(isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral)
                             for n in pair):
        raise TypeError(f"`bias_block` must be an int r or a pair (r, c) of ints, got {value!r}")
    if min(pair) < 1:
        raise ValueError(f"`bias_block` sizes must be >= 1, got {tuple(int(n) for n in pair)}")
    return (int(pair[0]), int(pair[1]))


def _float_operand(xp, x, name, min_ndim, dims):
    """``x`` as an array of a real floating dtype with at least ``min_ndim`` dimensions, the
    last ones named ``dims``."""
    x = _as_array(xp, x, name)
    _check_float(x, name)
    if x.ndim < min_ndim:
        raise ValueError(f"`{name}` must have at least {min_ndim} dimension"
                         f"{'s' if min_ndim > 1 else ''} (..., {dims}), got shape "
                         f"{tuple(x.shape)}")
    return x


def _check_table(x, name, axis, axis_name):
    """A relative table (``rel_bias``, ``rel_k``) holds an odd number ``R = 2 * radius + 1`` of
    distances on ``axis``: entry ``radius + delta`` is distance ``delta``."""
    n = x.shape[axis]
    if n % 2 == 0:
        raise ValueError(
            f"`{name}` must hold an odd number R = 2 * radius + 1 of distances along its "
            f"{axis_name} axis (entry radius + delta is distance delta), got R = {n} in shape "
            f"{tuple(x.shape)}"
        )


def _check_relative(xp, rel_bias, rel_q, rel_k, batch, lq, acc):
    """``rel_bias`` -> S + (Rb,), ``rel_q`` -> S + (Lq, Dr), ``rel_k`` -> S + (Rk, Dr): views in
    the accumulation dtype, converted over the span they reach (never expanded)."""
    if rel_bias is not None:
        rel_bias = _float_operand(xp, rel_bias, "rel_bias", 1, "R")
        _check_table(rel_bias, "rel_bias", -1, "last")
        rel_bias = _broadcast_to(xp, rel_bias, batch + rel_bias.shape[-1:], "rel_bias",
                                 "S + (R,)")
        rel_bias = astype_view(xp, rel_bias, acc)
    if (rel_q is None) != (rel_k is None):
        given, missing = ("rel_q", "rel_k") if rel_k is None else ("rel_k", "rel_q")
        raise ValueError(f"`{given}` was given without `{missing}`: the relative term "
                         f"rel_q[i] . rel_k[radius + delta] needs both")
    if rel_q is not None:
        rel_q = _float_operand(xp, rel_q, "rel_q", 2, "Lq, Dr")
        rel_k = _float_operand(xp, rel_k, "rel_k", 2, "R, Dr")
        _check_table(rel_k, "rel_k", -2, "second-to-last (R)")
        if rel_q.shape[-1] != rel_k.shape[-1]:
            raise ValueError(
                f"`rel_q` and `rel_k` must share their last dimension Dr, got rel_q.shape = "
                f"{tuple(rel_q.shape)} and rel_k.shape = {tuple(rel_k.shape)}"
            )
        dr = rel_k.shape[-1]
        rel_q = _broadcast_to(xp, rel_q, batch + (lq, dr), "rel_q", "S + (Lq, Dr)")
        rel_k = _broadcast_to(xp, rel_k, batch + rel_k.shape[-2:], "rel_k", "S + (R, Dr)")
        rel_q, rel_k = astype_view(xp, rel_q, acc), astype_view(xp, rel_k, acc)
    return rel_bias, rel_q, rel_k


# --------------------------------------------------------------------------------------------
# attention


def _options_of(options: Options | None, keywords: dict[str, Any]) -> Options:
    """The call's :class:`Options`: as given, or built from its keywords (an unknown keyword is
    a TypeError naming it)."""
    if options is None:
        unknown = sorted(set(keywords) - set(names()))
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r}; the options are "
                            f"{', '.join(names())}")
        return Options(**keywords)
    if keywords:
        raise TypeError(f"pass the options as one Options or as keywords, not both (got "
                        f"Options and {', '.join(sorted(keywords))})")
    return options


def validate_attention(q, k, v, options: Options | None = None, *, return_lse: bool = False,
                       **keywords: Any) -> Problem:
    """Check the arguments of :func:`cuonline.attention` and build its :class:`Problem`.

    The options come as one :class:`cuonline._options.Options` (the public functions) or as
    its keywords (tools and tests: ``validate_attention(q, k, v, causal=True)``), not both.
    """
    o = _options_of(options, keywords)
    arrays = {n: x for n, x in o.arrays().items() if n not in CU_SEQLENS}
    xp = array_namespace(q=q, k=k, v=v, **arrays)
    backend = check_backend(o.backend, xp)
    varlen = _check_varlen_options(o)
    q, k, v = (_as_array(xp, x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    _check_matrix(q, "q", "Lq, D")
    _check_matrix(k, "k", "Lk, D")
    _check_matrix(v, "v", "Lk, Dv")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float(x, n)
    # byte order is storage, not dtype: '>f8' is float64 for every rule below
    dtype_q, dtype_k, dtype_v = (_native_dtype(x.dtype) for x in (q, k, v))
    if not (dtype_q == dtype_k == dtype_v):
        raise TypeError(
            f"`q`, `k` and `v` must share one dtype, got {dtype_q}, {dtype_k} and {dtype_v}; "
            f"convert them first, e.g. k.astype(q.dtype)"
        )
    lq, d = q.shape[-2:]
    lk, dk = k.shape[-2:]
    lv, dv = v.shape[-2:]
    if dk != d:
        raise ValueError(
            f"`k` must have the head dimension of `q` (D = {d}), got k.shape = {tuple(k.shape)}"
        )
    if lv != lk:
        raise ValueError(
            f"`v` must have as many rows as `k` (Lk = {lk}), got v.shape = {tuple(v.shape)}"
        )
    if xp is not np:
        _check_same_device(q=q, k=k, v=v, **arrays)
    try:
        batch = (tuple(q.shape[:-2]) if q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
                 else tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])))
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of `q` {tuple(q.shape[:-2])}, `k` "
            f"{tuple(k.shape[:-2])} and `v` {tuple(v.shape[:-2])} do not broadcast together"
        ) from None

    if backend in _CUDA_BACKENDS:
        _check_cuda_limits(backend, batch, lq, lk, d, dv)
    dtype = dtype_q
    acc = _semantics.accumulation_dtype(dtype)
    scale = 1.0 / math.sqrt(max(d, 1)) if o.scale is None else _check_real(o.scale, "scale")
    softcap = None if o.softcap is None else _check_real(o.softcap, "softcap", positive=True)
    softcap_bias = _check_bool(o.softcap_bias, "softcap_bias")
    if softcap_bias and softcap is None:
        raise ValueError("`softcap_bias=True` caps the whole logit with `softcap`, but "
                         "`softcap` is None; pass softcap=c or leave softcap_bias=False")
    diagonal = _semantics.diagonal_offset(
        lq, lk, _check_offset(o.q_offset, "q_offset", optional=True),
        _check_offset(o.k_offset, "k_offset"))
    precision = o.precision
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}"
        )
    if precision == "tf32" and dtype != np.float32:
        raise ValueError(f"precision='tf32' applies to float32 inputs, got {dtype.name}")
    causal = _check_bool(o.causal, "causal")
    workers = _check_workers(o.workers)
    return_lse = _check_bool(return_lse, "return_lse")
    # with cu_seqlens, a side that reaches past every key of the whole batch reaches past
    # those of each sequence too (a sequence's bound is at most the batch's)
    window = _semantics.effective_window(causal, _check_window(o.window, lq, lk, diagonal))
    cu_q = cu_k = diagonals = None
    if varlen:
        cu_q = check_cu_seqlens(o.cu_seqlens_q, "cu_seqlens_q", lq, "q.shape[-2]")
        cu_k = check_cu_seqlens(o.cu_seqlens_k, "cu_seqlens_k", lk, "k.shape[-2]")
        if cu_q.shape != cu_k.shape:
            raise ValueError(
                f"`cu_seqlens_q` and `cu_seqlens_k` must have the same length B + 1 (one "
                f"boundary more than sequences), got {cu_q.shape[0]} and {cu_k.shape[0]}")
        diagonals = tuple(_semantics.sequence_diagonals(
            cu_q, cu_k, _check_offset(o.q_offset, "q_offset", optional=True),
            _check_offset(o.k_offset, "k_offset")))

    scores_shape = batch + (lq, lk)
    scores_name = "S + (Lq, Lk)"
    bias_block = _check_bias_block(o.bias_block)
    bias, mask, kv_lengths, alibi_slopes = o.bias, o.mask, o.kv_lengths, o.alibi_slopes
    bias_shape, bias_name = scores_shape, scores_name
    if bias_block is not None:
        if bias is None:
            raise ValueError("`bias_block` says how `bias` repeats over blocks of scores, but "
                             "`bias` is None; pass the coarse bias or leave bias_block=None")
        r, c = bias_block
        bias_shape = batch + (-(-lq // r), -(-lk // c))
        bias_name = f"S + (ceil(Lq / {r}), ceil(Lk / {c})) (bias_block={bias_block})"
    if bias is not None:
        bias = _as_array(xp, bias, "bias")
        if not _is_float_dtype(bias.dtype):
            hint = "; pass booleans as `mask=`" if bias.dtype == bool else ""
            raise TypeError(f"`bias` must have a real floating dtype, got {bias.dtype}{hint}")
        bias = _broadcast_to(xp, bias, bias_shape, "bias", bias_name)
        bias = astype_view(xp, bias, acc)   # converts what the view reaches, not its size
    if mask is not None:
        mask = _as_array(xp, mask, "mask")
        if mask.dtype != bool:
            raise TypeError(
                f"`mask` must be a boolean array (True = may attend), got dtype {mask.dtype}"
            )
        mask = _broadcast_to(xp, mask, scores_shape, "mask", scores_name)
    if kv_lengths is not None:
        kv_lengths = _as_array(xp, _clip_python_ints(kv_lengths, lk), "kv_lengths")
        if np.dtype(kv_lengths.dtype).kind not in "iu":
            raise TypeError(f"`kv_lengths` must be an integer array, got dtype {kv_lengths.dtype}")
        kv_lengths = _broadcast_to(xp, kv_lengths, batch, "kv_lengths", "the batch shape S")
        if kv_lengths.size and bool((kv_lengths < 0).any()):
            raise ValueError(
                f"`kv_lengths` must be >= 0, got minimum {int(kv_lengths.min())}"
            )
        # xp.asarray: NumPy's minimum of 0-d arrays is a scalar, and the kernels take a pointer
        kv_lengths = xp.asarray(xp.minimum(kv_lengths, lk)).astype(np.int64, order="C")
    if alibi_slopes is not None:
        alibi_slopes = _as_array(xp, alibi_slopes, "alibi_slopes")
        if not _is_float_dtype(alibi_slopes.dtype):
            raise TypeError(
                f"`alibi_slopes` must have a real floating dtype, got {alibi_slopes.dtype}"
            )
        alibi_slopes = _broadcast_to(xp, alibi_slopes, batch, "alibi_slopes", "the batch shape S")
        alibi_slopes = alibi_slopes.astype(acc, order="C")
    rel_bias, rel_q, rel_k = _check_relative(xp, o.rel_bias, o.rel_q, o.rel_k, batch, lq, acc)
    if backend in _CUDA_BACKENDS:
        _check_cuda_relative(backend, rel_bias, rel_k)
    # with nothing added to the content score, capping it or the whole logit is one thing:
    # one variant fewer to compile
    softcap_bias = softcap_bias and (bias is not None or alibi_slopes is not None
                                     or rel_bias is not None)

    return Problem(
        xp=xp, backend=backend, batch_shape=batch, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype,
        acc_dtype=acc, scale=scale, causal=causal, window=window, softcap=softcap,
        return_lse=return_lse, precision=precision,
        q=broadcast_view(xp, _native(xp, q), batch + (lq, d)),
        k=broadcast_view(xp, _native(xp, k), batch + (lk, d)),
        v=broadcast_view(xp, _native(xp, v), batch + (lk, dv)),
        bias=bias, mask=mask, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes,
        workers=workers, diagonal_offset=diagonal, softcap_bias=softcap_bias,
        bias_block=bias_block, rel_bias=rel_bias, rel_q=rel_q, rel_k=rel_k,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sequence_diagonals=diagonals,
    )


# --------------------------------------------------------------------------------------------
# packed variable-length batches (issue 20)

CU_SEQLENS = ("cu_seqlens_q", "cu_seqlens_k")
#: Options whose shapes span the padded (Lq, Lk) plane or the batch: no meaning across packed
#: sequences.
_NOT_WITH_VARLEN = ("bias", "mask", "bias_block", "kv_lengths")


def _check_varlen_options(o: Options) -> bool:
    """Whether the call is a packed variable-length batch: ``cu_seqlens_q`` and
    ``cu_seqlens_k`` given together, without the options that have no meaning across
    sequences."""
    given = [n for n in CU_SEQLENS if getattr(o, n) is not None]
    if not given:
        return False
    if len(given) == 1:
        missing = "cu_seqlens_k" if given[0] == "cu_seqlens_q" else "cu_seqlens_q"
        raise ValueError(f"`{given[0]}` was given without `{missing}`: a packed batch needs "
                         f"the boundaries of its sequences along both the query and key axes "
                         f"(pass the same array twice for self-attention)")
    for name in _NOT_WITH_VARLEN:
        if getattr(o, name) is not None:
            raise ValueError(
                f"`{name}` cannot be combined with `cu_seqlens_q`/`cu_seqlens_k`: its shape "
                f"spans the whole (Lq, Lk) plane or the batch, which has no meaning across "
                f"packed sequences; got {name}={_describe(getattr(o, name))}. Use the "
                f"per-sequence options (causal, window, alibi_slopes, rel_bias, rel_q/rel_k) "
                f"or call without cu_seqlens on padded arrays")
    return True


def _describe(value) -> str:
    shape = getattr(value, "shape", None)
    return f"an array of shape {tuple(shape)}" if shape is not None else repr(value)


def check_cu_seqlens(value, name, total, total_name):
    """``cu_seqlens_*``: a 1-D integer array of B + 1 boundaries, 0 first, non-decreasing,
    ``total`` last, of any array library (its B + 1 integers are read on the host: the
    engines plan there). Returned as int64 NumPy."""
    lib = _arrays.library(value)
    if lib == "dask":
        raise TypeError(f"`{name}` must be a computed array (NumPy, a list of ints, ...), got "
                        f"a Dask array; call .compute() on it first")
    if lib not in (None, "numpy"):
        value = _arrays.adapt({name: value})[0][name]    # torch, JAX, ...: NumPy or CuPy
        if _arrays.library(value) == "cupy":
            value = value.get()
    try:
        arr = np.asarray(value)
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument's name
        raise TypeError(f"`{name}` must be a 1-D integer array, got "
                        f"{type(value).__name__}: {exc}") from None
    if arr.dtype.kind not in "iu":
        kind = {"b": "boolean", "f": "floating", "c": "complex", "O": "object"}.get(
            arr.dtype.kind, arr.dtype.name)
        raise TypeError(f"`{name}` must be a 1-D integer array of sequence boundaries, got "
                        f"{kind} dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"`{name}` must be 1-D with B + 1 >= 1 boundaries, got shape "
                         f"{tuple(arr.shape)}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > total:
        raise ValueError(f"`{name}` must end at {total_name} = {total}, got a boundary "
                         f"{int(arr.max())}")
    arr = arr.astype(np.int64)
    if int(arr[0]) != 0:
        raise ValueError(f"`{name}` must start at 0, got {int(arr[0])}")
    steps = np.diff(arr)
    if steps.size and int(steps.min()) < 0:
        b = int(np.argmax(steps < 0))
        raise ValueError(f"`{name}` must be non-decreasing (sequence lengths >= 0), got "
                         f"{name}[{b + 1}] = {int(arr[b + 1])} < {name}[{b}] = {int(arr[b])}")
    if int(arr[-1]) != total:
        raise ValueError(f"`{name}` must end at {total_name} = {total} (the packed length), "
                         f"got {int(arr[-1])}")
    return arr


def _check_cuda_limits(backend, batch, lq, lk, d, dv):
    """The sizes cuonline's CUDA kernels take: heads up to MAX_HEAD_DIM (registers and shared
    memory), Lq and Lk in 32 bits, and a grid of batch x query blocks within CUDA's limit."""
    if max(d, dv) > _CUDA_MAX_HEAD_DIM:
        raise ValueError(
            f"backend={backend!r} supports head dimensions up to {_CUDA_MAX_HEAD_DIM}, got "
            f"D = {d}, Dv = {dv}; use backend='numpy' or split the head dimension"
        )
    if max(lq, lk) >= 2**31:
        raise ValueError(f"backend={backend!r} needs Lq and Lk below 2**31, got Lq = {lq}, "
                         f"Lk = {lk}")
    # Every attention family plans at least MIN_BLOCK_M query rows per block beyond 16 rows
    # and one block up to 16, so this bounds the grid of whatever family runs the call.
    blocks = math.prod(batch) * (1 if lq <= 16 else math.ceil(lq / _heuristics.MIN_BLOCK_M))
    if blocks > _heuristics.MAX_GRID_X:
        raise ValueError(
            f"backend={backend!r} launches a block per batch element and "
            f"{_heuristics.MIN_BLOCK_M} query rows or more; the batch shape {batch} with "
            f"Lq = {lq} may need {blocks} blocks, above CUDA's grid limit "
            f"{_heuristics.MAX_GRID_X}; split the batch into chunks"
        )


def _check_cuda_relative(backend, rel_bias, rel_k):
    """The relative terms the CUDA kernels take: Dr up to MAX_HEAD_DIM (it is staged like a
    head), tables whose radius fits the kernels' 32-bit distance arithmetic."""
    if rel_k is not None and rel_k.shape[-1] > _CUDA_MAX_HEAD_DIM:
        raise ValueError(
            f"backend={backend!r} supports `rel_q`/`rel_k` widths Dr up to {_CUDA_MAX_HEAD_DIM}, "
            f"got Dr = {rel_k.shape[-1]}; use backend='numpy' or split Dr"
        )
    for name, table in (("rel_bias", rel_bias), ("rel_k", rel_k)):
        axis = -1 if name == "rel_bias" else -2
        if table is not None and (table.shape[axis] - 1) // 2 > _CUDA_MAX_REL_RADIUS:
            raise ValueError(
                f"backend={backend!r} takes relative tables of at most "
                f"{2 * _CUDA_MAX_REL_RADIUS + 1} distances, got `{name}` with R = "
                f"{table.shape[axis]}; distances beyond +-(Lq + Lk) are never read, so pass "
                f"the middle 2 * (Lq + Lk) + 1 entries"
            )


def _check_same_device(**named):
    import cupy

    current = cupy.cuda.Device().id
    for name, x in named.items():
        dev = getattr(getattr(x, "device", None), "id", current)
        if _arrays.library(x) == "cupy" and dev != current:
            raise ValueError(
                f"`{name}` lives on GPU {dev} but the current device is GPU {current}; "
                f"call inside `with cupy.cuda.Device({dev}):` or move the array"
            )


# --------------------------------------------------------------------------------------------
# softmax, log_softmax, logsumexp


@dataclass(frozen=True)
class SoftmaxProblem:
    """One call of the softmax family, checked and normalised; the only input its CUDA engine
    receives.

    ``x`` is in native byte order, ``axis`` non-negative, ``mask`` a bool view broadcast to
    ``x.shape`` or None.
    """

    xp: Any                    # numpy or cupy
    backend: str               # resolved engine: "numpy", "cupy" or "emulate"
    mode: str                  # "softmax", "log_softmax" or "logsumexp"
    x: Any
    axis: int
    mask: Any = None
    keepdims: bool = False     # logsumexp: keep the reduced axis with length 1
    scale: float = 1.0         # multiplies x (folded into the exponent); 1 from the public API

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.x.dtype)

    @property
    def acc_dtype(self) -> np.dtype:
        return _semantics.accumulation_dtype(self.x.dtype)

    @property
    def n(self) -> int:
        """Length of the reduced axis."""
        return self.x.shape[self.axis]


def validate_axis_input(x, axis, mask, backend, *, mode="softmax", keepdims=False):
    """Check the arguments of :func:`cuonline.softmax`, :func:`cuonline.log_softmax` or
    :func:`cuonline.logsumexp` (``mode``) and build their :class:`SoftmaxProblem`: ``x`` in
    native byte order (a non-native ``x`` is converted), ``axis`` normalised to a
    non-negative int, ``mask`` broadcast to ``x.shape`` (a view) or None."""
    if mode not in SOFTMAX_MODES:
        raise ValueError(f"`mode` must be one of {', '.join(map(repr, SOFTMAX_MODES))}; "
                         f"got {mode!r}")
    xp = array_namespace(x=x, mask=mask)
    backend = check_backend(backend, xp)
    x = _as_array(xp, x, "x")
    _check_float(x, "x")
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"`axis` must be an int, got {axis!r}")
    if not -x.ndim <= axis < x.ndim or x.ndim == 0:
        raise ValueError(f"`axis` {axis} is out of range for `x` with {x.ndim} dimensions")
    axis = int(axis) % x.ndim
    if mask is not None:
        mask = _as_array(xp, mask, "mask")
        if mask.dtype != bool:
            raise TypeError(f"`mask` must be a boolean array (True = keep), got dtype {mask.dtype}")
        mask = _broadcast_to(xp, mask, x.shape, "mask", "x.shape")
    keepdims = _check_bool(keepdims, "keepdims")
    return SoftmaxProblem(xp=xp, backend=backend, mode=mode, x=_native(xp, x), axis=axis,
                          mask=mask, keepdims=keepdims)


# --------------------------------------------------------------------------------------------
# merge


def validate_merge(states):
    """Check the ``(out, lse)`` states of :func:`cuonline.merge`.

    Every ``out`` has one real floating dtype and shape ``(..., Lq, Dv)``; every ``lse`` one real
    floating dtype (any: attention returns the accumulation dtype of ``out``) and shape
    ``out.shape[:-1]``. Returns ``(xp, outs, lses)``, lists of arrays in native byte order.
    """
    if not states:
        raise ValueError("`merge` needs at least one (out, lse) state, got none")
    for n, state in enumerate(states):
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError(
                f"state {n} must be an (out, lse) pair, got {type(state).__name__}"
            )
    named = {}
    for n, (o, s) in enumerate(states):
        named[f"states[{n}][0]"] = o
        named[f"states[{n}][1]"] = s
    xp = array_namespace(**named)
    outs = [_as_array(xp, o, f"states[{n}][0]") for n, (o, _) in enumerate(states)]
    lses = [_as_array(xp, s, f"states[{n}][1]") for n, (_, s) in enumerate(states)]
    for n, (o, s) in enumerate(zip(outs, lses)):
        _check_float(o, "", label=f"state {n}: `out`")
        _check_float(s, "", label=f"state {n}: `lse`")
        if o.ndim < 1 or o.shape[:-1] != s.shape:
            raise ValueError(
                f"state {n}: `out` must have shape lse.shape + (Dv,), got out {o.shape} "
                f"and lse {s.shape}"
            )
        if o.shape != outs[0].shape:
            raise ValueError(
                f"state {n}: `out` has shape {o.shape} but state 0 has {outs[0].shape}"
            )
        for name, arrays in (("out", outs), ("lse", lses)):
            here, first = _native_dtype(arrays[n].dtype), _native_dtype(arrays[0].dtype)
            if here != first:
                raise TypeError(
                    f"state {n}: `{name}` has dtype {here} but state 0 has {first}; all states "
                    f"must share one `{name}` dtype: convert them first"
                )
    if xp is not np:
        _check_same_device(**{f"states[{n}][{i}]": x for n, (o, s) in enumerate(zip(outs, lses))
                              for i, x in enumerate((o, s))})
    return xp, [_native(xp, o) for o in outs], [_native(xp, s) for s in lses]


# --------------------------------------------------------------------------------------------
# attention_backward (issue 13)


@dataclass(frozen=True)
class BackwardProblem:
    """One :func:`cuonline.attention_backward` call, checked and normalised.

    ``forward`` is the attention call's :class:`Problem`; ``dout`` (a view broadcast to
    ``batch_shape + (lq, dv)``, the dtype of ``q``), ``out`` and ``lse`` (as attention returned
    them) are in native byte order. ``targets`` maps each input that receives a gradient
    (``"q"``, ``"k"``, ``"v"``, and ``"bias"``, ``"rel_bias"``, ``"rel_q"``, ``"rel_k"`` when
    given) to its :class:`cuonline._gradients.Target`: the shape the user passed and the
    gradient's dtype, which say how a broadcast gradient is summed.
    """

    forward: Problem
    dout: Any                  # batch_shape + (lq, dv), dtype of q
    out: Any                   # batch_shape + (lq, dv), dtype of q
    lse: Any                   # batch_shape + (lq,), acc_dtype
    targets: dict

    def reduce(self, name, grad):
        """The gradient of input ``name`` as the user gets it, from ``grad``, its gradient per
        batch element (``batch_shape`` + the input's trailing dimensions, any dtype): summed
        over the dimensions the input was broadcast along
        (:func:`cuonline._gradients.sum_to_shape`: a fixed order), in the gradient's dtype."""
        from ._gradients import sum_to_shape

        t = self.targets[name]
        return sum_to_shape(self.forward.xp, grad, t.shape, t.tail).astype(t.dtype, copy=False)


def validate_attention_backward(dout, q, k, v, out, lse, options: Options | None = None,
                                **keywords: Any) -> BackwardProblem:
    """Check the arguments of :func:`cuonline.attention_backward` and build its
    :class:`BackwardProblem`.

    The options (an :class:`cuonline._options.Options` or its keywords, as
    :func:`validate_attention` takes them) are checked by the forward's own rules. ``out`` and
    ``lse`` must be what ``attention(q, k, v, **options, return_lse=True)`` returned: shapes
    ``S + (Lq, Dv)`` and ``S + (Lq,)``, dtypes that of `q` and its accumulation dtype (float64
    for float64 inputs, else float32). ``dout`` has the dtype of `q` and broadcasts to
    ``S + (Lq, Dv)``.
    """
    from ._gradients import Target

    o = _options_of(options, keywords)
    xp = array_namespace(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    p = validate_attention(q, k, v, o, return_lse=True)
    if isinstance(dout, numbers.Real) and not isinstance(dout, (bool, np.bool_, np.generic)):
        # a Python number takes the inputs' dtype, as Python numbers do in every other option
        dout = xp.asarray(dout, dtype=p.dtype)
    dout, out, lse = (_as_array(xp, x, n) for x, n in ((dout, "dout"), (out, "out"),
                                                        (lse, "lse")))
    if xp is not np:
        _check_same_device(dout=dout, out=out, lse=lse)
    out_shape = p.batch_shape + (p.lq, p.dv)
    for x, name in ((dout, "dout"), (out, "out"), (lse, "lse")):
        _check_float(x, name)
    if tuple(out.shape) != out_shape:
        raise ValueError(f"`out` must have the shape attention returned, S + (Lq, Dv) = "
                         f"{out_shape}, got {tuple(out.shape)}")
    if tuple(lse.shape) != out_shape[:-1]:
        raise ValueError(f"`lse` must have the shape attention returned, S + (Lq,) = "
                         f"{out_shape[:-1]}, got {tuple(lse.shape)}")
    dout = _broadcast_to(xp, dout, out_shape, "dout", "S + (Lq, Dv)")
    for x, name in ((dout, "dout"), (out, "out")):
        if _native_dtype(x.dtype) != p.dtype:
            raise TypeError(f"`{name}` must have the dtype of `q` ({p.dtype.name}), got "
                            f"{_native_dtype(x.dtype).name}")
    if _native_dtype(lse.dtype) != p.acc_dtype:
        raise TypeError(f"`lse` must have the dtype attention returns for {p.dtype.name} "
                        f"inputs, {p.acc_dtype.name}, got {_native_dtype(lse.dtype).name}")
    # every input that receives a gradient: its shape as passed says how to sum over the
    # dimensions it was broadcast along (tail: its own trailing dimensions)
    targets = {name: Target(shape=tuple(xp.asarray(x).shape), dtype=p.dtype, tail=2)
               for name, x in (("q", q), ("k", k), ("v", v))}
    for name in differentiable_options():
        x = getattr(o, name)
        if x is not None:
            x = xp.asarray(x)          # already accepted by validate_attention
            targets[name] = Target(shape=tuple(x.shape), dtype=_native_dtype(x.dtype),
                                   tail=len(array_layout(name)))
    return BackwardProblem(forward=p, dout=_native(xp, dout), out=_native(xp, out),
                           lse=_native(xp, lse), targets=targets)


# --------------------------------------------------------------------------------------------
# attention_stats (issue 21)


@dataclass(frozen=True)
class StatsProblem:
    """One :func:`cuonline.attention_stats` call, checked and normalised.

    ``scores`` is the attention :class:`Problem` of the call's score options, built by
    :func:`validate_attention` with a zero-width ``v`` (the statistics read no values), so the
    scores follow attention's rules exactly. The statistics' own arguments are checked here.
    """

    scores: Problem
    entropy: bool
    received: bool
    query_weights: Any         # batch_shape + (lq,), acc_dtype, or None (ones)
    top_k: int                 # >= 0
    rows: Any                  # 1-D int64 query indices in [0, lq), or None


def validate_attention_stats(q, k, options: Options, *, entropy=True, received=False,
                             query_weights=None, top_k=0, rows=None) -> StatsProblem:
    """Check the arguments of :func:`cuonline.attention_stats` and build its
    :class:`StatsProblem`.

    The score options are checked by :func:`validate_attention` (with ``v`` a zero-width view
    of `k`); `entropy` and `received` are bools, `query_weights` a real array broadcastable
    to ``S + (Lq,)`` given only with ``received=True``, `top_k` an int >= 0, `rows` a 1-D
    integer array of query indices in ``[-Lq, Lq)`` (negative ones count from the end).
    """
    xp = array_namespace(q=q, k=k, query_weights=query_weights, rows=rows, **options.arrays())
    k_array = _as_array(xp, k, "k")
    # the statistics depend on the scores only: a zero-width v passes attention's checks of
    # v whatever k is (k's own errors come first), and costs nothing
    v = k_array[..., :0] if k_array.ndim >= 2 else k_array
    q_array = _as_array(xp, q, "q")
    if (q_array.ndim >= 2 and k_array.ndim >= 2 and _is_float_dtype(q_array.dtype)
            and _is_float_dtype(k_array.dtype)
            and _native_dtype(q_array.dtype) != _native_dtype(k_array.dtype)):
        raise TypeError(f"`q` and `k` must share one dtype, got {_native_dtype(q_array.dtype)} "
                        f"and {_native_dtype(k_array.dtype)}; convert them first, e.g. "
                        f"k.astype(q.dtype)")
    p = validate_attention(q_array, k_array, v, options, return_lse=True)
    entropy = _check_bool(entropy, "entropy")
    received = _check_bool(received, "received")
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"`top_k` must be an int >= 0, got {type(top_k).__name__} {top_k!r}")
    if top_k < 0:
        raise ValueError(f"`top_k` must be >= 0, got {int(top_k)}")
    if p.backend in _CUDA_BACKENDS and p.cu_seqlens_q is not None:
        raise ValueError(f"attention_stats of packed batches (`cu_seqlens_q`, `cu_seqlens_k`) "
                         f"runs on the NumPy engine only (backend={p.backend!r}): the CUDA "
                         f"statistics kernels take padded batches; use backend='numpy' (NumPy "
                         f"arrays), or attention with the packed batch")
    if p.backend in _CUDA_BACKENDS and int(top_k) > _CUDA_STATS_MAX_TOP_K:
        raise ValueError(f"`top_k` must be at most {_CUDA_STATS_MAX_TOP_K} on the CUDA engine "
                         f"(backend={p.backend!r}: one key per lane of a warp), got {int(top_k)}; "
                         f"use backend='numpy' (NumPy arrays) for more")
    if query_weights is not None:
        if not received:
            raise ValueError("`query_weights` weighs the queries in the attention `received` "
                             "by each key, but received=False; pass received=True")
        query_weights = _as_array(xp, query_weights, "query_weights")
        if np.dtype(query_weights.dtype).kind not in "biuf":
            raise TypeError(f"`query_weights` must be a real array (float, int or bool), got "
                            f"dtype {query_weights.dtype}")
        query_weights = _broadcast_to(xp, query_weights, p.batch_shape + (p.lq,),
                                      "query_weights", "S + (Lq,)")
        query_weights = astype_view(xp, query_weights, p.acc_dtype)
        if query_weights.size and not bool(xp.isfinite(query_weights).all()):
            raise ValueError("`query_weights` must be finite, got NaN or infinity")
    if rows is not None:
        rows = _as_array(xp, rows, "rows")
        if rows.size == 0 and rows.ndim == 1:
            rows = rows.astype(np.int64)       # [] is float64 to NumPy: no index either way
        if np.dtype(rows.dtype).kind not in "iu":
            raise TypeError(f"`rows` must be an integer array of query indices, got dtype "
                            f"{rows.dtype}")
        if rows.ndim != 1:
            raise ValueError(f"`rows` must be 1-D (query indices), got shape "
                             f"{tuple(rows.shape)}")
        if rows.size and (int(rows.min()) < -p.lq or int(rows.max()) >= p.lq):
            bad = int(rows.min()) if int(rows.min()) < -p.lq else int(rows.max())
            raise ValueError(f"`rows` must hold query indices in [-Lq, Lq) = [{-p.lq}, {p.lq}), "
                             f"got {bad}")
        rows = xp.asarray(rows, dtype=np.int64) % max(p.lq, 1)
    return StatsProblem(scores=p, entropy=entropy, received=received,
                        query_weights=query_weights, top_k=int(top_k), rows=rows)
