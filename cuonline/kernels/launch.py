"""The launch context: the one input, beside the problem, of every family's planner.

Every planner of :data:`cuonline.kernels.families.FAMILIES` is ``planner(problem, launch) ->
plan`` and every argument builder ``arguments(problem, plan, buffers) -> args``: the engines
call any family the same way. :class:`Launch` holds where the call runs (arch, SM count, the
tune winners), the choices the engine made for this call (aligned rows, statistics' top-k,
the rows of a softmax launch, whether the backward's inputs are finite) and the test seam's
pins (a family, a number of key splits, the softmax caps). A family reads the fields it needs
and ignores the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .heuristics import DEFAULT_ARCH, DEFAULT_NUM_SMS
from .softmax_plan import MAX_BLOCKS, MIN_SEGMENT

__all__ = ["Launch"]


@dataclass(frozen=True)
class Launch:
    """Where one call runs and what its engine chose for it.

    Attributes
    ----------
    arch : str
        ``"sm_XY"``: selects the family and bounds its shared memory.
    num_sms : int
        Streaming multiprocessors the planners fill.
    family : str or None
        A family pinned by name (tests, ``tune``): a forward family pins the forward, a
        backward family the backward; None: the dispatch rules
        (:func:`cuonline.kernels.families.plan_attention`,
        :func:`cuonline.kernels.families.plan_backward`).
    n_splits : int or None
        Attention forward: key splits forced (None: the planner decides); the split-key
        combine: the forward plan's count.
    tuned : Mapping or None
        ``(family, dtype, D bucket) -> tiles`` measured by ``python -m cuonline tune``
        (:func:`cuonline.kernels.heuristics.tuned_tiles`); None or empty: the built-in tiles.
    cp_async : bool
        Tensor-core families: q, k, v (and the backward's dout) rows are 16-byte aligned with
        unit column stride (:func:`cuonline.kernels.arguments.cp_async_aligned`), else the
        kernel loads element by element.
    write_ds : bool or None
        Backward: the dQ kernel writes dS per place (None: where a plain bias needs it,
        :func:`cuonline.kernels.heuristics.bwd_writes_ds`).
    finite_inputs : bool or callable
        Backward: whether every q, k, v and dout element is finite, or a function of no
        arguments that says so, called only where the answer decides the family (the
        tensor-core backward would run: its mmas would carry a NaN or inf into rows that do
        not see it).
    top_k : int
        Statistics: the best keys kept per query (0: none).
    nrows : int or None
        Softmax: the rows of this launch (None: every row of the problem).
    max_blocks, min_segment : int
        Softmax: the grid cap and the shortest segment of a cut row
        (:func:`cuonline.kernels.softmax_plan.plan_softmax`).
    """

    arch: str = DEFAULT_ARCH
    num_sms: int = DEFAULT_NUM_SMS
    family: str | None = None
    n_splits: int | None = None
    tuned: Mapping | None = None
    cp_async: bool = True
    write_ds: bool | None = None
    finite_inputs: bool | Callable[[], bool] = True
    top_k: int = 0
    nrows: int | None = None
    max_blocks: int = MAX_BLOCKS
    min_segment: int = MIN_SEGMENT

    def inputs_finite(self) -> bool:
        """:attr:`finite_inputs`, calling it if it is a function."""
        finite = self.finite_inputs
        return bool(finite() if callable(finite) else finite)
