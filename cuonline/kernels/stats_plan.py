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
from .specs import (STATS_MAX_TOP_K, AttentionStatsSpec, acc_name, dtype_name,
                    probe_shared_bytes)

__all__ = ["STATS_BUFFERS", "STATS_ENTRIES", "STATS_SIGNATURE", "StatsPlan", "choose_stats_tiles",
           "plan_stats", "stats_arguments"]

#: Warps per block: the SIMT forward's.
WARPS = heuristics.WARPS
#: The kernels and the parameters each takes after :data:`STATS_SIGNATURE`, in order.
STATS_ENTRIES = {
    "cuonline_attention_stats": ("lse", "entropy", "max_weight", "argmax", "top_indices",
                                 "top_weights", "top_k"),
    "cuonline_attention_stats_received": ("lse", "query_weights", "received"),
    "cuonline_attention_stats_rows": ("lse", "rows", "nrows", "weights"),
}
#: The arrays the statistics kernels write or read beyond the problem (the ``buffers`` of
#: :func:`stats_arguments`): every entry's own parameters but the scalars ``top_k``, ``nrows``.
STATS_BUFFERS = ("lse", "entropy", "max_weight", "argmax", "top_indices", "top_weights",
                 "query_weights", "received", "rows", "weights")
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
    top_k: int = 0           # the best keys kept per query (pass 1's top_k argument)

    def grid_rows(self, nrows: int) -> tuple:
        """The grid of the rows kernel for ``nrows`` listed rows."""
        return (self.nbatch * math.ceil(nrows / self.spec.block_m), 1, 1)


def _smem(name, d, rows, keys, dr):
    return probe_shared_bytes(AttentionStatsSpec, dtype=name, acc=acc_name(name), d=d,
                              warps=WARPS, rows_per_warp=rows, keys_per_lane=keys, dr=dr)


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


def plan_stats(problem, launch):
    """Plan the statistics of the score :class:`cuonline._validate.Problem` ``problem``
    (``StatsProblem.scores``) with ``launch.top_k`` best keys per query, on ``launch.arch``
    with ``launch.num_sms`` SMs.

    ValueError for a ``top_k`` above :data:`cuonline.kernels.specs.STATS_MAX_TOP_K`, a score
    option the family does not compile (:func:`cuonline.kernels.features.stats_of_problem`) or
    a head that does not fit the arch.
    """
    top_k = launch.top_k
    if top_k > STATS_MAX_TOP_K:
        raise ValueError(f"`top_k` must be at most {STATS_MAX_TOP_K} on the CUDA engine (one key "
                         f"per lane of a warp), got {top_k}; use backend='numpy' for more")
    names = features.stats_of_problem(problem)
    name = dtype_name(problem.dtype)
    dr = heuristics.relative_dr(problem)
    rows, keys = choose_stats_tiles(name, problem.d, problem.lq, problem.nbatch,
                                    launch.num_sms, launch.arch, dr)
    spec = AttentionStatsSpec(dtype=name, acc=acc_name(problem.acc_dtype), d=problem.d,
                              warps=WARPS, rows_per_warp=rows, keys_per_lane=keys,
                              top_k=top_k > 0, features=names, dr=dr)
    grid_stats = (problem.nbatch * math.ceil(problem.lq / spec.block_m), 1, 1)
    grid_received = (problem.nbatch * math.ceil(problem.lk / spec.block_m), 1, 1)
    if max(grid_stats[0], grid_received[0]) > heuristics.MAX_GRID_X:
        raise ValueError(f"attention_stats: batch x tiles exceeds the CUDA grid limit "
                         f"({heuristics.MAX_GRID_X}); use backend='numpy'")
    return StatsPlan(spec=spec, block=(spec.threads, 1, 1), shared_bytes=spec.shared_bytes,
                     grid_stats=grid_stats, grid_received=grid_received, nbatch=problem.nbatch,
                     top_k=top_k)


def stats_arguments(problem, plan, buffers):
    """The arguments of the statistics kernels: ``{entry: argument tuple}`` for every key of
    :data:`STATS_ENTRIES`, in order.

    ``buffers`` maps each name of :data:`STATS_BUFFERS` to its array (None for a result not
    asked for: a null pointer; the kernels it belongs to are not launched): contiguous, the
    accumulation dtype, int64 indices and rows. Each tuple is :data:`STATS_SIGNATURE` (the
    forward's operands and scalars, built and typed once for every launch of a call by
    :func:`cuonline.kernels.arguments.score_arguments`), then the entry's own, explicitly
    typed: ``top_k`` (the plan's) and ``nrows`` (the length of ``rows``) as int32.
    """
    arrays = arguments.buffers_of(buffers, STATS_BUFFERS, AttentionStatsSpec.family)
    common = arguments.score_arguments(problem, STATS_SIGNATURE)
    rows = arrays["rows"]
    own = dict(arrays, top_k=np.int32(plan.top_k),
               nrows=np.int32(0 if rows is None else rows.size))
    return {entry: common + tuple(own[n] for n in names)
            for entry, names in STATS_ENTRIES.items()}
