"""cuonline inside JAX programs: :func:`attention` works under ``jax.jit``, ``jax.grad`` /
``jax.vjp``, ``jax.vmap`` and their compositions; :func:`merge` likewise.

``import cuonline.jax`` imports JAX (``import cuonline`` does not). The call is checked when
the program is traced, by the validation of :func:`cuonline.attention` on stand-ins of the
arrays' shapes and dtypes for the device the program runs on (CuPy stand-ins on a GPU, so
the CUDA engine's limits too), so errors are raised at trace time with the same messages.
The program runs cuonline's engines through ``jax.experimental.buffer_callback``: on the
CPU the NumPy engine reads NumPy views of XLA's input buffers (no copy) and its results are
written into XLA's output buffers; on a CUDA device cuonline's kernels run on XLA's stream
(``cupy.cuda.ExternalStream``) on CuPy views of the buffers. Gradients come from a ``jax.custom_vjp`` whose backward is
:func:`cuonline.attention_backward` with the residuals ``(out, lse)``; ``jax.vmap`` turns each
mapped axis into a leading batch axis of one cuonline call (a ``custom_vmap`` rule), so a
vmapped call is one launch, not a loop. See docs/frameworks.md.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.buffer_callback import buffer_callback

from . import _arrays, _bindings, _options, _validate, _varlen
from ._api import attention as _cuonline_attention
from .engines.merge import merge_states

__all__ = ["attention", "merge"]

Array = Any


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


@dataclass(frozen=True)
class _Call:
    """What one traced call knows before it runs: the options that are not arrays, the batch
    shape cuonline sees (vmapped axes in front), the result shapes and the arrays that travel
    as raw bits (bfloat16, which DLPack and CUDA array interfaces cannot carry to NumPy)."""

    statics: _options.Options
    batch: tuple
    lq: int
    dv: int
    dtype: np.dtype
    acc_dtype: np.dtype
    #: layout="blhd": q, k, v, out (and their gradients) are (..., length, heads, dim) in
    #: XLA's buffers, read heads first through swapped strides inside the callback
    blhd: bool = False

    def mapped(self, axis_size: int) -> _Call:
        """The call with one more mapped axis in front of the batch."""
        return dataclasses.replace(self, batch=(axis_size,) + self.batch)

    @property
    def out_shape(self) -> tuple:
        shape = self.batch + (self.lq, self.dv)
        return _bindings.swap_length_heads(shape) if self.blhd else shape

    def heads_first(self, name: str, x: Any) -> Any:
        """A view of buffer ``x`` of argument ``name`` as cuonline reads it: q, k, v, out,
        dout and their gradients with the length and heads axes swapped under "blhd" (a
        strided view, no copy)."""
        return x.swapaxes(-3, -2) if self.blhd and name in _LAID_OUT else x


#: the arrays whose axes ``layout=`` names
_LAID_OUT = ("q", "k", "v", "out", "dout")


def _device(arrays: dict) -> tuple[str, int]:
    """The device the call will run on, as validation needs it when the program is traced:
    that of an array that is not traced, else the first device of JAX's default backend
    (the one ``jax.jit`` places a program on unless told otherwise)."""
    concrete = [x for x in arrays.values() if not _is_traced(x)]
    device = next(iter(concrete[0].devices())) if concrete else jax.devices()[0]
    if device.platform in ("gpu", "cuda"):
        hardware_id = getattr(device, "local_hardware_id", None)   # CuPy's device number
        return "cuda", int(device.id if hardware_id is None else hardware_id)
    return "cpu", 0


def _bits(x: Array) -> Array:
    # bfloat16 crosses the callback as uint16 (a bitcast: no copy in XLA)
    if x.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _bits_dtype(dtype) -> np.dtype:
    return np.dtype(np.uint16) if np.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


def _view(buffer: Any, dtype) -> Any:
    """A NumPy (host) or CuPy (CUDA) view of an XLA buffer, as ``dtype`` (bfloat16 arrives
    as its bits)."""
    x = _arrays.buffer_view(buffer)
    return x.view(np.dtype(dtype)) if x.dtype != np.dtype(dtype) else x


def _running(ctx: Any, buffer: Any):
    """The device and stream of a callback: XLA's stream on CUDA (work on it is ordered after
    the producers of the inputs and before the consumers of the outputs)."""
    # ctx.stream exists only on GPUs (it raises on the CPU)
    stream = int(ctx.stream) if _arrays.on_cuda(buffer) else None
    return _arrays.origin_of(buffer, stream).running()


def _align(x: Array, name: str, batched: bool, batch_rank: int) -> Array:
    """A vmapped array (mapped axis at 0) with ones inserted after that axis, so that its
    own batch axes line up with the call's from the right and the mapped axis is in front."""
    if not batched:
        return x               # broadcasts against the new batch axis as it is
    own = x.ndim - 1 - _bindings.trailing_rank(name)
    return x.reshape((x.shape[0],) + (1,) * (batch_rank - own) + x.shape[1:])


