"""Launch planning for the attention kernels (SIMT and tensor-core families): pure functions,
testable without a GPU.

Every choice has its reason next to it. The numbers are starting points for an H100/H200-class
GPU (132 SMs, 228 KiB shared memory per SM, 64 K registers per SM); ``python -m cuonline kernels``
shows the registers and shared memory that each resulting variant really uses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import features, varlen
from .specs import (MMA_MAX_HEAD_DIM, AttentionMmaSpec, AttentionSimtSpec, acc_name,
                    bwd_bias_tile, dtype_name, probe_shared_bytes)

__all__ = ["BwdPlan", "COMBINE_WARPS", "CombinePlan", "D_BUCKETS", "MAX_GRID_X", "MIN_BLOCK_M",
           "MMA_TILES", "REL_K_WARPS", "MmaTiles", "Plan", "arch_number", "bwd_smem_limit",
           "bwd_uses_mma", "choose_bwd_mma_tiles", "choose_bwd_tiles", "plan_bwd_mma",
           "plan_bwd_simt", "choose_mma_tiles", "choose_splits", "choose_tiles", "d_bucket",
           "mma_supported", "plan_combine", "plan_mma", "plan_simt", "relative_dr",
           "simt_smem_limit", "simt_smem_opt_in_limit", "tuned_tiles", "uses_mma"]

DEFAULT_NUM_SMS = 132
WARPS = 4
#: Shared memory that needs no opt-in; above it the launch sets max_dynamic_shared_size_bytes.
SMEM_NO_OPT_IN = 48 * 1024
#: Keep one block under this so that at least two blocks fit an sm_80 SM (164 KiB).
SMEM_MAX = 80 * 1024
#: Accumulator registers per thread (rows x output columns per lane x words per element).
ACC_REGISTER_BUDGET = 32
#: A key split below this many keys costs more in the combine than it gains in parallelism.
MIN_SPLIT_KEYS = 128
MAX_SPLITS = 256
#: Grid x (query tiles x batch) must stay below the CUDA limit.
MAX_GRID_X = 2**31 - 1
#: The smallest query block any attention family plans for more than 16 query rows (SIMT:
#: 4 warps of one row; tensor cores: 2 warps of 16 rows); up to 16 rows every family plans one
#: block. Validation bounds ``batch x ceil(Lq / MIN_BLOCK_M)`` by MAX_GRID_X with it, so the
#: planner's grid check can only fail on a planner bug.
MIN_BLOCK_M = 4
#: Warps per block of the split-key combine (kWarps in attention_combine.cuh).
COMBINE_WARPS = 4
#: Architecture assumed where none is known (the emulation, listings).
DEFAULT_ARCH = "sm_90"
#: Dynamic shared memory one block may opt into (sm_80: 163 KiB, sm_90: 227 KiB): the archs
#: with a tensor-core tile table.
SMEM_OPT_IN_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
#: The same limit on the archs that run only the SIMT family (V100: 96 KiB, T4: 64 KiB).
SMEM_OPT_IN_LIMIT_SIMT_ONLY = {"sm_70": 96 * 1024, "sm_75": 64 * 1024}
#: The limit on tensor-core archs without a tile table of their own (CUDA programming guide,
#: technical specifications): consumer Ampere and Ada (sm_86, sm_89) and consumer Blackwell
#: (sm_120) allow 99 KiB, Jetson Orin (sm_87) 163 KiB, datacenter Blackwell (sm_100) 227 KiB.
#: An arch in none of the tables gets the smallest of them, so its tiles fit whatever it is.
SMEM_OPT_IN_LIMIT_OTHER = {"sm_86": 99 * 1024, "sm_87": 163 * 1024, "sm_89": 99 * 1024,
                           "sm_100": 227 * 1024, "sm_120": 99 * 1024}
#: The tensor-core family needs sm_80: mma.sync for bf16, tf32 and f64 (m8n8k4 DMMA) and
#: cp.async are sm_80 instructions. Older GPUs (V100 sm_70, T4 sm_75) run every dtype on the
#: SIMT family.
MIN_MMA_ARCH = 80

#: Head-dimension buckets of the tile tables (and of `python -m cuonline tune`'s winners).
D_BUCKETS = (32, 64, 128, 256)


class MmaTiles(NamedTuple):
    """Tiles of the tensor-core family: ``block_m = 16 * m_tiles * warps`` query rows and
    ``block_n`` keys per tile, ``stages`` K/V tiles in flight (see
    :class:`~cuonline.kernels.specs.AttentionMmaSpec`)."""

    warps: int
    block_n: int
    stages: int
    m_tiles: int = 1


#: Tensor-core family: (arch, dtype, D bucket) -> MmaTiles. The D bucket is the smallest of 32,
#: 64, 128, 256 that holds max(D, Dv). Starting points derived from the shared-memory,
#: shared-bandwidth and register budgets (not yet measured on a GPU; `python -m cuonline
#: kernels` shows what ptxas made of them, `python -m cuonline tune` measures the others).
#: Two query tiles per warp (m_tiles = 2) halve the shared-memory reads per mma where the
#: registers allow it. What each entry rests on: docs/kernels.md, "Tile tables".
MMA_TILES = {}
for _arch in ("sm_80", "sm_90"):
    for _dt in ("float16", "bfloat16"):
        # 16-bit, two stages; two query tiles up to D = 64, the key tile as large as registers
        # allow (docs/kernels.md, "Tile tables")
        MMA_TILES.update({(_arch, _dt, 32): MmaTiles(4, 64, 2, 2),
                          (_arch, _dt, 64): MmaTiles(4, 32, 2, 2),
                          (_arch, _dt, 128): MmaTiles(4, 64, 2),
                          (_arch, _dt, 256): MmaTiles(4, 32, 2)})
    # tf32: twice the bytes of 16-bit tiles, so 32-key tiles; two query tiles up to D = 64
    # (docs/kernels.md, "Tile tables")
    MMA_TILES.update({(_arch, "float32", 32): MmaTiles(4, 32, 2, 2),
                      (_arch, "float32", 64): MmaTiles(4, 32, 2, 2),
                      (_arch, "float32", 128): MmaTiles(4, 32, 2),
                      (_arch, "float32", 256): MmaTiles(4, 32, 1)})
    # f64: its O accumulator takes two registers per value; D = 128 fits one 16-key stage
    # only (docs/kernels.md, "Tile tables")
    MMA_TILES.update({(_arch, "float64", 32): MmaTiles(4, 32, 2),
                      (_arch, "float64", 64): MmaTiles(4, 16, 2),
                      (_arch, "float64", 128): MmaTiles(2, 16, 1)})


def arch_number(arch: str) -> int:
    """The compute capability of ``"sm_XY"`` (``"sm_90a"`` too) as the integer ``XY``."""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", str(arch))
    if match is None:
        raise ValueError(f"arch must look like 'sm_80' or 'sm_90', got {arch!r}")
    return int(match.group(1))


def mma_supported(arch: str) -> bool:
    """Whether GPUs of ``arch`` run the tensor-core family (sm_80 and newer)."""
    return arch_number(arch) >= MIN_MMA_ARCH


def simt_smem_limit(arch: str = DEFAULT_ARCH) -> int:
    """Dynamic shared memory a SIMT block may use on ``arch``: :data:`SMEM_MAX`, or less where
    the arch's opt-in limit is lower (sm_75: 64 KiB)."""
    return min(SMEM_MAX, SMEM_OPT_IN_LIMIT_SIMT_ONLY.get(arch, SMEM_MAX))


