"""Where a CUDA-engine call runs: chosen once per call, from the backend.

A :class:`Target` says how kernel text becomes a module (NVRTC through ``cupy.RawModule`` on
the current device, or the C++ compiler of :mod:`cuonline.testing.emulate`), which arch and SM
count the planners assume, and which ``python -m cuonline tune`` winners apply.
:func:`current` builds it; the engines take nothing else.

Tests steer the engines through one named seam, :func:`overrides`: a context manager that sets
any field of the targets built inside it (held in a :mod:`contextvars` variable, so it is
private to the thread or task that set it and nests).

The emulation plans as the GPU cuonline is tuned for, an H100/H200 (``sm_90``, 132 SMs), with
the built-in tiles and no stored winners; other archs and SM counts come through
:func:`overrides`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Mapping

from ..kernels import heuristics, softmax_plan, source
from ..kernels.launch import Launch

__all__ = ["EMULATE_ARCH", "EMULATE_NUM_SMS", "Target", "current", "overrides"]

#: What the emulation plans for (see the module docstring).
EMULATE_ARCH = heuristics.DEFAULT_ARCH
EMULATE_NUM_SMS = heuristics.DEFAULT_NUM_SMS


@dataclass(frozen=True)
class Target:
    """Everything a CUDA-engine call needs to know about where it runs.

    Attributes
    ----------
    backend : str
        ``"cupy"`` or ``"emulate"``.
    arch : str
        ``"sm_XY"``: selects the attention family and the tile tables.
    num_sms : int
        Streaming multiprocessors the planners fill.
    tuned : Mapping
        ``(family, dtype, D bucket) -> tiles`` (see :mod:`cuonline.kernels.tuning`); empty: the
        built-in tiles.
    family : str or None
        Pins an attention family by name (tests, ``tune``): a forward family pins the forward,
        a backward family the backward; None: the dispatch rules.
    n_splits : int or None
        Forces the number of key splits; None: the planner decides.
    kernel_sources : Mapping or None
        Kernel file name -> replacement text (deliberately broken copies, mutants).
    emulate_options : Mapping or None
        Keywords of :func:`cuonline.testing.emulate.compile_module` (``mode``, ``tsan``).
    max_blocks, max_rows_per_launch, min_segment : int
        Softmax family: the grid cap (the kernel's row loop does the rest), the rows of one
        launch, the shortest segment of a cut row (see
        :func:`cuonline.kernels.softmax_plan.plan_softmax`).
    """

    backend: str
    arch: str
    num_sms: int
    tuned: Mapping = field(default_factory=lambda: MappingProxyType({}))
    family: str | None = None
    n_splits: int | None = None
    kernel_sources: Mapping | None = None
    emulate_options: Mapping | None = None
    max_blocks: int = softmax_plan.MAX_BLOCKS
    max_rows_per_launch: int = softmax_plan.MAX_ROWS_PER_LAUNCH
    min_segment: int = softmax_plan.MIN_SEGMENT

    def launch(self, **choices: Any) -> Launch:
        """The :class:`cuonline.kernels.launch.Launch` of one call on this target (arch, SM
        count, tune winners, the pinned family and key splits, the softmax caps) with the
        call's own ``choices`` (``cp_async``, ``top_k``, ``finite_inputs``, ``nrows``, ...):
        the one input, beside the problem, of every family's planner."""
        return Launch(arch=self.arch, num_sms=self.num_sms, family=self.family,
                      n_splits=self.n_splits, tuned=self.tuned, max_blocks=self.max_blocks,
                      min_segment=self.min_segment, **choices)

    def module(self, spec):
        """The compiled module of ``spec``, looked up by the spec, the replaced kernel texts and
        the emulation options before its text (:func:`source.build_source`, ~100 KB) is built:
        the text is built once per module, not per call."""
        sources = tuple(sorted((self.kernel_sources or {}).items()))
        if self.backend == "emulate":
            return _emulated_module(spec, sources,
                                    tuple(sorted((self.emulate_options or {}).items())))
        return _cupy_modules()(spec, sources)


_FIELDS = tuple(f.name for f in fields(Target) if f.name != "backend")
_overrides: contextvars.ContextVar = contextvars.ContextVar("cuonline_target_overrides",
                                                            default=MappingProxyType({}))


@contextlib.contextmanager
def overrides(**values: Any):
    """Set fields of every :class:`Target` built inside the ``with`` block (tests' seam).

    Keywords: ``arch``, ``num_sms``, ``tuned``, ``family``, ``n_splits``, ``kernel_sources``,
    ``emulate_options``, ``max_blocks``, ``max_rows_per_launch``, ``min_segment``. Nested
    blocks combine (the inner value wins); the values are private to the thread (or asyncio
    task) that entered the block.
    """
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise TypeError(f"overrides() takes {', '.join(_FIELDS)}; got {', '.join(unknown)}")
    token = _overrides.set(MappingProxyType({**_overrides.get(), **values}))
    try:
        yield
    finally:
        _overrides.reset(token)


def current(backend: str) -> Target:
    """The target of one call on ``backend`` (``"cupy"``: the current CuPy device, its SM
    count and its stored tune winners; ``"emulate"``: see the module docstring), with the
    fields that :func:`overrides` sets in this context."""
    if backend not in ("cupy", "emulate"):
        raise ValueError(f"the CUDA engine runs backend 'cupy' or 'emulate', got {backend!r}")
    # None means "not overridden" for every field
    chosen = {k: v for k, v in _overrides.get().items() if v is not None}
    if backend == "emulate":
        base = Target(backend="emulate", arch=EMULATE_ARCH, num_sms=EMULATE_NUM_SMS)
    else:
        base = _device_target(chosen)
    if "tuned" in chosen:
        chosen["tuned"] = MappingProxyType(dict(chosen["tuned"]))
    heuristics.arch_number(chosen.get("arch", base.arch))   # ValueError for a malformed arch
    return replace(base, **chosen)


def _device_target(chosen) -> Target:
    import cupy  # noqa: PLC0415 - only on the GPU path

    from . import tuning_files  # noqa: PLC0415

    arch, num_sms = _device_facts(cupy.cuda.Device().id)
    arch = chosen.get("arch") or arch
    num_sms = chosen.get("num_sms") or num_sms
    # forced tiles replace the stored winners: no file is read then
    tuned = {} if "tuned" in chosen else tuning_files.current_device_winners()
    return Target(backend="cupy", arch=arch, num_sms=num_sms, tuned=MappingProxyType(tuned))


@functools.lru_cache(maxsize=None)
def _device_facts(device_id):
    """``(arch, SM count)`` of a CUDA device, read once per process (reading the attributes
    is dozens of driver calls)."""
    import cupy  # noqa: PLC0415

    device = cupy.cuda.Device(device_id)
    return f"sm_{device.compute_capability}", int(device.attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def _emulated_module(spec, sources, options):
    """The emulated module of ``spec`` with the kernel texts ``sources`` (``(name, text)``
    pairs) and the keywords ``options`` of :func:`cuonline.testing.emulate.compile_module`."""
    from ..testing import emulate  # noqa: PLC0415 - g++ only when asked for

    text = source.build_source(spec, overrides=dict(sources))
    return emulate.compile_module(text, **dict(options))


@functools.cache
def _cupy_modules():
    """``(spec, sources) -> cupy.RawModule``, memoized per device (``cupy.memoize``)."""
    import cupy  # noqa: PLC0415

    from ..toolchain import nvrtc  # noqa: PLC0415 - the options every compile of our text takes

    @cupy.memoize(for_each_device=True)
    def module(spec, sources):
        # Compiled lazily at the first get_function; no name_expressions, so CuPy's on-disk
        # cache (keyed by the text and options) serves later processes.
        return cupy.RawModule(code=source.build_source(spec, overrides=dict(sources)),
                              options=nvrtc.compile_options(verbose=False))

    return module
