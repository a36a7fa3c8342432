"""The numerical contract of cuonline, written once and shared by every engine.

Nothing here imports an engine. Each function is small and pure so that the NumPy engine, the
CUDA planner and the tests all agree on one definition of "visible", "accumulation dtype" and
"where the causal diagonal lies".

Conventions
-----------
* Positions: query ``i`` sits at ``q_offset + i`` and key ``j`` at ``k_offset + j``; the default
  ``q_offset = Lk - Lq``, ``k_offset = 0`` aligns the last query with the last key (bottom-right
  alignment, as FlashAttention 2.1+). Every position rule reads the distance
  ``delta = (k_offset + j) - (q_offset + i) = j - (i + diag)``, with the diagonal offset
  ``diag = q_offset - k_offset`` (:func:`diagonal_offset`): query ``i`` faces key ``i + diag``.
* A window is a pair ``(left, right)`` of non-negative ints or ``None`` (unbounded). Key ``j`` is
  visible from query ``i`` iff ``-left <= delta <= right``, i.e. ``d - left <= j <= d + right``
  with ``d = i + diag``. ``causal=True`` is the window ``(None, 0)``; both combine by
  intersection. ALiBi adds ``-slope * |delta|``.
* Packed variable-length batches (``cu_seqlens_q``, ``cu_seqlens_k``): positions restart in
  each sequence, so ``i`` and ``j`` are indices local to sequence ``b`` and its diagonal is
  that of a call on the sequence alone (:func:`sequence_diagonals`): ``len_k - len_q`` by
  default, ``q_offset - k_offset`` for explicit offsets, which apply to every sequence.
* Scores are exponentiated with ``exp2`` after folding ``log2(e)`` into the scale.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "LOG2E",
    "LN2",
    "MAX_DIAGONAL",
    "accumulation_dtype",
    "diagonal_offset",
    "effective_window",
    "sequence_diagonals",
    "visible_key_range",
]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

Window = tuple  # (left: int | None, right: int | None)

#: Diagonal offsets are clamped to +-(MAX_DIAGONAL - Lq - Lk). Visibility does not change (past
#: +-(Lq + Lk) every query sees all keys or none, the same at either size), every ALiBi
#: distance ``|i + diag - j|`` is an exact integer in float64, and with window sides below
#: 2**60 (the kernels' "unbounded") every ``i + diag +- side`` stays far inside int64.
MAX_DIAGONAL = 1 << 53


def accumulation_dtype(dtype) -> np.dtype:
    """Return the dtype in which scores, the softmax state and ``lse`` are held.

    float64 accumulates in float64; float32, float16 and bfloat16 accumulate in float32.
    Compared by kind and size, so a float64 of either byte order (``'<f8'``, ``'>f8'``) is
    float64 here; the result is always in native byte order.
    """
    dtype = np.dtype(dtype)
    wide = dtype.kind == "f" and dtype.itemsize == 8
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def diagonal_offset(lq: int, lk: int, q_offset=None, k_offset: int = 0) -> int:
    """Key index aligned with query 0: ``q_offset - k_offset``, clamped to
    ``+-(MAX_DIAGONAL - Lq - Lk)``.

    ``q_offset=None`` is ``Lk - Lq`` (bottom-right alignment), so ``diagonal_offset(lq, lk)`` is
    ``Lk - Lq``. The offsets are ints of any size (validated by the caller). The bound leaves
    room for the lengths, so a block of a clamped call, called with its block's offsets (as
    Dask's tasks and user-side chunking do), falls inside its own bound and is not clamped
    again: it scores exactly as the whole call.
    """
    q_offset = lk - lq if q_offset is None else int(q_offset)
    bound = max(MAX_DIAGONAL - lq - lk, lq + lk)     # lengths past 2**52: visibility still kept
    return max(-bound, min(bound, q_offset - int(k_offset)))


def effective_window(causal: bool, window) -> tuple:
    """Combine ``causal`` and ``window`` into one ``(left, right)`` pair.

    ``None`` on a side means unbounded. ``causal`` caps the right side at 0.
    """
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return (left, right)


def visible_key_range(i0: int, i1: int, lq: int, lk: int, window, diagonal=None) -> tuple:
    """Half-open key range ``[j0, j1)`` that any query in ``[i0, i1)`` may see.

    Keys outside the range are invisible to every query of the block, so an engine may skip
    them without reading them. Keys inside may still be masked element by element.
    ``window`` is the pair returned by :func:`effective_window`; ``diagonal`` the offset of
    :func:`diagonal_offset` (default ``Lk - Lq``).
    """
    left, right = window
    off = diagonal_offset(lq, lk) if diagonal is None else diagonal
    j0 = 0 if left is None else min(lk, max(0, i0 + off - left))
    j1 = lk if right is None else min(lk, i1 - 1 + off + right + 1)
    return (j0, max(j0, j1))


def sequence_diagonals(cu_seqlens_q, cu_seqlens_k, q_offset=None, k_offset: int = 0) -> list:
    """The :func:`diagonal_offset` of each sequence of a packed batch: the diagonal of a call
    on sequence ``b`` alone, with lengths ``cu_seqlens_*[b + 1] - cu_seqlens_*[b]`` and the
    same offsets (``q_offset=None``: ``len_k - len_q`` per sequence)."""
    lengths_q = [int(b) - int(a) for a, b in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])]
    lengths_k = [int(b) - int(a) for a, b in zip(cu_seqlens_k[:-1], cu_seqlens_k[1:])]
    return [diagonal_offset(lq, lk, q_offset, k_offset) for lq, lk in zip(lengths_q, lengths_k)]
