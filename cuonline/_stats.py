"""The result of :func:`cuonline.attention_stats`: statistics of the attention weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AttentionStats"]


@dataclass(frozen=True)
class AttentionStats:
    r"""Statistics of the attention weights :math:`P = \mathrm{softmax}(s)` of one call.

    ``S`` is the batch shape; ``p_ij = exp(s_ij - lse_i)`` over the keys query ``i`` sees (0
    at the others). Floating fields are in the accumulation dtype (float64 for float64
    inputs, float32 otherwise), indices are int64. A field that was not asked for is None.

    Attributes
    ----------
    lse : array, shape S + (Lq,)
        ``log sum_j exp(s_ij)``; ``-inf`` for a query that sees no key.
    entropy : array, shape S + (Lq,), or None
        ``-sum_j p_ij log p_ij`` in nats; 0 for a query that sees no key. None with
        ``entropy=False``.
    max_weight : array, shape S + (Lq,)
        ``max_j p_ij``; 0 for a query that sees no key.
    argmax : array, shape S + (Lq,)
        The key of the largest weight (the lowest index on ties); -1 for a query that sees no
        key.
    received : array, shape S + (Lk,), or None
        ``sum_i w_i p_ij``, the attention each key receives (``w`` = `query_weights`, ones by
        default). None unless ``received=True``.
    top_indices : array, shape S + (Lq, top_k), or None
        Keys by descending weight, the lower index first on ties; -1 past the keys a query
        sees. None with ``top_k=0``.
    top_weights : array, shape S + (Lq, top_k), or None
        Their weights; 0 where the index is -1. None with ``top_k=0``.
    weights : array, shape S + (len(rows), Lk), or None
        The exact rows of ``P`` of the queries in `rows`, in the order given. None without
        `rows`.
    """

    lse: Any
    entropy: Any
    max_weight: Any
    argmax: Any
    received: Any = None
    top_indices: Any = None
    top_weights: Any = None
    weights: Any = None
