"""Launch planning for the softmax family (``softmax``, ``log_softmax``, ``logsumexp``): pure
functions of the shapes, testable without a GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .specs import SoftmaxSpec, acc_name, dtype_name

__all__ = ["BLOCK_THREADS", "MAX_BLOCKS", "MAX_ROWS_PER_LAUNCH", "MIN_SEGMENT", "SoftmaxPlan",
           "plan_softmax"]

WARP = 32
#: Threads per block (kMaxThreads in softmax.cu).
BLOCK_THREADS = SoftmaxSpec.threads
MAX_WARPS_PER_ROW = BLOCK_THREADS // WARP
#: Columns each lane visits before another warp is given to the row.
COLUMNS_PER_LANE = 32
#: The kernel splits the row index with 32-bit division: larger problems take several launches.
MAX_ROWS_PER_LAUNCH = 2**31 - 1
#: Grid cap: far more than the resident blocks of any GPU (132 SMs x 8 blocks of 256 threads);
#: the kernel's row loop covers the rest.
MAX_BLOCKS = 65535
#: Long rows, few of them: rows are cut into segments of at least this many columns (the
#: second launch and the partial states cost more below) until the grid has BLOCKS_PER_SM
#: blocks per SM, at most MAX_SEGMENTS per row.
MIN_SEGMENT = 16384
BLOCKS_PER_SM = 2
MAX_SEGMENTS = 4096


@dataclass(frozen=True)
class SoftmaxPlan:
    """A launch of the softmax family: the variant, its block shape and grid."""

    spec: SoftmaxSpec
    warps_per_row: int
    rows_per_block: int
    grid: tuple              # (row blocks, segments per row, 1)
    block: tuple
    seg_len: int             # columns per segment (n when rows are not cut)

    @property
    def segments(self) -> int:
        return self.grid[1]


def plan_softmax(problem, launch):
    """Plan a launch of :class:`cuonline._validate.SoftmaxProblem` ``problem`` over
    ``launch.nrows`` of its rows (None: all of them; a launch covers at most
    :data:`MAX_ROWS_PER_LAUNCH`).

    Rows are cut into segments (two launches, see softmax.cu) when they are long and too few
    to give each of ``launch.num_sms`` SMs ``BLOCKS_PER_SM`` blocks. ``launch.max_blocks``
    caps the grid (the kernel's row loop covers the rest), ``launch.min_segment`` is the
    shortest segment worth a second launch.
    """
    n = problem.n
    nrows = launch.nrows
    if nrows is None:
        nrows = math.prod(e for axis, e in enumerate(problem.x.shape) if axis != problem.axis)
    num_sms, max_blocks, min_segment = launch.num_sms, launch.max_blocks, launch.min_segment
    spec = SoftmaxSpec(dtype=dtype_name(problem.dtype), acc=acc_name(problem.dtype),
                       mode=problem.mode, mask=problem.mask is not None)
    # A warp per row while each lane has at most COLUMNS_PER_LANE columns: no barrier at all,
    # and a block holds 8 rows. Longer rows get more warps (merged through shared memory, two
    # barriers per row) until the block is full; beyond 8192 columns lanes take more columns.
    warps = 1
    while warps < MAX_WARPS_PER_ROW and n > COLUMNS_PER_LANE * WARP * warps:
        warps *= 2
    rows_per_block = MAX_WARPS_PER_ROW // warps
    row_blocks = math.ceil(nrows / rows_per_block)
    blocks = max(1, min(row_blocks, max_blocks))
    segments = 1
    if row_blocks < BLOCKS_PER_SM * num_sms and n >= 2 * min_segment:
        segments = min(n // min_segment, math.ceil(BLOCKS_PER_SM * num_sms / row_blocks),
                       MAX_SEGMENTS)
    seg_len = math.ceil(n / segments)
    return SoftmaxPlan(spec=spec, warps_per_row=warps, rows_per_block=rows_per_block,
                       grid=(blocks, math.ceil(n / seg_len), 1), block=(BLOCK_THREADS, 1, 1),
                       seg_len=seg_len)