def simt_smem_opt_in_limit(arch: str = DEFAULT_ARCH) -> int:
    """All the dynamic shared memory a SIMT block may opt into on ``arch`` (one block per SM):
    the SIMT-only archs' limits, else the tensor-core archs' (:func:`mma_smem_limit`)."""
    return SMEM_OPT_IN_LIMIT_SIMT_ONLY.get(arch) or mma_smem_limit(arch)


def mma_smem_limit(arch: str) -> int:
    """Dynamic shared memory a tensor-core block may opt into on ``arch``."""
    base = f"sm_{arch_number(arch)}"
    return (SMEM_OPT_IN_LIMIT.get(base) or SMEM_OPT_IN_LIMIT_OTHER.get(base)
            or min(SMEM_OPT_IN_LIMIT_OTHER.values()))


def mma_table_arch(arch: str) -> str:
    """The tile table an arch uses: sm_90's from sm_90 on, sm_80's for the other sm_8x."""
    return "sm_90" if arch_number(arch) >= 90 else "sm_80"


def d_bucket(width: int) -> int:
    """The smallest of :data:`D_BUCKETS` that holds ``width`` (= max(D, Dv))."""
    return next(b for b in D_BUCKETS if width <= b)


def tuned_tiles(tuned, family, dtype, width):
    """The stored winner of ``python -m cuonline tune`` for this family, dtype and head width.

    ``tuned`` maps ``(family, dtype name, D bucket)`` to a tile tuple: :class:`MmaTiles`
    ``(warps, block_n, stages, m_tiles)`` for ``"attention_fwd_mma"``, ``(warps,
    rows_per_warp, keys_per_lane)`` for ``"attention_fwd_simt"`` (see
    :mod:`cuonline.kernels.tuning`, which validates it). None or ``{}``: no winner, the
    built-in choice applies. Returns the tuple or None.
    """
    if not tuned:
        return None
    tiles = tuned.get((family, dtype_name(dtype), d_bucket(width)))
    return None if tiles is None else tuple(tiles)


@dataclass(frozen=True)
class Plan:
    """A launch: the kernel variant and its grid."""

    spec: AttentionSimtSpec | AttentionMmaSpec
    n_qtiles: int
    n_splits: int
    split_keys: int          # keys per split (a multiple of block_n); lk when not split
    grid: tuple
    block: tuple
    shared_bytes: int
    # a packed batch: its blocks (cuonline.kernels.varlen.TileTable), else None
    varlen: object = None