# --------------------------------------------------------------------------------------------
# forward


def _forward(call: _Call, arrays: dict) -> tuple[Array, Array]:
    """(out, lse) of one cuonline call on JAX values ``arrays`` (q, k, v, array options)."""

    @custom_vmap
    def run(arrays):
        out_type = jax.ShapeDtypeStruct(call.out_shape, _bits_dtype(call.dtype))
        lse_type = jax.ShapeDtypeStruct(call.batch + (call.lq,), call.acc_dtype)
        dtypes = {n: x.dtype for n, x in arrays.items()}
        callback = functools.partial(_run_forward, call, dtypes)
        out, lse = buffer_callback(callback, (out_type, lse_type))(
            {n: _bits(x) for n, x in arrays.items()})
        if call.dtype == jnp.bfloat16:
            out = jax.lax.bitcast_convert_type(out, jnp.bfloat16)
        return out, lse

    @run.def_vmap
    def run_mapped(axis_size, in_batched, arrays):
        batched = in_batched[0]
        aligned = {n: _align(x, n, batched[n], len(call.batch)) for n, x in arrays.items()}
        return _forward(call.mapped(axis_size), aligned), (True, True)

    return run(arrays)


def _run_forward(call: _Call, dtypes: dict, ctx, results, arrays) -> None:
    out_buffer, lse_buffer = results
    with _running(ctx, arrays["q"]):
        views = {n: call.heads_first(n, _view(b, dtypes[n])) for n, b in arrays.items()}
        q, k, v = views.pop("q"), views.pop("k"), views.pop("v")
        xp = _validate.array_namespace(q=q)
        # the batch shape includes mapped axes that q, k and v may not carry
        q = xp.broadcast_to(q, call.batch + q.shape[-2:])
        out, lse = _cuonline_attention(q, k, v, return_lse=True,
                                       **call.statics.replace(**views).asdict())
        xp.copyto(call.heads_first("out", _view(out_buffer, call.dtype)), out)
        xp.copyto(_view(lse_buffer, call.acc_dtype), lse)


# --------------------------------------------------------------------------------------------
# backward


def _backward(call: _Call, grad_shapes: dict, arrays: dict, residuals: dict) -> dict:
    """Gradients (name -> JAX value of shape ``grad_shapes[name]``) of the arguments that
    receive one, for the residuals ``out``, ``lse`` and the cotangents ``dout`` and ``dlse``
    (absent when the call does not return ``lse``)."""
    names = _bindings.differentiable(arrays)
    grad_dtypes = {n: call.dtype if n in ("q", "k", "v") else arrays[n].dtype for n in names}

    @custom_vmap
    def run(arrays, residuals):
        types = {n: jax.ShapeDtypeStruct(grad_shapes[n], _bits_dtype(grad_dtypes[n]))
                 for n in names}
        dtypes = {n: x.dtype for n, x in {**arrays, **residuals}.items()}
        callback = functools.partial(_run_backward, call, grad_shapes, grad_dtypes, dtypes)
        grads = buffer_callback(callback, types)(
            {n: _bits(x) for n, x in arrays.items()},
            {n: _bits(x) for n, x in residuals.items()})
        return {n: (jax.lax.bitcast_convert_type(g, jnp.bfloat16)
                    if grad_dtypes[n] == jnp.bfloat16 else g) for n, g in grads.items()}

    @run.def_vmap
    def run_mapped(axis_size, in_batched, arrays, residuals):
        rank = len(call.batch)
        aligned = {n: _align(x, n, in_batched[0][n], rank) for n, x in arrays.items()}
        aligned_res = {n: _align(x, n if n in ("out", "lse", "dout") else "lse",
                                 in_batched[1][n], rank) for n, x in residuals.items()}
        # every gradient is per mapped element, so each gets the mapped axis in front
        shapes = {n: (axis_size,) + (1,) * (rank - len(s) + _bindings.trailing_rank(n)) + s
                  for n, s in grad_shapes.items()}
        grads = _backward(call.mapped(axis_size), shapes, aligned, aligned_res)
        return ({n: g.reshape((axis_size,) + grad_shapes[n]) for n, g in grads.items()},
                {n: True for n in grads})

    return run(arrays, residuals)


