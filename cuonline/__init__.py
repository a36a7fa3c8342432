"""cuonline: exact FlashAttention-style attention for NumPy and CuPy arrays.

``cuonline.attention(q, k, v)`` computes ``softmax(scale * q @ k.T) @ v`` in tiles with an
online softmax, so the score matrix never exists in memory. NumPy arrays run on a threaded,
tiled NumPy engine; CuPy arrays on CUDA kernels compiled at run time. Importing cuonline
imports no CuPy and compiles nothing.
"""

from ._api import (attention, attention_backward, attention_stats, attention_vjp, log_softmax,
                   logsumexp, merge, softmax)
from ._gradients import Gradients
from ._stats import AttentionStats

__all__ = ["attention", "attention_backward", "attention_stats", "attention_vjp", "Gradients",
           "AttentionStats", "merge", "softmax", "log_softmax", "logsumexp", "__version__"]

__version__ = "0.1.0"
