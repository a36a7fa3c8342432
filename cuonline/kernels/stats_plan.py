"""Launch planning and kernel arguments of the statistics family ``attention_stats``
(``kernels_cu/attention_stats.cu``, :func:`cuonline.attention_stats` on the CUDA engine):
pure functions of the shapes, testable without a GPU.

The family's three kernels share one variant (:class:`~cuonline.kernels.specs.AttentionStatsSpec`),
one block shape and one dynamic shared-memory size; their grids differ: pass 1 tiles the
queries, the ``received`` pass the keys, the rows kernel the listed rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import arguments, features, heuristics
from .heuristics import DEFAULT_ARCH, DEFAULT_NUM_SMS
from .specs import STATS_MAX_TOP_K, AttentionStatsSpec, acc_name, dtype_name

__all__ = ["STATS_ENTRIES", "STATS_SIGNATURE", "StatsPlan", "choose_stats_tiles", "plan_stats",
           "stats_arguments"]

#: Warps per block: the SIMT forward's.
WARPS = heuristics.WARPS
#: The kernels and the parameters each takes after :data:`STATS_SIGNATURE`, in order.
STATS_ENTRIES = {
    "cuonline_attention_stats": ("lse", "entropy", "max_weight", "argmax", "top_indices",
                                 "top_weights", "top_k"),
    "cuonline_attention_stats_received": ("lse", "query_weights", "received"),
    "cuonline_attention_stats_rows": ("lse", "rows", "nrows", "weights"),
}
#: The parameters every statistics kernel starts with (``CUONLINE_STATS_PARAMS``): the
#: forward's score operands and scalars, under the forward's names (without v and the split).
STATS_SIGNATURE = (
    "q", "k", "bias", "mask", "kv_lengths", "alibi_slopes", "rel_bias", "rel_q", "rel_k",
    "offsets", "strides", "lq", "lk", "diagonal_offset", "scale", "softcap", "window_left",
    "window_right", "bias_block_rows", "bias_block_cols", "rel_bias_radius", "rel_k_radius",
)


@dataclass(frozen=True)
class StatsPlan:
    """The launches of one statistics call: the variant, its block and shared memory, and
    the grids of pass 1 (query tiles) and of the ``received`` pass (key tiles)."""

    spec: AttentionStatsSpec
    block: tuple
    shared_bytes: int
    grid_stats: tuple
    grid_received: tuple
    nbatch: int

    def grid_rows(self, nrows: int) -> tuple:
        """The grid of the rows kernel for ``nrows`` listed rows."""
        return (self.nbatch * math.ceil(nrows / self.spec.block_m), 1, 1)


def _smem(name, d, rows, keys, dr):
    rel = dict(features=("rel_qk",), dr=dr) if dr else {}
    return AttentionStatsSpec(dtype=name, acc=acc_name(name), d=d, warps=WARPS,
                              rows_per_warp=rows, keys_per_lane=keys, **rel).shared_bytes


def choose_stats_tiles(dtype, d, lq, nbatch=1, num_sms=DEFAULT_NUM_SMS, arch=DEFAULT_ARCH,
                       dr=0):
    """``(rows_per_warp, keys_per_lane)`` of the statistics kernels (``WARPS`` warps).

    ValueError where even one row per warp does not fit ``arch``'s shared memory.
    """
    name = dtype_name(dtype)
    words = np.dtype(acc_name(name)).itemsize // 4
    # Rows per warp: each reuses the staged key tile for more FMAs. A row's state is five
    # accumulation-type registers and three ints (no output columns, unlike the forward), so
    # the forward's limits are kept: 8 rows of float32 held the scores in 16 registers there;
    # doubles take two registers each.
    rows = 8 if words == 1 else 4
    # Enough query tiles to give every SM two blocks: shrink the tile rather than idle SMs.
    while rows > 1 and nbatch * math.ceil(max(lq, 1) / (WARPS * rows)) < 2 * num_sms:
        rows //= 2
    # 64-key tiles halve the barriers per key while the block fits the no-opt-in budget and
    # the scores stay within 16 registers (the forward's rule).
    keys = 2
    if _smem(name, d, rows, 2, dr) > heuristics.SMEM_NO_OPT_IN or rows * 2 * words > 16:
        keys = 1
    limit = heuristics.simt_smem_limit(arch)
    while rows > 1 and _smem(name, d, rows, keys, dr) > limit:
        rows //= 2
    need = _smem(name, d, rows, keys, dr)
    if need > limit and dr:
        limit = heuristics.simt_smem_opt_in_limit(arch)   # one block per SM, as the forward
    if need > limit:
        rel = f", Dr = {dr}" if dr else ""
        raise ValueError(f"{name} attention_stats with D = {d}{rel} needs {need} bytes of shared "
                         f"memory per block on the CUDA engine, more than {arch}'s {limit}; use "
                         f"backend='numpy' or a smaller head dimension")
    return rows, keys


def plan_stats(problem, *, top_k=0, arch=DEFAULT_ARCH, num_sms=DEFAULT_NUM_SMS):
    """Plan the statistics of the score :class:`cuonline._validate.Problem` ``problem``
    (``StatsProblem.scores``) with ``top_k`` best keys per query.

    ValueError for a ``top_k`` above :data:`cuonline.kernels.specs.STATS_MAX_TOP_K`, a score
    option the family does not compile (:func:`cuonline.kernels.features.stats_of_problem`) or
    a head that does not fit the arch.
    """
    if top_k > STATS_MAX_TOP_K:
        raise ValueError(f"`top_k` must be at most {STATS_MAX_TOP_K} on the CUDA engine (one key "
                         f"per lane of a warp), got {top_k}; use backend='numpy' for more")
    names = features.stats_of_problem(problem)
    name = dtype_name(problem.dtype)
    dr = heuristics.relative_dr(problem)
    rows, keys = choose_stats_tiles(name, problem.d, problem.lq, problem.nbatch, num_sms, arch,
                                    dr)
    spec = AttentionStatsSpec(dtype=name, acc=acc_name(problem.acc_dtype), d=problem.d,
                              warps=WARPS, rows_per_warp=rows, keys_per_lane=keys,
                              top_k=top_k > 0, features=names, dr=dr)
    grid_stats = (problem.nbatch * math.ceil(problem.lq / spec.block_m), 1, 1)
    grid_received = (problem.nbatch * math.ceil(problem.lk / spec.block_m), 1, 1)
    if max(grid_stats[0], grid_received[0]) > heuristics.MAX_GRID_X:
        raise ValueError(f"attention_stats: batch x tiles exceeds the CUDA grid limit "
                         f"({heuristics.MAX_GRID_X}); use backend='numpy'")
    return StatsPlan(spec=spec, block=(spec.threads, 1, 1), shared_bytes=spec.shared_bytes,
                     grid_stats=grid_stats, grid_received=grid_received, nbatch=problem.nbatch)


class _WholeKeys:
    """The part of a forward plan :func:`cuonline.kernels.arguments.attention_fwd_arguments`
    reads: no key split."""

    def __init__(self, lk):
        self.split_keys = lk


def stats_arguments(p, tails):
    """The arguments of the statistics kernels: ``{entry: its tail}`` (``entry`` a key of
    :data:`STATS_ENTRIES`, its tail a dict of that entry's own parameters) -> ``{entry:
    argument tuple}``.

    Each tuple is :data:`STATS_SIGNATURE` (the forward's operands and scalars, built and typed
    once by :func:`cuonline.kernels.arguments.attention_fwd_arguments`: one offset table for
    every launch of a call), then the entry's own, explicitly typed: arrays as given
    (contiguous, the accumulation dtype; int64 indices; None for a null pointer), ``top_k`` and
    ``nrows`` as int32.
    """
    forward = dict(zip(arguments.ATTENTION_FWD_SIGNATURE,
                       arguments.attention_fwd_arguments(p, _WholeKeys(p.lk), None, None)))
    common = tuple(forward[n] for n in STATS_SIGNATURE)
    out = {}
    for entry, tail in tails.items():
        own = STATS_ENTRIES[entry]
        if set(tail) != set(own):
            raise TypeError(f"{entry} takes {', '.join(own)}, got {', '.join(sorted(tail))}")
        typed = {n: np.int32(x) if n in ("top_k", "nrows") else x for n, x in tail.items()}
        out[entry] = common + tuple(typed[n] for n in own)
    return out
