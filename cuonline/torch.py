"""cuonline in PyTorch: :func:`attention`, differentiable by ``torch.autograd``, on CPU and CUDA
tensors, registered as the custom operators ``torch.ops.cuonline.attention`` and
``torch.ops.cuonline.attention_backward`` (``torch.library.custom_op``), so ``torch.compile``
keeps them in its graph.

``import cuonline.torch`` imports torch (``import cuonline`` does not). The tensors are read in
place through DLPack (CPU tensors as NumPy arrays for the NumPy engine, CUDA tensors as CuPy
arrays for cuonline's kernels, which run on torch's current stream); the results are torch
tensors on the inputs' device. The operators' schemas are built from the options table
(``cuonline._options``): each array option is a ``Tensor?`` argument, and every other option
travels in one string argument (the repr of its Python values), so an option added to the table
reaches torch without an edit here. See docs/frameworks.md.
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np
import torch

from . import _arrays, _bindings, _options, _validate, _varlen
from ._api import attention as _cuonline_attention

__all__ = ["attention"]

Tensor = torch.Tensor
#: the array options that are tensors of the operators: all but the sequence boundaries, host
#: values that shape the work (they travel with the static options)
_TENSOR_OPTIONS = tuple(n for n in _options.array_options() if n not in _validate.CU_SEQLENS)
#: the tensor arguments of the operators, in schema order (the table's order for the options)
_ARRAYS = ("q", "k", "v") + _TENSOR_OPTIONS
_GRADIENTS = _bindings.differentiable(_ARRAYS)
_STATIC_OPTIONS = tuple(n for n in _options.names() if n not in _TENSOR_OPTIONS)
_OPTION_ARGS = ", ".join(f"Tensor? {n}" for n in _TENSOR_OPTIONS)
_FORWARD_SCHEMA = f"(Tensor q, Tensor k, Tensor v, {_OPTION_ARGS}, str statics) -> (Tensor, Tensor)"
_BACKWARD_SCHEMA = (f"(Tensor dout, Tensor? dlse, Tensor out, Tensor lse, Tensor q, Tensor k, "
                    f"Tensor v, {_OPTION_ARGS}, str statics) -> Tensor[]")


def _encode(options: _options.Options, return_lse: bool) -> str:
    """The options that are not arrays, as the operators' string: the repr of Python values
    (torch.compile traces repr, not json)."""
    values = tuple((n, _plain(getattr(options, n))) for n in _STATIC_OPTIONS)
    return repr(values + (("return_lse", bool(return_lse)),))


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()                       # NumPy scalars: Python numbers
    if isinstance(x, (tuple, list)):
        return tuple(_plain(e) for e in x)
    return x


def _decode(statics: str) -> tuple[dict, bool]:
    values = dict(ast.literal_eval(statics))
    return values, values.pop("return_lse")


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return getattr(torch, np.dtype(dtype).name)


def _shapes(arrays: dict, statics: dict) -> _bindings.Shapes:
    """The results' shapes, from cuonline's validation for the device of `q` (a CUDA tensor
    gets the CUDA engine's limits): every user error, before anything runs."""
    options = _options.Options(**statics)
    device = arrays["q"].device
    where = ("cpu", 0)
    if device.type == "cuda":
        where = ("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return _bindings.shapes({n: x for n, x in arrays.items() if x is not None}, options, where)


# --------------------------------------------------------------------------------------------
# the operators


@torch.library.custom_op("cuonline::attention", mutates_args=(), schema=_FORWARD_SCHEMA)
def _attention_op(*args: Any) -> tuple[Tensor, Tensor]:
    arrays = dict(zip(_ARRAYS, args[:-1]))
    statics, _ = _decode(args[-1])
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    out, lse = _cuonline_attention(q, k, v, return_lse=True, **arrays, **statics)
    return out, lse


@_attention_op.register_fake
def _attention_fake(*args: Any) -> tuple[Tensor, Tensor]:
    arrays = dict(zip(_ARRAYS, args[:-1]))
    shapes = _shapes(arrays, _decode(args[-1])[0])
    q = arrays["q"]
    return (q.new_empty(shapes.out, dtype=_torch_dtype(shapes.dtype)),
            q.new_empty(shapes.lse, dtype=_torch_dtype(shapes.acc_dtype)))


@torch.library.custom_op("cuonline::attention_backward", mutates_args=(),
                         schema=_BACKWARD_SCHEMA)
def _attention_backward_op(*args: Any) -> list[Tensor]:
    dout, dlse, out, lse = args[:4]
    arrays = dict(zip(_ARRAYS, args[4:-1]))
    statics, _ = _decode(args[-1])
    named = {"dout": dout, "dlse": dlse, "out": out, "lse": lse, **arrays}
    inside, origin = _arrays.adapt({n: x for n, x in named.items() if x is not None})
    assert origin is not None          # tensors always come from torch
    with origin.running():
        g = _bindings.attention_backward_with_lse(
            inside.pop("dout"), inside.pop("dlse", None), inside.pop("q"), inside.pop("k"),
            inside.pop("v"), inside.pop("out"), inside.pop("lse"), **inside, **statics)
        grads = origin.back(g)
    return [getattr(grads, _bindings.gradient_field(n)) for n in _GRADIENTS
            if arrays[n] is not None]


@_attention_backward_op.register_fake
def _attention_backward_fake(*args: Any) -> list[Tensor]:
    arrays = dict(zip(_ARRAYS, args[4:-1]))
    q = arrays["q"]
    return [torch.empty_like(arrays[n], dtype=q.dtype if n in ("q", "k", "v") else None)
            for n in _GRADIENTS if arrays[n] is not None]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(*inputs[:-1], *output)
    ctx.statics = inputs[-1]


def _backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple:
    saved = ctx.saved_tensors
    arrays = dict(zip(_ARRAYS, saved[:-2]))
    out, lse = saved[-2:]
    _, return_lse = _decode(ctx.statics)
    if dout is None:
        dout = torch.zeros_like(out)
    grads = iter(torch.ops.cuonline.attention_backward(
        dout, dlse if return_lse else None, out, lse, *saved[:-2], ctx.statics))
    return tuple(next(grads) if n in _GRADIENTS and arrays[n] is not None else None
                 for n in _ARRAYS) + (None,)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# the public function


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, bias: Tensor | None = None,
    mask: Tensor | None = None, kv_lengths: Tensor | None = None,
    alibi_slopes: Tensor | None = None, softcap: float | None = None, softcap_bias: bool = False,
    q_offset: int | None = None, k_offset: int = 0,
    bias_block: int | tuple[int, int] | None = None, rel_bias: Tensor | None = None,
    rel_q: Tensor | None = None, rel_k: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
    return_lse: bool = False, precision: str = "highest",
    backend: str = "auto", workers: int | None = None, layout: str = "bhld",
) -> Tensor | tuple[Tensor, Tensor]:
    r""":func:`cuonline.attention` for torch tensors, differentiable by ``torch.autograd``.

    Parameters
    ----------
    q, k, v : torch.Tensor
        Shapes (..., Lq, D), (..., Lk, D), (..., Lk, Dv), heads before the sequence axis, as
        :func:`cuonline.attention` and ``torch.nn.functional.scaled_dot_product_attention``
        take them; with ``layout="blhd"``, (B, Lq, H, D), (B, Lk, Hkv, D), (B, Lk, Hkv, Dv) as
        FlashAttention takes them. float16, bfloat16, float32 or float64, on the CPU or a
        CUDA device.
    scale, causal, window, bias, mask, kv_lengths, alibi_slopes, softcap, softcap_bias, q_offset, k_offset, bias_block, rel_bias, rel_q, rel_k, cu_seqlens_q, cu_seqlens_k, return_lse, precision, backend, workers
        As :func:`cuonline.attention`. The array options are tensors on the device of `q`
        (Python lists and numbers are turned into tensors there). `cu_seqlens_q` and
        `cu_seqlens_k` (a packed batch; gradients come packed like their inputs) are read on
        the host when the call is made (tensors, NumPy arrays or lists; under
        ``torch.compile``, lists made outside the compiled function). Every error is raised
        before anything runs, for the engine of the device of `q` (a CUDA tensor gets the
        CUDA engine's limits).
    layout : {"bhld", "blhd"}, optional
        The axes of `q`, `k`, `v` and `out`: "bhld" (default), (..., heads, length, dim);
        "blhd", (batch, length, heads, dim), read through the strides (a transposed view,
        no copy). The array options keep their layout, e.g. `bias` of shape (B, H, Lq, Lk).

    Returns
    -------
    out : torch.Tensor, shape S + (Lq, Dv)
        (B, Lq, H, Dv) with ``layout="blhd"`` (a transposed view).
    lse : torch.Tensor, shape S + (Lq,)
        Only when `return_lse`; it is differentiable too. (B, H, Lq) with ``layout="blhd"``.

    Notes
    -----
    Gradients flow to `q`, `k`, `v`, `bias`, `rel_bias`, `rel_q` and `rel_k` from
    :func:`cuonline.attention_backward` (deterministic; summed over broadcast dimensions);
    `mask`, `kv_lengths` and `alibi_slopes` are constants. On CUDA the kernels run on torch's
    current stream, so the call is ordered with the work queued before it.

    Examples
    --------
    >>> import torch, cuonline.torch
    >>> q, k, v = (torch.randn(2, 4, 50, 16, dtype=torch.float64, requires_grad=True)
    ...            for _ in range(3))
    >>> out = cuonline.torch.attention(q, k, v, causal=True)
    >>> out.sum().backward()
    >>> q.grad.shape
    torch.Size([2, 4, 50, 16])
    """
    options = _options.from_call(locals())
    options = _varlen.host_boundaries(options, "torch", lambda x: False)
    arrays = _tensors(q, options)
    swap = _bindings.heads_after_length(layout, q, k, v)
    if swap:                           # (batch, length, heads, dim): transposed views
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    statics = options.replace(**{n: None for n in arrays})
    if not torch.compiler.is_compiling():
        # every error before autograd records anything (compiled: the fake kernel's check)
        _shapes({"q": q, "k": k, "v": v, **arrays}, statics.asdict())
    return _call(q, k, v, arrays, statics, return_lse, swap)


def _call(q: Tensor, k: Tensor, v: Tensor, arrays: dict, statics: _options.Options,
          return_lse: bool, swap: bool) -> Tensor | tuple[Tensor, Tensor]:
    # apart from attention(): a comprehension there would make its locals closure cells,
    # which torch.compile cannot read through locals()
    out, lse = torch.ops.cuonline.attention(
        q, k, v, *(arrays.get(n) for n in _TENSOR_OPTIONS), _encode(statics, return_lse))
    if swap:
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _tensors(q: Any, options: _options.Options) -> dict:
    """The array options as tensors on the device of `q` (lists and numbers converted; an
    array of another library is the mixed-libraries TypeError)."""
    if not isinstance(q, Tensor):
        raise TypeError(f"`q` must be a torch.Tensor, got {type(q).__name__}")
    given = _bindings.tensor_options(options)
    _arrays.check_one_library({"q": q, **given})
    return {n: x if isinstance(x, Tensor) else torch.as_tensor(x, device=q.device)
            for n, x in given.items()}
