"""The numerical contract of cuonline, written once and shared by every engine.

Nothing here imports an engine. Each function is small and pure so that the NumPy engine, the
CUDA planner and the tests all agree on one definition of "visible", "accumulation dtype" and
"where the causal diagonal lies".

Conventions
-----------
* Query ``i`` is aligned with key ``i + (Lk - Lq)`` (bottom-right alignment, as FlashAttention
  2.1+). ``diagonal_offset(lq, lk)`` returns that ``Lk - Lq``.
* A window is a pair ``(left, right)`` of non-negative ints or ``None`` (unbounded). Key ``j`` is
  visible from query ``i`` iff ``d - left <= j <= d + right`` with ``d = i + Lk - Lq``.
  ``causal=True`` is the window ``(None, 0)``; both combine by intersection.
* Scores are exponentiated with ``exp2`` after folding ``log2(e)`` into the scale.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "LOG2E",
    "LN2",
    "accumulation_dtype",
    "diagonal_offset",
    "effective_window",
    "visible_key_range",
]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

Window = tuple  # (left: int | None, right: int | None)


def accumulation_dtype(dtype) -> np.dtype:
    """Return the dtype in which scores, the softmax state and ``lse`` are held.

    float64 accumulates in float64; float32, float16 and bfloat16 accumulate in float32.
    Compared by kind and size, so a float64 of either byte order (``'<f8'``, ``'>f8'``) is
    float64 here; the result is always in native byte order.
    """
    dtype = np.dtype(dtype)
    wide = dtype.kind == "f" and dtype.itemsize == 8
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def diagonal_offset(lq: int, lk: int) -> int:
    """Key index aligned with query 0: ``Lk - Lq`` (bottom-right causal alignment)."""
    return lk - lq


def effective_window(causal: bool, window) -> tuple:
    """Combine ``causal`` and ``window`` into one ``(left, right)`` pair.

    ``None`` on a side means unbounded. ``causal`` caps the right side at 0.
    """
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return (left, right)


def visible_key_range(i0: int, i1: int, lq: int, lk: int, window) -> tuple:
    """Half-open key range ``[j0, j1)`` that any query in ``[i0, i1)`` may see.

    Keys outside the range are invisible to every query of the block, so an engine may skip
    them without reading them. Keys inside may still be masked element by element.
    ``window`` is the pair returned by :func:`effective_window`.
    """
    left, right = window
    off = diagonal_offset(lq, lk)
    j0 = 0 if left is None else max(0, i0 + off - left)
    j1 = lk if right is None else min(lk, i1 - 1 + off + right + 1)
    return (j0, max(j0, j1))
