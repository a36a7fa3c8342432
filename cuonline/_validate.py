"""Argument checks: user input in, a frozen :class:`Problem` out.

Every user-facing error of cuonline is raised here, before any work is done, and names the
argument, what was expected and what came. Engines receive a :class:`Problem` whose arrays are
zero-copy views broadcast to the batch shape, so no engine repeats a check or a broadcast.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _semantics

__all__ = ["BACKENDS", "Problem", "array_namespace", "validate_attention", "validate_axis_input"]

#: Engine names accepted by ``backend=``; "auto" picks by the array library of the inputs.
BACKENDS = ("auto", "numpy", "cupy", "emulate")
#: Values of ``precision=``: "highest" computes in the accumulation dtype; "tf32" lets the
#: CUDA engine use TF32 tensor cores for float32 inputs.
PRECISIONS = ("highest", "tf32")

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


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

    @property
    def nbatch(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def has_window(self) -> bool:
        return self.window != (None, None)


# --------------------------------------------------------------------------------------------
# array libraries


def _library(x) -> str | None:
    """'numpy', 'cupy' or None (not an array of either)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return "cupy"
    return None


def array_namespace(**named) -> Any:
    """Return numpy or cupy for the named arguments, which must not mix array libraries.

    ``None`` values and non-array values (lists, scalars) are ignored here; they are converted
    with the namespace chosen by the arrays.
    """
    seen = {}
    for name, x in named.items():
        lib = _library(x)
        if lib is not None:
            seen.setdefault(lib, name)
    if len(seen) > 1:
        (lib_a, arg_a), (lib_b, arg_b) = sorted(seen.items())
        raise TypeError(
            f"arrays from different libraries: `{arg_a}` is a {lib_a} array and `{arg_b}` is a "
            f"{lib_b} array; move them to one library first (cupy.asarray / cupy.asnumpy)"
        )
    if "cupy" in seen:
        import cupy

        return cupy
    return np


def _as_array(xp, x, name):
    try:
        return xp.asarray(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument's name
        raise TypeError(f"`{name}` must be an array, got {type(x).__name__}: {exc}") from None


def _is_float_dtype(dtype) -> bool:
    return np.dtype(dtype).name in _FLOAT_NAMES


def _check_float(x, name):
    dt = np.dtype(x.dtype)
    if not _is_float_dtype(dt):
        kind = {"b": "boolean", "i": "integer", "u": "unsigned integer", "c": "complex"}.get(
            dt.kind, dt.name
        )
        raise TypeError(
            f"`{name}` must have a real floating dtype (float16, bfloat16, float32 or float64), "
            f"got {kind} dtype {dt.name}"
        )


def _broadcast_to(xp, x, shape, name, expected):
    try:
        if np.broadcast_shapes(x.shape, shape) != tuple(shape):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"`{name}` of shape {tuple(x.shape)} does not broadcast to {expected} = {tuple(shape)}"
        ) from None
    return xp.broadcast_to(x, shape)


def _check_backend(backend, xp) -> str:
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


def _check_window(window):
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
        sides.append(int(side))
    return tuple(sides)


def _check_matrix(x, name, dims):
    if x.ndim < 2:
        raise ValueError(
            f"`{name}` must have at least 2 dimensions (..., {dims}), got shape {tuple(x.shape)}"
        )


# --------------------------------------------------------------------------------------------
# attention


