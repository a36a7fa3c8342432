"""What the framework bindings (:mod:`cuonline.jax`, :mod:`cuonline.torch`) share and no
framework knows: the options split into arrays and static values, the shapes of the results
found by cuonline's own validation on zero-memory stand-ins (so a framework's tracer gets the
same errors as a NumPy call, before anything runs), and the backward pass with the gradient of
``lse`` folded in. Everything here takes NumPy or CuPy arrays; the bindings adapt their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from . import _arrays, _options, _validate
from ._api import attention_backward
from ._gradients import GRADIENT_FIELDS, Gradients

__all__ = ["LAYOUTS", "Shapes", "attention_backward_with_lse", "check_static", "differentiable",
           "gradient_field", "heads_after_length", "shapes", "stand_in",
           "swap_length_heads", "tensor_options", "trailing_rank"]

#: ``layout=`` of the bindings: "bhld", cuonline's (..., heads, length, dim); "blhd",
#: (batch, length, heads, dim) as jax.nn.dot_product_attention, flax and FlashAttention take
LAYOUTS = ("bhld", "blhd")


def trailing_rank(name: str) -> int:
    """The number of trailing, non-batch dimensions of array argument ``name`` of attention
    or its backward (q, k, v, dout, out: 2; lse: 1; an array option: its table layout)."""
    if name in ("q", "k", "v", "dout", "out"):
        return 2
    if name == "lse":
        return 1
    return len(_options.array_layout(name))


def heads_after_length(layout: Any, q: Any, k: Any, v: Any) -> bool:
    """Whether ``layout`` is "blhd" (then `q`, `k` and `v` must have 4 dimensions, batch,
    length, heads, dim); a ValueError names a bad layout or the array that does not fit."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {', '.join(map(repr, LAYOUTS))}; "
                         f"got {layout!r}")
    if layout == "bhld":
        return False
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"layout='blhd' takes `{name}` of shape (batch, length, heads, "
                             f"dim), got shape {tuple(x.shape)}")
    return True


def differentiable(names) -> tuple[str, ...]:
    """Of the array arguments ``names``, those that receive a gradient, in order: q, k, v and
    the differentiable options of the table (bias, rel_bias, rel_q, rel_k)."""
    grads = _options.differentiable_options()
    return tuple(n for n in names if n in ("q", "k", "v") or n in grads)


def tensor_options(options: _options.Options) -> dict[str, Any]:
    """The array options given that travel as the framework's arrays (every array option but
    the sequence boundaries, which are host values the program is built from), by name."""
    return {n: x for n, x in options.arrays().items() if n not in _validate.CU_SEQLENS}


def gradient_field(name: str) -> str:
    """The field of :class:`cuonline.Gradients` holding the gradient of ``name``."""
    return GRADIENT_FIELDS[name]


def check_static(options: _options.Options, framework: str, is_traced) -> None:
    """TypeError for an option that must be a Python value (every option that is not an
    array: positions, scale, soft cap, block sizes, engine) but is a traced value of the
    framework (``is_traced(value)``), which has no value when the program is built."""
    for name in _options.names():
        if _options.option_kind(name) == "array":
            continue
        value = getattr(options, name)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(is_traced(x) for x in values):
            raise TypeError(f"`{name}` must be a Python value known when the {framework} "
                            f"program is built (it chooses the kernel), got a traced "
                            f"{type(value).__name__}; pass it as a static argument")


def stand_in(shape, dtype, device: tuple[str, int] = ("cpu", 0)) -> Any:
    """A read-only array of ``shape`` and ``dtype`` that holds one element: what validation
    needs of an array whose values are not known (a tracer, a fake tensor). On ``("cuda",
    n)`` it is a CuPy array on GPU ``n`` (one element of memory), so that validation applies
    the CUDA engine's limits, as the call will; NumPy otherwise."""
    dtype = _arrays.numpy_dtype(dtype)
    shape = tuple(int(n) for n in shape)
    if device[0] != "cuda":
        return np.broadcast_to(np.zeros((), dtype=dtype), shape)
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"cuonline runs CUDA arrays on its CUDA kernels through CuPy, which "
                          f"does not import here ({exc}); install cuonline[cuda13] or "
                          f"cuonline[cuda12]") from None
    with cupy.cuda.Device(device[1]):
        # raw bytes viewed as the dtype: CuPy need not know ml_dtypes' bfloat16 to hold it
        one = cupy.zeros((1,), dtype=np.dtype(f"u{dtype.itemsize}")).view(dtype)
        return cupy.broadcast_to(one.reshape(()), shape)


