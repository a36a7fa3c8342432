"""CBLAS's conventions, shared by the callers of ``cblas_?gemm``: the Python one
(:mod:`.cpu_blas`) and the compiled task loops (:mod:`._task_kernels`).

CBLAS takes a matrix as an address, a transpose flag and a leading dimension; a NumPy view has
an address and two strides. :func:`layout_of` is the one map from the second to the first, in
plain integers so that numba compiles the same function: both callers then pass the same
flags for the same views, and a library gives the same bits to both.
"""

from __future__ import annotations

__all__ = ["ROW_MAJOR", "NO_TRANS", "TRANS", "layout_of"]

# CBLAS's enums (cblas.h): C ints whatever the integer width of the library
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def layout_of(rows, cols, row_step, col_step, size):
    """``(transpose flag, leading dimension)`` of a ``rows x cols`` matrix of ``size``-byte
    elements ``row_step`` and ``col_step`` bytes apart, as row-major CBLAS reads it; ``(0, 0)``
    when neither dimension is contiguous. Plain integers in and out, so that compiled callers
    (:mod:`._task_kernels`) make the calls :mod:`.cpu_blas` makes, to the bit."""
    if col_step == size or cols == 1:
        ld = row_step // size if rows > 1 else cols
        if rows == 1 or (row_step % size == 0 and ld >= cols):
            return NO_TRANS, max(ld, 1)
    if row_step == size or rows == 1:
        ld = col_step // size if cols > 1 else rows
        if cols == 1 or (col_step % size == 0 and ld >= rows):
            return TRANS, max(ld, 1)
    return 0, 0