def validate_attention(
    q, k, v, *, scale, causal, window, bias, mask, kv_lengths, alibi_slopes, softcap,
    return_lse, backend, precision="highest",
) -> Problem:
    """Check the arguments of :func:`cuonline.attention` and build its :class:`Problem`."""
    xp = array_namespace(
        q=q, k=k, v=v, bias=bias, mask=mask, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes
    )
    backend = _check_backend(backend, xp)
    q, k, v = (_as_array(xp, x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    _check_matrix(q, "q", "Lq, D")
    _check_matrix(k, "k", "Lk, D")
    _check_matrix(v, "v", "Lk, Dv")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float(x, n)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"`q`, `k` and `v` must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}; "
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
        _check_same_device(q=q, k=k, v=v, bias=bias, mask=mask, kv_lengths=kv_lengths,
                           alibi_slopes=alibi_slopes)
    try:
        batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    except ValueError:
        raise ValueError(
            f"the leading (batch) dimensions of `q` {tuple(q.shape[:-2])}, `k` "
            f"{tuple(k.shape[:-2])} and `v` {tuple(v.shape[:-2])} do not broadcast together"
        ) from None

    dtype = np.dtype(q.dtype)
    acc = _semantics.accumulation_dtype(dtype)
    scale = 1.0 / math.sqrt(max(d, 1)) if scale is None else _check_real(scale, "scale")
    softcap = None if softcap is None else _check_real(softcap, "softcap", positive=True)
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}"
        )
    if precision == "tf32" and dtype != np.float32:
        raise ValueError(f"precision='tf32' applies to float32 inputs, got {dtype.name}")
    causal = _check_bool(causal, "causal")
    return_lse = _check_bool(return_lse, "return_lse")
    window = _semantics.effective_window(causal, _check_window(window))

    scores_shape = batch + (lq, lk)
    scores_name = "S + (Lq, Lk)"
    if bias is not None:
        bias = _as_array(xp, bias, "bias")
        if not _is_float_dtype(bias.dtype):
            hint = "; pass booleans as `mask=`" if bias.dtype == bool else ""
            raise TypeError(f"`bias` must have a real floating dtype, got {bias.dtype}{hint}")
        bias = _broadcast_to(xp, bias.astype(acc, copy=False), scores_shape, "bias", scores_name)
    if mask is not None:
        mask = _as_array(xp, mask, "mask")
        if mask.dtype != bool:
            raise TypeError(
                f"`mask` must be a boolean array (True = may attend), got dtype {mask.dtype}"
            )
        mask = _broadcast_to(xp, mask, scores_shape, "mask", scores_name)
    if kv_lengths is not None:
        kv_lengths = _as_array(xp, kv_lengths, "kv_lengths")
        if np.dtype(kv_lengths.dtype).kind not in "iu":
            raise TypeError(f"`kv_lengths` must be an integer array, got dtype {kv_lengths.dtype}")
        kv_lengths = _broadcast_to(xp, kv_lengths, batch, "kv_lengths", "the batch shape S")
        if kv_lengths.size and bool((kv_lengths < 0).any()):
            raise ValueError(
                f"`kv_lengths` must be >= 0, got minimum {int(kv_lengths.min())}"
            )
        kv_lengths = xp.minimum(kv_lengths, lk).astype(np.int64, order="C")
    if alibi_slopes is not None:
        alibi_slopes = _as_array(xp, alibi_slopes, "alibi_slopes")
        if not _is_float_dtype(alibi_slopes.dtype):
            raise TypeError(
                f"`alibi_slopes` must have a real floating dtype, got {alibi_slopes.dtype}"
            )
        alibi_slopes = _broadcast_to(xp, alibi_slopes, batch, "alibi_slopes", "the batch shape S")
        alibi_slopes = alibi_slopes.astype(acc, order="C")

    return Problem(
        xp=xp, backend=backend, batch_shape=batch, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype,
        acc_dtype=acc, scale=scale, causal=causal, window=window, softcap=softcap,
        return_lse=return_lse, precision=precision,
        q=xp.broadcast_to(q, batch + (lq, d)),
        k=xp.broadcast_to(k, batch + (lk, d)),
        v=xp.broadcast_to(v, batch + (lk, dv)),
        bias=bias, mask=mask, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes,
    )


def _check_same_device(**named):
    import cupy

    current = cupy.cuda.Device().id
    for name, x in named.items():
        dev = getattr(getattr(x, "device", None), "id", current)
        if _library(x) == "cupy" and dev != current:
            raise ValueError(
                f"`{name}` lives on GPU {dev} but the current device is GPU {current}; "
                f"call inside `with cupy.cuda.Device({dev}):` or move the array"
            )


# --------------------------------------------------------------------------------------------
# softmax, log_softmax, logsumexp


def validate_axis_input(x, axis, mask, backend):
    """Check ``(x, axis, mask, backend)`` of the softmax family.

    Returns ``(xp, backend, x, axis, mask)`` with ``axis`` normalised to a non-negative int and
    ``mask`` broadcast to ``x.shape`` (a view) or None.
    """
    xp = array_namespace(x=x, mask=mask)
    backend = _check_backend(backend, xp)
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
    return xp, backend, x, axis, mask