def _simt_smem(name, d, dv, warps, rows, keys, dr=0):
    """Shared memory of the SIMT forward block of these tiles: its spec's own count."""
    return probe_shared_bytes(AttentionSimtSpec, dtype=name, acc=acc_name(name), d=d, dv=dv,
                              warps=warps, rows_per_warp=rows, keys_per_lane=keys, dr=dr)


def relative_dr(problem) -> int:
    """The ``dr`` of a spec for ``problem``: its rel_q/rel_k width where the rel_qk feature
    applies (:data:`cuonline.kernels.features.FEATURES`), else 0."""
    return problem.dr if features.by_name("rel_qk").of_problem(problem) else 0


def choose_tiles(dtype, d, dv, lq, nbatch=1, num_sms=DEFAULT_NUM_SMS, tuned=None,
                 arch=DEFAULT_ARCH, dr=0):
    """Return ``(warps, rows_per_warp, keys_per_lane)`` for one problem shape.

    ``arch`` bounds the block's shared memory (:func:`simt_smem_limit`); a shape that cannot
    fit it even with one row per warp (float64 heads above 226 on sm_75) raises ValueError.
    ``dr``: the width of rel_q/rel_k (0 without them), whose staged copies take shared memory
    too.

    ``tuned``: winners stored by ``python -m cuonline tune`` (see :func:`tuned_tiles`); one for
    this dtype and D bucket replaces the built-in choice for long sequences (it was measured at
    N = 4096); the occupancy rule below still shrinks it for small grids.
    """
    name = dtype_name(dtype)
    winner = tuned_tiles(tuned, AttentionSimtSpec.family, name, max(d, dv))
    if winner is not None and lq > 16:
        # A measured winner (tuning.candidates kept it within the budgets below at the bucket's
        # full width, hence at every narrower head); decoding shapes keep the rules below.
        warps, rows, keys = winner
        while rows > 2 and nbatch * math.ceil(lq / (warps * rows)) < 2 * num_sms:
            rows //= 2
        # the winner was measured without rel_qk: its staging may not fit beside it
        limit = simt_smem_limit(arch)
        while rows > 1 and _simt_smem(name, d, dv, warps, rows, keys, dr) > limit:
            rows //= 2
        if _simt_smem(name, d, dv, warps, rows, keys, dr) <= limit:
            return warps, rows, keys
    acc_bytes = np.dtype(acc_name(name)).itemsize
    words = acc_bytes // 4
    cols = math.ceil(dv / 32)
    warps = WARPS

    # Rows per warp: each row costs `cols` accumulators per lane; more rows reuse each K/V
    # element read from shared memory for more FMAs, so take as many as the register budget
    # allows (8 at most: the score registers grow with rows too).
    # Doubles: 4 at most; 8 spilled (docs/kernels.md, "Tile tables").
    rows = 8 if words == 1 else 4
    while rows > 1 and rows * cols * words > ACC_REGISTER_BUDGET:
        rows //= 2

    if lq <= 16:
        # Decoding/scoring: few query rows. Give each warp at most a quarter of them and use
        # only as many warps as there are rows to own; the key split fills the GPU instead.
        lq = max(lq, 1)
        rows = min(rows, 2 ** math.ceil(math.log2(math.ceil(lq / WARPS))))
        warps = min(WARPS, math.ceil(lq / rows))
    else:
        # Enough query tiles to give every SM two blocks: shrink the tile rather than idle SMs
        # (rows >= 2 keeps some reuse of the staged K/V tile).
        while rows > 2 and nbatch * math.ceil(lq / (warps * rows)) < 2 * num_sms:
            rows //= 2

    # Keys per lane: 64-key tiles halve the barriers per key and amortise the q broadcast;
    # use them while the block stays within the no-opt-in shared budget and the scores stay
    # within 16 registers (double scores take two; docs/kernels.md, "Tile tables").
    keys = 2
    if (_simt_smem(name, d, dv, warps, rows, 2, dr) > SMEM_NO_OPT_IN
            or rows * 2 * words > 16):
        keys = 1
    # Large heads in double: shrink the query tile until the block fits next to another one
    # (and within the arch's opt-in limit: sm_75 allows 64 KiB).
    limit = simt_smem_limit(arch)
    while rows > 1 and _simt_smem(name, d, dv, warps, rows, keys, dr) > limit:
        rows //= 2
    need = _simt_smem(name, d, dv, warps, rows, keys, dr)
    if need > limit and dr:
        # rel_qk's staging beside the largest heads (float64 D = 256 at one row: 85 KiB): one
        # block per SM, up to the arch's opt-in limit, rather than refusing the call
        limit = simt_smem_opt_in_limit(arch)
    if need > limit:
        rel = f", Dr = {dr}" if dr else ""
        raise ValueError(
            f"{name} attention with D = {d}, Dv = {dv}{rel} needs {need} bytes of shared memory "
            f"per block on the CUDA engine, more than {arch}'s {limit}; use backend='numpy' or "
            f"a smaller head dimension"
        )
    return warps, rows, keys