def _run_backward(call: _Call, grad_shapes: dict, grad_dtypes: dict, dtypes: dict, ctx, results,
                  arrays, residuals) -> None:
    with _running(ctx, arrays["q"]):
        views = {n: _view(b, dtypes[n]) for n, b in arrays.items()}
        res = {n: call.heads_first(n, _view(b, dtypes[n])) for n, b in residuals.items()}
        xp = _validate.array_namespace(q=views["q"])
        for n in results:
            # read through the gradient's shape, so that cuonline sums the gradient over the
            # axes the argument was broadcast along and over no mapped axis
            views[n] = xp.broadcast_to(views[n], grad_shapes[n])
        views = {n: call.heads_first(n, x) for n, x in views.items()}
        q, k, v = views.pop("q"), views.pop("k"), views.pop("v")
        g = _bindings.attention_backward_with_lse(
            res["dout"], res.get("dlse"), q, k, v, res["out"], res["lse"],
            **call.statics.replace(**views).asdict())
        for n, buffer in results.items():
            xp.copyto(call.heads_first(n, _view(buffer, grad_dtypes[n])),
                      getattr(g, _bindings.gradient_field(n)))


# --------------------------------------------------------------------------------------------
# the public functions


def attention(
    q: Array, k: Array, v: Array, *, scale: float | None = None, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, bias: Array | None = None,
    mask: Array | None = None, kv_lengths: Array | None = None,
    alibi_slopes: Array | None = None, softcap: float | None = None, softcap_bias: bool = False,
    q_offset: int | None = None, k_offset: int = 0,
    bias_block: int | tuple[int, int] | None = None, rel_bias: Array | None = None,
    rel_q: Array | None = None, rel_k: Array | None = None,
    cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
    return_lse: bool = False, precision: str = "highest",
    backend: str = "auto", workers: int | None = None, layout: str = "bhld",
) -> Array | tuple[Array, Array]:
    r""":func:`cuonline.attention` as a JAX function: under ``jax.jit``, ``jax.grad``,
    ``jax.vjp``, ``jax.vmap`` and their compositions.

    Parameters
    ----------
    q, k, v : JAX arrays (or anything ``jax.numpy.asarray`` takes)
        Shapes (..., Lq, D), (..., Lk, D), (..., Lk, Dv), heads before the sequence axis, as
        :func:`cuonline.attention` takes them; with ``layout="blhd"``, (B, Lq, H, D),
        (B, Lk, Hkv, D), (B, Lk, Hkv, Dv) as ``jax.nn.dot_product_attention`` takes them.
        float16, bfloat16, float32, and float64 with ``jax_enable_x64`` (without it JAX turns
        float64 into float32 when the arrays are made, and cuonline computes in float32).
    scale, causal, window, bias, mask, kv_lengths, alibi_slopes, softcap, softcap_bias, q_offset, k_offset, bias_block, rel_bias, rel_q, rel_k, cu_seqlens_q, cu_seqlens_k, return_lse, precision, backend, workers
        As :func:`cuonline.attention`. The array options are JAX values (traced or not);
        every other option must be a Python value known when the program is traced (it
        picks the kernel): a traced one is a TypeError. `cu_seqlens_q` and `cu_seqlens_k`
        (a packed batch; gradients come packed like their inputs) are host values the
        program is built from: NumPy arrays, lists, or JAX arrays that are not traced; a
        traced one is a TypeError naming it.
    layout : {"bhld", "blhd"}, optional
        The axes of `q`, `k`, `v` and `out`: "bhld" (default), (..., heads, length, dim);
        "blhd", (batch, length, heads, dim), read through swapped strides inside the
        callback (no transpose, no copy). The array options keep their layout, e.g. `bias`
        of shape (B, H, Lq, Lk) as ``jax.nn`` takes it.

    Returns
    -------
    out : jax.Array, shape S + (Lq, Dv)
        (B, Lq, H, Dv) with ``layout="blhd"``.
    lse : jax.Array, shape S + (Lq,)
        Only when `return_lse`; it is differentiable too. (B, H, Lq) with ``layout="blhd"``.

    Notes
    -----
    Gradients (``jax.grad``, ``jax.vjp``) flow to `q`, `k`, `v`, `bias`, `rel_bias`, `rel_q`
    and `rel_k`, from :func:`cuonline.attention_backward`, deterministic and summed over
    broadcast axes as that function sums them. `mask`, `kv_lengths` and `alibi_slopes` are
    constants: their cotangents are zero (integer and boolean ones ``float0``, as JAX wants).
    Under ``jax.vmap`` the mapped axes of every argument become leading batch axes of one
    cuonline call. On the CPU the NumPy engine reads XLA's buffers in place; on CUDA the
    kernels run on XLA's stream. Arrays sharded over several devices are not split by
    cuonline: call it per shard (``jax.shard_map``).

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cuonline.jax
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 40, 16))
    >>> loss = lambda q, k, v: cuonline.jax.attention(q, k, v, causal=True).sum()
    >>> dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    >>> dq.shape, dk.dtype
    ((2, 40, 16), dtype('float32'))
    """
    options = _options.from_call(locals())
    _bindings.check_static(options, "JAX", _is_traced)
    options = _varlen.host_boundaries(options, "JAX", _is_traced)
    blhd = _bindings.heads_after_length(layout, q, k, v)
    if isinstance(return_lse, jax.core.Tracer):
        raise TypeError("`return_lse` must be a Python bool known when the program is traced")
    given = _bindings.tensor_options(options)
    arrays = {n: jnp.asarray(x) for n, x in {"q": q, "k": k, "v": v, **given}.items()}
    statics = options.replace(**{n: None for n in given})
    # validated heads first, as the callback reads them, for the device the program runs on
    described = {n: jax.ShapeDtypeStruct(_bindings.swap_length_heads(x.shape), x.dtype)
                 if blhd and n in _LAID_OUT else x for n, x in arrays.items()}
    shapes = _bindings.shapes(described, statics, _device(arrays))
    call = _Call(statics=statics, batch=shapes.batch, lq=shapes.lq, dv=shapes.dv,
                 dtype=shapes.dtype, acc_dtype=shapes.acc_dtype, blhd=blhd)
    with_lse = bool(return_lse)

    @jax.custom_vjp
    def differentiable(arrays):
        out, lse = _forward(call, arrays)
        return (out, lse) if with_lse else out

    def forward(arrays):
        out, lse = _forward(call, arrays)
        return ((out, lse) if with_lse else out), (arrays, out, lse)

    def backward(saved, cotangent):
        arrays, out, lse = saved
        residuals = {"out": out, "lse": lse}
        if with_lse:
            residuals["dout"], residuals["dlse"] = cotangent
        else:
            residuals["dout"] = cotangent
        grads = _backward(call, {n: tuple(arrays[n].shape) for n in
                                 _bindings.differentiable(arrays)}, arrays, residuals)
        return ({n: grads.get(n) for n in arrays},)

    differentiable.defvjp(forward, backward)
    return differentiable(arrays)


def merge(*states: tuple[Array, Array]) -> tuple[Array, Array]:
    """:func:`cuonline.merge` on JAX arrays, as a JAX function (jit, grad, vmap): the same
    checks (at trace time) and the same merge rule, written once for any array namespace
    (``cuonline.engines.merge``), here traced by JAX.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cuonline.jax
    >>> q, k, v = jax.random.normal(jax.random.key(1), (3, 30, 8))
    >>> a = cuonline.jax.attention(q, k[:10], v[:10], return_lse=True)
    >>> b = cuonline.jax.attention(q, k[10:], v[10:], return_lse=True)
    >>> out, lse = jax.jit(cuonline.jax.merge)(a, b)
    >>> bool(jnp.allclose(out, cuonline.jax.attention(q, k, v), atol=1e-6))
    True
    """
    stand_ins: list[Any] = [
        tuple(_bindings.stand_in(jnp.shape(x), jnp.result_type(x)) for x in state)
        if isinstance(state, (tuple, list)) and len(state) == 2 else state
        for state in states]
    _validate.validate_merge(stand_ins)
    outs = [jnp.asarray(o) for o, _ in states]
    lses = [jnp.asarray(s) for _, s in states]
    return merge_states(jnp, outs, lses)