def swap_length_heads(shape: tuple) -> tuple:
    """``shape`` with its third and second last axes swapped: a layout="blhd" shape (...,
    length, heads, dim) as cuonline reads it, (..., heads, length, dim), and back."""
    shape = tuple(shape)
    return shape[:-3] + (shape[-2], shape[-3], shape[-1])


@dataclass(frozen=True)
class Shapes:
    """The results of one attention call, from its validation: ``out`` of ``batch + (lq, dv)``
    in ``dtype``, ``lse`` of ``batch + (lq,)`` in ``acc_dtype``."""

    batch: tuple
    lq: int
    dv: int
    dtype: np.dtype
    acc_dtype: np.dtype

    @property
    def out(self) -> tuple:
        return self.batch + (self.lq, self.dv)

    @property
    def lse(self) -> tuple:
        return self.batch + (self.lq,)


def shapes(arrays: Mapping[str, Any], options: _options.Options,
           device: tuple[str, int] = ("cpu", 0)) -> Shapes:
    """Validate an attention call whose arrays are known by shape and dtype only (``arrays``:
    name -> an object with ``shape`` and ``dtype``, for q, k, v and the array options given)
    on ``device`` (``("cpu", 0)``, or ``("cuda", n)``, where the CUDA engine's limits
    apply), and return the shapes of its results. Raises the ValueError/TypeError the same
    call on NumPy (CuPy) arrays raises, before anything runs."""
    stand_ins = {n: stand_in(x.shape, x.dtype, device) for n, x in arrays.items()}
    p = _validate.validate_attention(
        stand_ins.pop("q"), stand_ins.pop("k"), stand_ins.pop("v"),
        options.replace(**stand_ins), return_lse=True)
    return Shapes(batch=p.batch_shape, lq=p.lq, dv=p.dv, dtype=p.dtype, acc_dtype=p.acc_dtype)


def attention_backward_with_lse(dout, dlse, q, k, v, out, lse, **options: Any) -> Gradients:
    """:func:`cuonline.attention_backward` for the output gradient ``dout`` and the gradient
    ``dlse`` (None: zero) of the log-sum-exp ``lse``, on NumPy or CuPy arrays.

    Since ``d lse_i / d s_ij = P_ij``, the ``lse`` term adds ``P_ij dlse_i`` to the score
    gradient ``dS = P (dP - Delta)``. A second backward pass with zero values (so ``dP = 0``)
    and ``Delta_i = sum_d dout_id out_id = -dlse_i`` (one column: ``out = 1``,
    ``dout = -dlse``) gives exactly that term; its zero and one arrays are broadcast views, so
    nothing of size ``Lk x Dv`` is allocated.
    """
    g = attention_backward(dout, q, k, v, out, lse, **options)
    if dlse is None:
        return g
    xp = _validate.array_namespace(q=q, lse=lse, dlse=dlse)
    dtype = np.dtype(q.dtype)
    column = xp.asarray(-dlse).astype(dtype)[..., None]
    zeros = xp.broadcast_to(xp.zeros((), dtype=dtype), tuple(v.shape[:-1]) + (1,))
    ones = xp.broadcast_to(xp.ones((), dtype=dtype), tuple(out.shape[:-1]) + (1,))
    gl = attention_backward(column, q, k, zeros, ones, lse, **options)

    def total(field):
        a, b = getattr(g, field), getattr(gl, field)
        return a if a is None or field == "dv" else a + b   # lse does not depend on v

    return Gradients(**{f.name: total(f.name) for f in dataclasses.fields(Gradients)})