def uses_mma(dtype, d, dv, precision="highest", arch=DEFAULT_ARCH) -> bool:
    """Whether the tensor-core family runs this problem on ``arch`` (else the SIMT family).

    Never below sm_80 (:func:`mma_supported`): V100 and T4 run every dtype on the SIMT family.

    float16/bfloat16 always (f32 accumulation either way, and the tensor cores are ~15x the
    FMA peak); float64 on the FP64 tensor cores (exact f64 arithmetic, fused multiply-adds);
    float32 only with ``precision="tf32"``: the default keeps exact float32 products. Heads
    beyond :data:`~cuonline.kernels.specs.MMA_MAX_HEAD_DIM` take the SIMT family.
    """
    if not mma_supported(arch):
        return False
    name = dtype_name(dtype)
    if name == "float32" and precision != "tf32":
        return False
    limit = MMA_MAX_HEAD_DIM.get(name, 0)
    return max(d, dv) <= limit


def choose_mma_tiles(dtype, d, dv, lq, arch=DEFAULT_ARCH, tuned=None, dr=0):
    """Return the :class:`MmaTiles` of the tensor-core family for one problem shape.

    ``tuned``: winners stored by ``python -m cuonline tune`` for the current GPU (see
    :func:`tuned_tiles`); one for this dtype and D bucket comes before :data:`MMA_TILES`.
    ``dr``: the width of rel_q/rel_k (0 without them), whose staged copies (accumulation type)
    take shared memory too.
    """
    name = dtype_name(dtype)
    limit = mma_smem_limit(arch)
    table = mma_table_arch(arch)
    width = max(d, dv)
    # A measured winner first (measured on this GPU; tuning.candidates kept it within this
    # arch's shared-memory limit at the bucket's full width), else the built-in table.
    winner = tuned_tiles(tuned, AttentionMmaSpec.family, name, width)
    tiles = MmaTiles(*(winner or MMA_TILES[(table, name, d_bucket(width))]))
    # An arch with less shared memory than its table's (sm_86, sm_89: 99 KiB against sm_80's
    # 163): fewer stages first (latency hiding), then narrower key tiles, until the block fits.
    def smem(tiles):
        return probe_shared_bytes(AttentionMmaSpec, dtype=name, d=d, dv=dv, **tiles._asdict(),
                                  dr=dr)

    while smem(tiles) > limit and (tiles.stages > 1 or tiles.block_n > 16):
        tiles = (tiles._replace(stages=tiles.stages - 1) if tiles.stages > 1
                 else tiles._replace(block_n=tiles.block_n // 2))
    # rel_qk's staged rel_q rows and rel_k band grow with the query tile: then fewer rows
    # (float64 at Dr = 256 with 64 rows needs 294 KiB)
    while smem(tiles) > limit and (tiles.m_tiles > 1 or tiles.warps > 1):
        tiles = (tiles._replace(m_tiles=1) if tiles.m_tiles > 1
                 else tiles._replace(warps=tiles.warps // 2))
    if smem(tiles) > limit:
        # only a wide rel_q/rel_k on a small-memory arch gets here (float64, Dr = 256, sm_86)
        raise ValueError(
            f"{name} attention with D = {d}, Dv = {dv}, Dr = {dr} needs {smem(tiles)} bytes of "
            f"shared memory per block on the tensor cores, more than {arch}'s {limit}; use "
            f"backend='numpy' or a narrower rel_q/rel_k"
        )
    # Few query rows: two query tiles per warp only when one per warp would fill the block
    # (else more warps, each with one tile, finish sooner; decoding: one warp, no idle tile,
    # and the key split fills the GPU), then no warp without a row.
    m_tiles = tiles.m_tiles if lq > 16 * tiles.warps else 1
    warps = max(1, min(tiles.warps, math.ceil(max(lq, 1) / (16 * m_tiles))))
    if (table == "sm_80" and warps == 1 and winner is None and d_bucket(width) == 128
            and name in ("float16", "bfloat16")):
        # One warp at D = 128 (decoding): 64-key tiles spill on sm_80, 32-key tiles do not
        # (docs/kernels.md, "Tile tables")
        tiles = tiles._replace(block_n=min(tiles.block_n, 32))
    return tiles._replace(warps=warps, m_tiles=m_tiles)


def choose_splits(n_blocks, lk, block_n, num_sms=DEFAULT_NUM_SMS):
    """Return ``(n_splits, split_keys)``: split the keys when the grid cannot fill the GPU."""
    if n_blocks >= num_sms or lk < 2 * MIN_SPLIT_KEYS:
        # Already one block per SM, or too few keys for a split to pay for its combine pass.
        return 1, lk
    want = math.ceil(2 * num_sms / n_blocks)  # two blocks per SM hides the load latency
    n_splits = min(want, math.ceil(lk / MIN_SPLIT_KEYS), MAX_SPLITS)
    if n_splits < 2:
        return 1, lk
    split_keys = math.ceil(math.ceil(lk / n_splits) / block_n) * block_n
    return math.ceil(lk / split_keys), split_keys


@dataclass(frozen=True)
class CombinePlan:
    """A launch of the split-key combine: ``n_splits`` partial results of ``nrows`` query rows
    merged, a warp per row. No spec of its own: it is compiled in the forward's module."""

    nrows: int
    n_splits: int
    grid: tuple
    block: tuple
    spec: None = None


def plan_combine(problem, launch):
    """Plan the split-key combine of ``problem``'s forward, whose plan split the keys
    ``launch.n_splits`` ways: a warp per query row of every batch element."""
    if launch.n_splits is None or launch.n_splits < 2:
        raise ValueError(f"the split-key combine merges 2 or more key splits, got "
                         f"n_splits={launch.n_splits!r}")
    nrows = problem.nbatch * problem.lq
    return CombinePlan(nrows=nrows, n_splits=launch.n_splits,
                       grid=(math.ceil(nrows / COMBINE_WARPS), 1, 1),
                       block=(32 * COMBINE_WARPS, 1, 1))


def _plan_forward(problem, family, block_m, block_n, make_spec, launch):
    """The part of a forward plan every family shares: key splits, grid, flags, spec."""
    if getattr(problem, "cu_seqlens_q", None) is not None:
        return _plan_varlen(problem, family, block_m, make_spec)
    n_qtiles = math.ceil(problem.lq / block_m)
    n_splits = launch.n_splits
    if n_splits is None:
        n_splits, split_keys = choose_splits(problem.nbatch * n_qtiles, problem.lk, block_n,
                                             launch.num_sms)
    else:
        split_keys = math.ceil(math.ceil(problem.lk / max(n_splits, 1)) / block_n) * block_n
        n_splits = max(1, math.ceil(problem.lk / split_keys))
    grid_x = problem.nbatch * n_qtiles
    # _validate bounds batch x ceil(Lq / MIN_BLOCK_M): a valid call never gets here
    if grid_x > MAX_GRID_X or (problem.lq > 16 and block_m < MIN_BLOCK_M):
        raise AssertionError(f"planner bug: {block_m}-row blocks give grid x = {grid_x}")
    spec = make_spec(features=features.of_problem(problem, family), split=n_splits > 1)
    return Plan(spec=spec, n_qtiles=n_qtiles, n_splits=n_splits, split_keys=split_keys,
                grid=(grid_x, 1, n_splits), block=(spec.threads, 1, 1),
                shared_bytes=spec.shared_bytes)


def plan_simt(problem, launch):
    """Plan :class:`cuonline._validate.Problem` ``problem`` on the SIMT family.

    From :class:`~cuonline.kernels.launch.Launch` ``launch``: ``arch`` bounds the block's
    shared memory (:func:`choose_tiles`), ``num_sms`` steers the tile height and the key
    split, ``n_splits`` forces a number of key splits (None: :func:`choose_splits`),
    ``tuned`` maps ``(family, dtype, D bucket)`` to the tiles ``python -m cuonline tune``
    measured fastest (:func:`tuned_tiles`). One loader reads any strides: ``cp_async`` is not
    read.
    """
    dtype = dtype_name(problem.dtype)
    dr = relative_dr(problem)
    warps, rows, keys = choose_tiles(dtype, problem.d, problem.dv, problem.lq, problem.nbatch,
                                     launch.num_sms, launch.tuned, launch.arch, dr)

    def make_spec(**flags):
        return AttentionSimtSpec(dtype=dtype, acc=acc_name(problem.acc_dtype), d=problem.d,
                                 dv=problem.dv, warps=warps, rows_per_warp=rows,
                                 keys_per_lane=keys, dr=dr, **flags)

    return _plan_forward(problem, AttentionSimtSpec.family, warps * rows, 32 * keys, make_spec,
                         launch)


def plan_mma(problem, launch):
    """Plan ``problem`` on the tensor-core family (sm_80 and newer); ``launch`` as for
    :func:`plan_simt`, and its ``cp_async``: whether q, k and v rows are 16-byte aligned with
    unit column stride (else the kernel loads element by element)."""
    arch = launch.arch
    if not mma_supported(arch):
        raise ValueError(f"family {AttentionMmaSpec.family!r} needs sm_{MIN_MMA_ARCH} or newer "
                         f"(mma.sync, cp.async), got arch {arch!r}")
    dtype = dtype_name(problem.dtype)
    dr = relative_dr(problem)
    tiles = choose_mma_tiles(dtype, problem.d, problem.dv, problem.lq, arch, launch.tuned, dr)

    def make_spec(**flags):
        return AttentionMmaSpec(dtype=dtype, d=problem.d, dv=problem.dv,
                                cp_async=launch.cp_async, **tiles._asdict(), dr=dr, **flags)

    return _plan_forward(problem, AttentionMmaSpec.family, 16 * tiles.m_tiles * tiles.warps,
                         tiles.block_n, make_spec, launch)


def _plan_varlen(problem, family, block_m, make_spec):
    """A packed batch's forward plan: a block per (query tile of a sequence, batch element),
    from :func:`cuonline.kernels.varlen.tile_table`, the heaviest first; never a key split
    (a sequence's keys are few, and the blocks are many)."""
    table = varlen.tile_table(problem.cu_seqlens_q, problem.cu_seqlens_k,
                              problem.sequence_diagonals, problem.window, block_m)
    grid_x = problem.nbatch * len(table)
    if grid_x > MAX_GRID_X:
        raise ValueError(f"a packed batch of {problem.nbatch} batch elements x {len(table)} "
                         f"query tiles needs {grid_x} thread blocks on the CUDA engine, more "
                         f"than CUDA's {MAX_GRID_X}; split the call along the batch")
    spec = make_spec(features=features.of_problem(problem, family), split=False)
    return Plan(spec=spec, n_qtiles=len(table), n_splits=1, split_keys=problem.lk,
                grid=(grid_x, 1, 1), block=(spec.threads, 1, 1),
                shared_bytes=spec.shared_bytes, varlen=table)


# --------------------------------------------------------------------------------------------
# the attention backward (issue 13): attention_bwd_simt


def bwd_smem_limit(arch: str = DEFAULT_ARCH) -> int:
    """Dynamic shared memory a backward block may opt into on ``arch``: the SIMT-only archs'
    limits (sm_70: 96 KiB, sm_75: 64 KiB), else the tensor-core archs' (sm_80: 163 KiB,
    sm_90: 227 KiB, ...). :func:`choose_bwd_tiles` stays within :data:`SMEM_MAX` where it can."""
    base = f"sm_{arch_number(arch)}"
    if base in SMEM_OPT_IN_LIMIT_SIMT_ONLY:
        return SMEM_OPT_IN_LIMIT_SIMT_ONLY[base]
    return mma_smem_limit(arch)


def _bwd_simt_smem(name, d, dv, warps, rows, per, dr=0, bias_tile=False):
    """Shared memory of the SIMT backward block of these tiles: its spec's own count."""
    from .specs import AttentionBwdSimtSpec  # noqa: PLC0415 - the backward's own spec

    return probe_shared_bytes(AttentionBwdSimtSpec, dtype=name, acc=acc_name(name), d=d, dv=dv,
                              warps=warps, rows_per_warp=rows, items_per_lane=per, dr=dr,
                              bias_tile=bias_tile)


def choose_bwd_tiles(dtype, d, dv, arch=DEFAULT_ARCH, dr=0, bias_tile=False):
    """Return ``(warps, rows_per_warp, items_per_lane)`` of the SIMT backward family.

    A block owns ``warps * rows_per_warp`` rows (keys for dK/dV, queries for dQ) and streams
    tiles of ``32 * items_per_lane`` rows of the other kind. Raises ValueError when even one
    row per warp needs more shared memory than ``arch`` allows (float64 heads above 128 below
    sm_80). ``dr``: the width of rel_q / rel_k (rel_qk), whose staging takes shared memory;
    ``bias_tile``: the dQ kernel reduces dS in shared memory
    (:func:`cuonline.kernels.specs.bwd_bias_tile`: rel_bias or a block bias).
    """
    name = dtype_name(dtype)
    acc_bytes = np.dtype(acc_name(name)).itemsize
    words = acc_bytes // 4
    warps = WARPS
    # Rows per warp: each owned row keeps dK and dV (dK/dV kernel) in registers, ceil(D/32) +
    # ceil(Dv/32) accumulators per lane; more rows reuse each streamed element read from shared
    # memory for more FMAs. The forward's budget of 32 accumulator words, 8 rows at most (4 in
    # double, as the forward: its scores take two registers each).
    rows = 8 if words == 1 else 4
    cols = math.ceil(d / 32) + math.ceil(dv / 32)
    while rows > 1 and rows * cols * words > ACC_REGISTER_BUDGET:
        rows //= 2
    if dr and rows > 4:
        # rel_qk: its dot per score and band offsets need the registers of 4 rows
        # (docs/kernels.md, "Tile tables")
        rows = 4
    # Items per lane: 64-row streamed tiles halve the barriers per row while s and dP (two
    # values per owned row and item) stay within 16 registers and the block within the
    # no-opt-in budget.
    per = 2
    if (rows * per * 2 * words > 16
            or _bwd_simt_smem(name, d, dv, warps, rows, per, dr, bias_tile) > SMEM_NO_OPT_IN):
        per = 1
    # Large heads: fewer owned rows until the block fits beside another one on an SM
    # (SMEM_MAX), then, with one row per warp, the arch's opt-in limit.
    while rows > 1 and _bwd_simt_smem(name, d, dv, warps, rows, per, dr,
                                      bias_tile) > simt_smem_limit(arch):
        rows //= 2
    need = _bwd_simt_smem(name, d, dv, warps, rows, per, dr, bias_tile)
    limit = bwd_smem_limit(arch)
    if need > limit:
        raise ValueError(
            f"{name} attention backward with D = {d}, Dv = {dv}"
            f"{f', Dr = {dr}' if dr else ''} needs {need} bytes of shared "
            f"memory per block on the CUDA engine, more than {arch}'s {limit}; use "
            f"backend='numpy' or a smaller head dimension"
        )
    return warps, rows, per


@dataclass(frozen=True)
class BwdPlan:
    """A backward launch: the variant and the grids of its kernels, all over ``grid.x`` only:
    dK/dV and dQ (same block and shared memory), then with rel_q/rel_k the rel_k kernel
    (``rel_k_block`` threads, no shared memory; a grid of 0 blocks: not launched)."""

    spec: object             # AttentionBwdSimtSpec
    grid_dkdv: tuple         # nbatch * ceil(lk / block_r) blocks
    grid_dq: tuple           # nbatch * ceil(lq / block_r) blocks
    block: tuple
    shared_bytes: int
    grid_rel_k: tuple = (0, 1, 1)   # nbatch * ceil((Rk - 2) / REL_K_WARPS) blocks
    rel_k_block: tuple = (0, 1, 1)
    # a packed batch: (TileTable of the dQ blocks, (n, 2) key tiles of the dK/dV blocks)
    # (cuonline.kernels.varlen), else None
    varlen: object = None


#: Warps of a rel_k kernel block, each owning one row of rel_k's gradient (``kRelkWarps`` of
#: kernels_cu/attention_grads.cuh): small blocks, as each warp walks a diagonal alone.
REL_K_WARPS = 4


def plan_bwd_simt(problem, launch):
    """Plan the backward of :class:`cuonline._validate.Problem` ``problem`` (its forward
    description) on the SIMT backward family, on ``launch.arch``. ``launch.write_ds``: the dQ
    kernel writes dS, a plain bias's gradient (None: where the problem has one,
    :func:`bwd_writes_ds`). ValueError for an option the family does not support
    (:func:`cuonline.kernels.features.backward_of_problem`) or a block that does not fit."""
    from .specs import AttentionBwdSimtSpec  # noqa: PLC0415 - the backward's own spec

    dtype = dtype_name(problem.dtype)
    names = features.backward_of_problem(problem)
    dr = problem.dr if "rel_qk" in names else 0
    warps, rows, per = choose_bwd_tiles(dtype, problem.d, problem.dv, launch.arch, dr,
                                        bwd_bias_tile(names))
    spec = AttentionBwdSimtSpec(dtype=dtype, acc=acc_name(problem.acc_dtype), d=problem.d,
                                dv=problem.dv, warps=warps, rows_per_warp=rows,
                                items_per_lane=per, write_ds=_write_ds(launch, names),
                                features=names, dr=dr)
    return _bwd_plan(problem, spec, names)


def _write_ds(launch, names) -> bool:
    """The backward spec's ``write_ds``: the launch's choice, else :func:`bwd_writes_ds`."""
    return bwd_writes_ds(names) if launch.write_ds is None else bool(launch.write_ds)


def _bwd_plan(problem, spec, names):
    """The grids of a backward of ``spec``'s blocks (``block_r`` owned rows each): a block
    per key tile (dK/dV) and per query tile (dQ) of every batch element or, for a packed
    batch, of every sequence (:mod:`cuonline.kernels.varlen`'s tables); with rel_q/rel_k,
    a warp per row 1 .. 2 radius - 1 of rel_k's gradient. A ValueError where a grid exceeds
    CUDA's."""
    tables = None
    if getattr(problem, "cu_seqlens_q", None) is not None:
        args = (problem.cu_seqlens_q, problem.cu_seqlens_k, problem.sequence_diagonals,
                problem.window, spec.block_r)
        tables = (varlen.tile_table(*args), varlen.key_tile_table(*args))
        grids = dict(grid_dkdv=problem.nbatch * tables[1].shape[0],
                     grid_dq=problem.nbatch * len(tables[0]))
    else:
        grids = dict(grid_dkdv=problem.nbatch * math.ceil(problem.lk / spec.block_r),
                     grid_dq=problem.nbatch * math.ceil(problem.lq / spec.block_r))
    grids["grid_rel_k"] = 0
    if "rel_qk" in names and problem.dr > 0 and problem.rel_k_radius > 0:
        grids["grid_rel_k"] = problem.nbatch * math.ceil((2 * problem.rel_k_radius - 1)
                                                         / REL_K_WARPS)
    need = max(grids.values())
    if need > MAX_GRID_X:
        raise ValueError(f"attention backward needs {need} thread blocks, more than CUDA's "
                         f"{MAX_GRID_X}; use backend='numpy' or split the batch")
    return BwdPlan(spec=spec, **{name: (n, 1, 1) for name, n in grids.items()},
                   rel_k_block=(32 * REL_K_WARPS, 1, 1), block=(spec.threads, 1, 1),
                   shared_bytes=spec.shared_bytes, varlen=tables)


def bwd_writes_ds(names) -> bool:
    """Whether a backward variant with features ``names`` writes dS per place: a plain bias,
    whose gradient it is. A block bias's, rel_bias's and rel_q/rel_k's gradients are reduced
    in the kernel."""
    return "bias" in names and "bias_block" not in names


# --------------------------------------------------------------------------------------------
# the attention backward on tensor cores: attention_bwd_mma


def bwd_uses_mma(dtype, d, dv, names=(), arch=DEFAULT_ARCH, precision="highest",
                 dr=0) -> bool:
    """Whether the tensor-core backward family runs a backward of these parameters on
    ``arch`` (else ``attention_bwd_simt``): sm_80 and newer, a dtype and head dims of
    :data:`~cuonline.kernels.specs.MMA_BWD_MAX_HEAD_DIM` (the forward's rule: 16-bit inputs
    and float64 always, float32 only with ``precision="tf32"``), options ``names`` among
    :data:`~cuonline.kernels.features.MMA_BACKWARD_FEATURES`, and a block (with rel_q/rel_k
    of width ``dr``) that fits the arch's shared memory. The engine also keeps calls whose
    inputs hold a non-finite value on the SIMT family (see attention_bwd_mma.cu)."""
    from .specs import MMA_BWD_MAX_HEAD_DIM  # noqa: PLC0415 - the backward's own table

    if not mma_supported(arch):
        return False
    name = dtype_name(dtype)
    if name == "float32" and precision != "tf32":
        return False
    limit = MMA_BWD_MAX_HEAD_DIM.get(name, 0)
    return (max(d, dv) <= limit
            and all(n in features.MMA_BACKWARD_FEATURES for n in names)
            and _bwd_mma_block(name, d, dv, arch, dr, bwd_bias_tile(names))[2]
            <= mma_smem_limit(arch))


def choose_bwd_mma_tiles(dtype, d, dv, arch=DEFAULT_ARCH, dr=0, bias_tile=False):
    """Return ``(warps, block_c)`` of the tensor-core backward: 4 warps own 64 rows (16
    each: the mma's m); streamed tiles of 64 rows up to D = Dv = 64 and of 32 above, where
    dK and dV of 16 keys take (D + Dv) / 2 accumulators per lane and the transposed scores and
    dP another block_c (float64: two registers per accumulator, so 32-row tiles, 16 above
    D = 32). ValueError where the block does not fit ``arch``."""
    warps, block_c, need = _bwd_mma_block(dtype, d, dv, arch, dr, bias_tile)
    limit = mma_smem_limit(arch)
    if need > limit:
        raise ValueError(
            f"{dtype_name(dtype)} attention backward on tensor cores with D = {d}, Dv = {dv}"
            f"{f', Dr = {dr}' if dr else ''} needs {need} bytes of shared memory per block, "
            f"more than {arch}'s {limit}; use backend='numpy' or a narrower rel_q/rel_k")
    return warps, block_c


def _bwd_mma_block(dtype, d, dv, arch, dr, bias_tile=False):
    """``(warps, block_c, shared bytes)`` of the tensor-core backward's block (see
    :func:`choose_bwd_mma_tiles`), whether or not it fits ``arch``."""
    from .specs import AttentionBwdMmaSpec  # noqa: PLC0415

    if dtype_name(dtype) == "float64":
        block_c = 32 if max(d, dv) <= 32 else 16
    else:
        block_c = 64 if max(d, dv) <= 64 else 32
    need = probe_shared_bytes(AttentionBwdMmaSpec, dtype=dtype_name(dtype), d=d, dv=dv,
                              warps=WARPS, block_c=block_c, dr=dr, bias_tile=bias_tile)
    return WARPS, block_c, need


def plan_bwd_mma(problem, launch):
    """Plan the backward of ``problem`` on the tensor-core backward family (as
    :func:`plan_bwd_simt`; ``launch.cp_async``: q, k, v and dout rows are 16-byte aligned
    with unit column stride). ValueError where :func:`bwd_uses_mma` is false."""
    from .specs import AttentionBwdMmaSpec  # noqa: PLC0415

    arch = launch.arch
    dtype = dtype_name(problem.dtype)
    names = features.backward_of_problem(problem)
    dr = problem.dr if "rel_qk" in names else 0
    if not bwd_uses_mma(dtype, problem.d, problem.dv, names, arch, problem.precision, dr):
        raise ValueError(f"attention_bwd_mma does not run {dtype} D = {problem.d}, "
                         f"Dv = {problem.dv}{f', Dr = {dr}' if dr else ''} with {names} on "
                         f"{arch}")
    warps, block_c = choose_bwd_mma_tiles(dtype, problem.d, problem.dv, arch, dr,
                                          bwd_bias_tile(names))
    spec = AttentionBwdMmaSpec(dtype=dtype, d=problem.d, dv=problem.dv, warps=warps,
                               block_c=block_c, cp_async=bool(launch.cp_async),
                               write_ds=_write_ds(launch, names), features=names, dr=dr)
    return _bwd_plan(problem, spec, names)
