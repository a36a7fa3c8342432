"""The result of :func:`cuonline.attention_backward` and the rule that sums a gradient to the
shape of its input as the user passed it.

An input that the user broadcast (a bias shared by every head, keys and values shared by a
group of query heads) receives, as in every autograd framework, the sum of the gradients of all
the batch elements (and rows or columns) it was broadcast to. The sum is one reduction per
gradient, in an order fixed by the shapes (NumPy adds the broadcast batch elements in the C
order of their indices), so two runs give bitwise-identical gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _options

__all__ = ["GRADIENT_FIELDS", "Gradients", "Target", "gradients_of", "sum_to_shape"]


@dataclass(frozen=True)
class Gradients:
    """Gradients of a scalar loss with respect to the inputs of :func:`cuonline.attention`.

    Each field has the shape of its input as passed (an input broadcast over batch elements,
    rows or columns gets the sum over those dimensions) and the array library of the inputs.

    Attributes
    ----------
    dq, dk, dv : array
        Gradients with respect to `q`, `k` and `v`, in the dtype of `q`.
    dbias : array or None
        With respect to `bias` (None without one), in the dtype of `bias` as passed.
    drel_bias, drel_q, drel_k : array or None
        With respect to `rel_bias`, `rel_q` and `rel_k` (None for a term not given), each in
        the dtype of its input as passed.
    """

    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None
    drel_bias: Any = None
    drel_q: Any = None
    drel_k: Any = None


#: The inputs that receive a gradient -> their field of :class:`Gradients`: q, k, v and the
#: differentiable options of the options table.
GRADIENT_FIELDS: dict[str, str] = {"q": "dq", "k": "dk", "v": "dv",
                                   **_options.differentiable_options()}


def gradients_of(grads: Mapping[str, Any]) -> Gradients:
    """The :class:`Gradients` of ``grads``, keyed by input name (``"q"``, ``"bias"``, ...:
    the keys of :data:`GRADIENT_FIELDS`); an input missing from ``grads`` gets None."""
    return Gradients(**{field: grads.get(name) for name, field in GRADIENT_FIELDS.items()})


@dataclass(frozen=True)
class Target:
    """Where the gradient of one input goes: its shape as passed and its gradient dtype.

    Engines accumulate into a buffer of :meth:`padded` shape (the input's shape left-padded
    with ones to the batch rank plus the input's own trailing rank), adding the part of batch
    element ``b`` at :meth:`slot`; :meth:`finish` turns the buffer into the user's gradient.
    """

    shape: tuple
    dtype: np.dtype
    tail: int                  # trailing, non-batch dimensions: 2 for q, k, v and bias

    def padded(self, batch_ndim: int) -> tuple:
        """The buffer shape: ``shape`` with ones in front, ``batch_ndim + tail`` dimensions."""
        return (1,) * (batch_ndim + self.tail - len(self.shape)) + tuple(self.shape)

    def slot(self, b: tuple) -> tuple:
        """The index into the padded buffer's batch dimensions of batch element ``b``: 0 along
        a dimension the input broadcast (length 1), ``b``'s own index elsewhere."""
        lead = self.padded(len(b))[:len(b)]
        return tuple(0 if n == 1 else i for n, i in zip(lead, b))

    def groups(self, batch_shape: tuple) -> dict:
        """``{slot: [b, ...]}``: the batch elements whose gradients sum into each slot, in C
        order (the summation order)."""
        out: dict[tuple, list] = {}
        for b in np.ndindex(*batch_shape):
            out.setdefault(self.slot(b), []).append(b)
        return out

    def finish(self, buffer):
        """The user's gradient from the padded buffer: the input's shape and gradient dtype."""
        return buffer.reshape(self.shape).astype(self.dtype, copy=False)


def sum_to_shape(xp, grad, shape, tail=0):
    """Sum ``grad`` over the dimensions along which an input of ``shape`` was broadcast to it.

    Parameters
    ----------
    xp : module
        numpy or cupy.
    grad : array
        A gradient of the broadcast shape (``numpy.broadcast_shapes(shape, grad.shape) ==
        grad.shape``).
    shape : tuple
        The input's shape as passed.
    tail : int, optional
        How many trailing dimensions of ``grad`` are not batch dimensions (2 for a bias of
        shape ``(..., Lq, Lk)``). Default 0: all are batch dimensions.

    Returns
    -------
    array of shape `shape`
        The broadcast batch dimensions, then a broadcast trailing dimension (the rows of a
        key-padding bias), are each summed by one ``xp.sum``, whose order is fixed by the
        shape (NumPy's pairwise and strided sums, CuPy's reduction kernels: no atomics): the
        result is bitwise reproducible, never dependent on scheduling.

    Examples
    --------
    >>> import numpy as np
    >>> g = np.arange(12.0).reshape(2, 3, 2)
    >>> sum_to_shape(np, g, (3, 1), tail=1)
    array([[14.],
           [22.],
           [30.]])
    """
    shape = tuple(shape)
    try:
        fits = np.broadcast_shapes(shape, grad.shape) == tuple(grad.shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"a gradient of shape {tuple(grad.shape)} cannot be summed to the "
                         f"shape {shape}: the input does not broadcast to it")
    padded = (1,) * (grad.ndim - len(shape)) + shape
    broadcast = [a for a, (n, g) in enumerate(zip(padded, grad.shape)) if n == 1 and g != 1]
    trailing = tuple(a for a in broadcast if a >= grad.ndim - tail)
    if trailing:
        grad = grad.sum(axis=trailing, keepdims=True)
    axes = [a for a in broadcast if a < grad.ndim - tail]
    if not axes:
        return grad.reshape(shape)
    # one reduction over the broadcast batch dimensions (their order fixed by the shape)
    return grad.sum(axis=tuple(axes)).reshape(shape)
