"""cuonline: exact FlashAttention-style attention for NumPy, CuPy, Dask, torch and JAX arrays.

``cuonline.attention(q, k, v)`` computes ``softmax(scale * q @ k.T) @ v`` in tiles with an
online softmax, so the score matrix never exists in memory. NumPy arrays run on a threaded,
tiled NumPy engine; CuPy arrays on CUDA kernels compiled at run time; torch tensors and JAX
arrays are read in place through DLPack and answered in kind (``cuonline.jax`` and
``cuonline.torch`` make it differentiable in those frameworks). Importing cuonline imports no
CuPy, JAX or torch and compiles nothing.
"""

from ._api import (attention, attention_backward, attention_stats, attention_vjp, log_softmax,
                   logsumexp, merge, softmax)
from ._gradients import Gradients
from ._stats import AttentionStats
from ._varlen import pack, unpack

__all__ = ["attention", "attention_backward", "attention_stats", "attention_vjp", "Gradients",
           "AttentionStats", "merge", "pack", "unpack", "softmax", "log_softmax", "logsumexp",
           "__version__"]

__version__ = "0.1.0"
