"""The kernel families, each declared once: the one place that lists them.

A family is one kernel source file (with the shared headers pasted before it), the spec class
of its compiled variants, its planner, its argument builder and the variants that ``python -m
cuonline kernels`` lists per arch. The CUDA engine, the NVRTC listing, ``tune`` and the tests
read :data:`FAMILIES`; adding a family (``attention_bwd_simt``, ...) is one entry here plus its
own files (kernel text, spec class, planner, argument builder).

The kernel file names are written here only: :mod:`cuonline.kernels.source` asks the registry
which files make up a variant's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import arguments, features, heuristics, softmax_plan, stats_plan
from .heuristics import DEFAULT_ARCH
from .specs import (SOFTMAX_MODES, AttentionBwdMmaSpec, AttentionBwdSimtSpec, AttentionMmaSpec,
                    AttentionSimtSpec, AttentionStatsSpec, SoftmaxSpec, acc_name,
                    bwd_bias_tile)

__all__ = ["FAMILIES", "Family", "backward_family", "entries_of", "files_of", "forward_families",
           "get", "of", "listing_specs", "plan_attention", "plan_backward", "select_forward"]

#: Pasted first into every family's text: online-softmax state, warp reductions, PTX helpers.
COMMON_HEADER = "common.cuh"


@dataclass(frozen=True)
class Family:
    """One kernel family.

    Attributes
    ----------
    name : str
        The family's name, which starts every key of its variants (``spec.family``).
    source : str
        Its kernel file in ``kernels_cu/``.
    headers : tuple of str
        Files pasted before it, in order.
    entries : tuple of str
        The kernel symbols ``source`` defines.
    spec : type or None
        The spec class of its variants; None for a family compiled only inside another's text.
    planner : callable
        ``planner(problem, launch) -> plan``: the problem (the family's
        :mod:`cuonline._validate` value) and a :class:`cuonline.kernels.launch.Launch` give the
        plan of its launches (spec, grids, block, shared memory).
    arguments : callable
        ``arguments(problem, plan, buffers) -> args``: the typed arguments of its entry points
        from the problem, the plan and ``buffers``, a mapping of the arrays the call writes or
        reads beyond the problem (each builder names them: ``*_BUFFERS`` in
        :mod:`cuonline.kernels.arguments`, :data:`cuonline.kernels.stats_plan.STATS_BUFFERS`).
    listing : callable or None
        ``arch -> list of specs``: the variants ``python -m cuonline kernels`` compiles.
    includes : tuple of Family
        Families whose source is pasted into this one's text (after ``headers``), so that one
        module holds both: the forward kernels and the split-key combine.
    runs : callable or None
        Attention forward families: ``(dtype, d, dv, precision, arch) -> bool``, whether the
        dispatcher runs this family for such a call (exactly one forward family does).
    """

    name: str
    source: str
    headers: tuple
    entries: tuple
    spec: type | None
    planner: Callable
    arguments: Callable
    listing: Callable | None = None
    includes: tuple = ()
    runs: Callable | None = None


# --------------------------------------------------------------------------------------------
# listing entries: a representative set of the variants the dispatcher selects on an arch


#: The rel_q/rel_k width of the listed rel_qk variants (Enformer-style relative keys).
LISTING_DR = 64


def _simt(dtype, d, dv, lq, *, arch, features=(), split=False):
    dr = LISTING_DR if "rel_qk" in features else 0
    try:
        warps, rows, keys = heuristics.choose_tiles(dtype, d, dv, lq, nbatch=32, arch=arch,
                                                    dr=dr)
    except ValueError:
        return None   # does not fit this arch's shared memory: the planner refuses it too
    return AttentionSimtSpec(dtype=dtype, acc=acc_name(dtype), d=d, dv=dv, warps=warps,
                             rows_per_warp=rows, keys_per_lane=keys, features=features,
                             split=split, dr=dr)


def _mma(dtype, d, dv, lq, *, arch, cp_async=True, features=(), split=False):
    dr = LISTING_DR if "rel_qk" in features else 0
    tiles = heuristics.choose_mma_tiles(dtype, d, dv, lq, arch, dr=dr)
    return AttentionMmaSpec(dtype=dtype, d=d, dv=dv, cp_async=cp_async, **tiles._asdict(),
                            features=features, split=split, dr=dr)


def _names(family):
    """The score options ``family`` supports (the layouts are listed on their own:
    :func:`_varlen_listing`)."""
    return tuple(f.name for f in features.supported_by(family)
                 if f.name not in features.LAYOUT_FEATURES)


def _alone(name):
    """The variant of one option: with the options it requires, and for an option that
    modifies them, with the terms it is about (softcap_bias: a bias)."""
    extra = ("bias",) if features.by_name(name).requires else ()
    return features.with_required((name,) + extra)


def _together(names):
    """Every option at once, in each of the ways one option can modify another (the soft cap
    of the content score, and of the whole logit)."""
    modifiers = {n for n in names if features.by_name(n).requires}
    return [tuple(n for n in names if n not in modifiers), names] if modifiers else [names]


def _simt_listing(arch: str = DEFAULT_ARCH) -> list:
    """SIMT family: every dtype x D in {32, 64, 128, 256} (long sequences, no options) and the
    decoding shape (Lq = 1, split keys); for float32 and float16 at D = 64 and 128: Dv = 2 D,
    each option alone and all of them together (with the soft cap of the content score and of
    the whole logit); float64 D = 256 decoding with every option."""
    names = _names(AttentionSimtSpec.family)
    specs = []
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for d in (32, 64, 128, 256):
            specs.append(_simt(dtype, d, d, 4096, arch=arch))
        specs.append(_simt(dtype, 128, 128, 1, arch=arch, split=True, features=("return_lse",)))
    for dtype in ("float32", "float16"):
        for d in (64, 128):
            specs.append(_simt(dtype, d, 2 * d, 4096, arch=arch))
            for name in names:
                specs.append(_simt(dtype, d, d, 4096, arch=arch, features=_alone(name)))
            for together in _together(names):
                specs.append(_simt(dtype, d, d, 4096, arch=arch, features=together))
    for together in _together(names):
        specs.append(_simt("float64", 256, 256, 1, arch=arch, split=True, features=together))
    return specs + _varlen_listing(_simt, names, arch)


def _mma_listing(arch: str = DEFAULT_ARCH) -> list:
    """Tensor-core family (sm_80 and newer; none below): every dtype (float32 = TF32) x D in
    {32, 64, 96, 128, 256} (float64 up to 128), Dv != D, each option alone at D = 64 and all
    together at D = 64 and 128 (f16 and tf32), all at f16 D = 256 and f64 D = 64 (all: with
    either soft cap, of the content score or of the whole logit), the decoding
    shape (Lq = 1, split keys), split keys with many queries (f16 and tf32) and the
    element-wise loader (strided views)."""
    if not heuristics.mma_supported(arch):
        return []
    names = _names(AttentionMmaSpec.family)
    specs = []
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        dims = (32, 64, 96, 128) + ((256,) if dtype != "float64" else ())
        for d in dims:
            specs.append(_mma(dtype, d, d, 4096, arch=arch))
        specs.append(_mma(dtype, 128, 128, 1, arch=arch, split=True, features=("return_lse",)))
        specs.append(_mma(dtype, 64, 64, 4096, arch=arch, cp_async=False, features=("window",)))
    for dtype in ("float16", "float32"):
        specs.append(_mma(dtype, 128, 64, 4096, arch=arch))
        for name in names:
            specs.append(_mma(dtype, 64, 64, 4096, arch=arch, features=_alone(name)))
        for d in (64, 128):
            for together in _together(names):
                specs.append(_mma(dtype, d, d, 4096, arch=arch, features=together))
        # split keys at two query tiles per warp (a few hundred queries, many keys)
        specs.append(_mma(dtype, 64, 64, 4096, arch=arch, split=True, features=("return_lse",)))
    for together in _together(names):
        specs.append(_mma("float16", 256, 256, 4096, arch=arch, features=together))
        specs.append(_mma("float64", 64, 64, 4096, arch=arch, features=together))
        specs.append(_mma("float64", 128, 128, 1, arch=arch, split=True, features=together))
    return specs + _varlen_listing(_mma, names, arch)


def _varlen_listing(make, names, arch) -> list:
    """Packed batches (issue 20) on a forward family (``make``: :func:`_simt` or
    :func:`_mma`): float32 (float16 on the tensor cores) at D = 64 alone, float16 D = 128
    causal with lse, every score option at D = 64 (with either soft cap; bias, mask,
    bias_block and kv_lengths are refused with a packed batch) and at float64 D = 128 (SIMT)
    or D = 64 (tensor cores)."""
    score = tuple(n for n in names if n not in ("bias", "bias_block", "mask", "kv_lengths"))
    first = "float32" if make is _simt else "float16"
    specs = [make(first, 64, 64, 4096, arch=arch, features=("varlen",)),
             make("float16", 128, 128, 4096, arch=arch,
                  features=("window", "return_lse", "varlen"))]
    for together in _together(score):
        specs.append(make(first, 64, 64, 4096, arch=arch, features=together + ("varlen",)))
    wide = 128 if make is _simt else 64
    specs.append(make("float64", wide, wide, 4096, arch=arch, features=score + ("varlen",)))
    return specs


def _bwd(dtype, d, dv, *, arch, features=()):
    dr = LISTING_DR if "rel_qk" in features else 0
    try:
        warps, rows, per = heuristics.choose_bwd_tiles(dtype, d, dv, arch, dr,
                                                       bwd_bias_tile(features))
    except ValueError:
        return None   # does not fit this arch's shared memory: the planner refuses it too
    return AttentionBwdSimtSpec(dtype=dtype, acc=acc_name(dtype), d=d, dv=dv, warps=warps,
                                rows_per_warp=rows, items_per_lane=per,
                                write_ds=heuristics.bwd_writes_ds(features), features=features,
                                dr=dr)


def _bwd_listing(arch: str = DEFAULT_ARCH) -> list:
    """SIMT backward family (every arch): every dtype x D in {32, 64, 128, 256} without
    options (float64 D = 256 only where it fits), float32 D = 64 with Dv = 2 D and with each
    option alone, every option together (with either soft cap) for float32 and float16 at
    D = 64 and float64 at D = 128."""
    names = tuple(n for n in features.BACKWARD_FEATURES if n not in features.LAYOUT_FEATURES)
    specs = []
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for d in (32, 64, 128, 256):
            specs.append(_bwd(dtype, d, d, arch=arch))
    specs.append(_bwd("float32", 64, 128, arch=arch))
    for name in names:
        specs.append(_bwd("float32", 64, 64, arch=arch, features=_alone(name)))
    for dtype, d in (("float32", 64), ("float16", 64), ("float64", 128)):
        for together in _together(names):
            specs.append(_bwd(dtype, d, d, arch=arch, features=together))
    return specs + _bwd_varlen_listing(_bwd, names, arch)


def _bwd_mma(dtype, d, dv, *, arch, features=(), cp_async=True):
    dr = LISTING_DR if "rel_qk" in features else 0
    try:
        warps, block_c = heuristics.choose_bwd_mma_tiles(dtype, d, dv, arch, dr,
                                                         bwd_bias_tile(features))
    except ValueError:
        return None   # does not fit this arch (float64 with every option on sm_80): SIMT runs it
    return AttentionBwdMmaSpec(dtype=dtype, d=d, dv=dv, warps=warps, block_c=block_c,
                               cp_async=cp_async, write_ds=heuristics.bwd_writes_ds(features),
                               features=features, dr=dr)


def _bwd_mma_listing(arch: str = DEFAULT_ARCH) -> list:
    """Tensor-core backward family (sm_80 and newer; none below): float16 and bfloat16 x D
    in {32, 64, 128}, float32 (TF32) and float64 x D in {32, 64}, without options; float16
    D = 64 with Dv = 2 D, with each option alone and with the element-wise loader; every
    option together at float16 D = 64 and 128, TF32 D = 64 and float64 D = 64."""
    if not heuristics.mma_supported(arch):
        return []
    names = tuple(n for n in features.MMA_BACKWARD_FEATURES
                  if n not in features.LAYOUT_FEATURES)
    specs = [_bwd_mma(dtype, d, d, arch=arch) for dtype in ("float16", "bfloat16")
             for d in (32, 64, 128)]
    specs += [_bwd_mma(dtype, d, d, arch=arch) for dtype in ("float32", "float64")
              for d in (32, 64)]
    specs.append(_bwd_mma("float16", 64, 128, arch=arch))
    specs.append(_bwd_mma("float16", 64, 64, arch=arch, cp_async=False, features=("window",)))
    for name in names:
        specs.append(_bwd_mma("float16", 64, 64, arch=arch, features=_alone(name)))
    for dtype, d in (("float16", 64), ("float16", 128), ("float32", 64), ("float64", 64)):
        for together in _together(names):
            specs.append(_bwd_mma(dtype, d, d, arch=arch, features=together))
    return specs + _bwd_varlen_listing(_bwd_mma, names, arch)


def _bwd_varlen_listing(make, names, arch) -> list:
    """Packed batches (issue 20) on a backward family (``make``: :func:`_bwd` or
    :func:`_bwd_mma`): float32 (SIMT) or float16 (tensor cores) D = 64 alone and causal, every
    score option the family has at D = 64 (either soft cap where it has both) and float64
    D = 64 with every option."""
    score = tuple(n for n in names if n not in ("bias", "bias_block", "mask", "kv_lengths"))
    first = "float32" if make is _bwd else "float16"
    specs = [make(first, 64, 64, arch=arch, features=("varlen",)),
             make(first, 64, 64, arch=arch, features=("window", "varlen"))]
    for together in _together(score):
        specs.append(make(first, 64, 64, arch=arch, features=together + ("varlen",)))
    specs.append(make("float64", 64, 64, arch=arch, features=score + ("varlen",)))
    return specs


def _softmax_listing(arch: str = DEFAULT_ARCH) -> list:
    """Softmax family: every variant (dtype x mode x mask; launch shapes are runtime
    parameters)."""
    return [SoftmaxSpec(dtype=dtype, acc=acc_name(dtype), mode=mode, mask=mask)
            for dtype in ("float16", "bfloat16", "float32", "float64")
            for mode in SOFTMAX_MODES for mask in (False, True)]


def _stats(dtype, d, *, arch, features=(), top_k=True):
    dr = LISTING_DR if "rel_qk" in features else 0
    try:
        rows, keys = stats_plan.choose_stats_tiles(dtype, d, 4096, nbatch=32, arch=arch, dr=dr)
    except ValueError:
        return None   # does not fit this arch's shared memory: the planner refuses it too
    return AttentionStatsSpec(dtype=dtype, acc=acc_name(dtype), d=d, warps=stats_plan.WARPS,
                              rows_per_warp=rows, keys_per_lane=keys, top_k=top_k,
                              features=features, dr=dr)


def _stats_listing(arch: str = DEFAULT_ARCH) -> list:
    """Statistics family (every arch): every dtype x D in {32, 64, 128, 256} with the top-k
    selection, float32 D = 64 without it and with each option alone, every option together
    (with either soft cap) for float32 and float16 at D = 64 and float64 at D = 128."""
    names = _names(AttentionStatsSpec.family)
    specs = [_stats(dtype, d, arch=arch) for dtype in ("float16", "bfloat16", "float32",
                                                       "float64") for d in (32, 64, 128, 256)]
    specs.append(_stats("float32", 64, arch=arch, top_k=False))
    for name in names:
        specs.append(_stats("float32", 64, arch=arch, features=_alone(name)))
    for dtype, d in (("float32", 64), ("float16", 64), ("float64", 128)):
        for together in _together(names):
            specs.append(_stats(dtype, d, arch=arch, features=together))
    return specs


# --------------------------------------------------------------------------------------------
# the registry


ATTENTION_COMBINE = Family(
    name="attention_combine", source="attention_combine.cuh", headers=(COMMON_HEADER,),
    entries=("cuonline_attention_combine",), spec=None, planner=heuristics.plan_combine,
    arguments=arguments.combine_arguments,
)
ATTENTION_FWD_SIMT = Family(
    name=AttentionSimtSpec.family, source="attention_fwd_simt.cu",
    headers=(COMMON_HEADER, "attention_score.cuh"), entries=("cuonline_attention_fwd",),
    spec=AttentionSimtSpec, planner=heuristics.plan_simt,
    arguments=arguments.attention_fwd_arguments, listing=_simt_listing,
    includes=(ATTENTION_COMBINE,),
    runs=lambda dtype, d, dv, precision, arch: not heuristics.uses_mma(dtype, d, dv, precision,
                                                                       arch),
)
ATTENTION_FWD_MMA = Family(
    name=AttentionMmaSpec.family, source="attention_fwd_mma.cu",
    headers=(COMMON_HEADER, "tensor_core.cuh", "mma_fragments.cuh", "mma_tile_load.cuh",
             "attention_score.cuh"),
    entries=("cuonline_attention_mma",), spec=AttentionMmaSpec, planner=heuristics.plan_mma,
    arguments=arguments.attention_fwd_arguments, listing=_mma_listing,
    includes=(ATTENTION_COMBINE,), runs=heuristics.uses_mma,
)
ATTENTION_BWD_SIMT = Family(
    name=AttentionBwdSimtSpec.family, source="attention_bwd_simt.cu",
    headers=(COMMON_HEADER, "attention_score.cuh", "attention_grads.cuh"),
    entries=("cuonline_attention_bwd_dkdv", "cuonline_attention_bwd_dq",
             "cuonline_attention_bwd_rel_k"),
    spec=AttentionBwdSimtSpec, planner=heuristics.plan_bwd_simt,
    arguments=arguments.attention_bwd_arguments, listing=_bwd_listing,
)
ATTENTION_BWD_MMA = Family(
    name=AttentionBwdMmaSpec.family, source="attention_bwd_mma.cu",
    headers=(COMMON_HEADER, "tensor_core.cuh", "mma_fragments.cuh", "mma_tile_load.cuh",
             "attention_score.cuh", "attention_grads.cuh"),
    entries=("cuonline_attention_bwd_mma_dkdv", "cuonline_attention_bwd_mma_dq",
             "cuonline_attention_bwd_mma_rel_k"),
    spec=AttentionBwdMmaSpec, planner=heuristics.plan_bwd_mma,
    arguments=arguments.attention_bwd_arguments, listing=_bwd_mma_listing,
)
SOFTMAX = Family(
    name=SoftmaxSpec.family, source="softmax.cu", headers=(COMMON_HEADER,),
    entries=("cuonline_softmax", "cuonline_softmax_partial", "cuonline_softmax_finish"),
    spec=SoftmaxSpec, planner=softmax_plan.plan_softmax, arguments=arguments.softmax_arguments,
    listing=_softmax_listing,
)
ATTENTION_STATS = Family(
    name=AttentionStatsSpec.family, source="attention_stats.cu",
    headers=(COMMON_HEADER, "attention_score.cuh"), entries=tuple(stats_plan.STATS_ENTRIES),
    spec=AttentionStatsSpec, planner=stats_plan.plan_stats,
    arguments=stats_plan.stats_arguments, listing=_stats_listing,
)

#: Every kernel family, in listing order.
FAMILIES = (ATTENTION_FWD_SIMT, ATTENTION_FWD_MMA, ATTENTION_COMBINE, ATTENTION_BWD_SIMT,
            ATTENTION_BWD_MMA, SOFTMAX, ATTENTION_STATS)
_BY_NAME = {f.name: f for f in FAMILIES}
assert set(features.FORWARD_FAMILIES) == {f.name for f in FAMILIES if f.runs is not None}
assert set(features.BACKWARD_FAMILIES) == {ATTENTION_BWD_SIMT.name, ATTENTION_BWD_MMA.name}
assert set(features.STATS_FAMILIES) == {ATTENTION_STATS.name}


def get(name: str) -> Family:
    """The family called ``name``; ValueError naming the registered ones otherwise."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"family must be one of {', '.join(map(repr, _BY_NAME))}, "
                         f"got {name!r}") from None


def of(spec) -> Family:
    """The family of a spec (its ``family`` attribute)."""
    return _BY_NAME[spec.family]


def files_of(spec) -> tuple:
    """The kernel files whose texts, in order, follow a variant's defines: the family's
    headers, the sources of the families it includes, then its own source."""
    family = of(spec)
    return family.headers + tuple(f.source for f in family.includes) + (family.source,)


def entries_of(spec) -> tuple:
    """Kernel symbols a variant's module defines: its family's, then those it includes."""
    family = of(spec)
    return family.entries + tuple(e for f in family.includes for e in f.entries)


def forward_families() -> tuple:
    """The attention forward families (those the dispatcher chooses among)."""
    return tuple(f for f in FAMILIES if f.runs is not None)


def select_forward(dtype, d, dv, precision="highest", arch=DEFAULT_ARCH) -> Family:
    """The forward family the dispatcher runs for these parameters on ``arch``."""
    (family,) = [f for f in forward_families() if f.runs(dtype, d, dv, precision, arch)]
    return family


def backward_family(dtype, d, dv, names=(), arch=DEFAULT_ARCH, precision="highest",
                    dr=0) -> Family:
    """The backward family for a backward of these parameters (options ``names``, rel_q/rel_k
    of width ``dr``) on ``arch`` with finite inputs: the tensor-core one where
    :func:`cuonline.kernels.heuristics.bwd_uses_mma` says so, else the SIMT one."""
    return (ATTENTION_BWD_MMA if heuristics.bwd_uses_mma(dtype, d, dv, names, arch, precision,
                                                         dr)
            else ATTENTION_BWD_SIMT)


def _pinned(launch, candidates):
    """The family among ``candidates`` that ``launch.family`` pins, or None: none pinned, or
    one of another kind (a forward family pins the forward, a backward family the
    backward). ValueError for a name that is no family."""
    if launch.family is None:
        return None
    chosen = get(launch.family)
    return chosen if chosen in candidates else None


def plan_attention(problem, launch):
    """Plan the forward of :class:`cuonline._validate.Problem` ``problem`` on
    :class:`cuonline.kernels.launch.Launch` ``launch``: the forward family (the one pinned by
    ``launch.family``, else :func:`select_forward` on ``launch.arch``; the SIMT family runs
    every dtype below sm_80), then its planner (tiles from ``launch.num_sms`` and
    ``launch.tuned``, key splits, ``launch.cp_async``: see
    :func:`cuonline.kernels.heuristics.plan_mma`).
    """
    heuristics.arch_number(launch.arch)   # ValueError for a malformed arch
    chosen = _pinned(launch, forward_families())
    if chosen is None and launch.family is not None:
        raise ValueError(f"family must be an attention forward family "
                         f"({', '.join(f.name for f in forward_families())}), "
                         f"got {launch.family!r}")
    if chosen is None:
        chosen = select_forward(problem.dtype, problem.d, problem.dv, problem.precision,
                                launch.arch)
    return chosen.planner(problem, launch)


def plan_backward(problem, launch):
    """Plan the backward of :class:`cuonline._validate.Problem` ``problem`` (its forward
    description) on :class:`cuonline.kernels.launch.Launch` ``launch``: the backward family
    pinned by ``launch.family``, else the tensor-core one where :func:`backward_family` says
    it runs the call and every q, k, v and dout element is finite
    (``launch.inputs_finite()``, asked only then: its mmas would carry a NaN or inf into rows
    that do not see it, where the SIMT family skips zero weights), else the SIMT one; then its
    planner.
    """
    heuristics.arch_number(launch.arch)   # ValueError for a malformed arch
    chosen = _pinned(launch, (ATTENTION_BWD_SIMT, ATTENTION_BWD_MMA))
    if chosen is None:
        names = features.backward_of_problem(problem)
        chosen = backward_family(problem.dtype, problem.d, problem.dv, names, launch.arch,
                                 problem.precision, problem.dr if "rel_qk" in names else 0)
        if chosen is ATTENTION_BWD_MMA and not launch.inputs_finite():
            chosen = ATTENTION_BWD_SIMT
    return chosen.planner(problem, launch)


def listing_specs(arch: str = DEFAULT_ARCH) -> list:
    """Every family's listed variants on ``arch``, in registry order, without duplicates."""
    seen, unique = set(), []
    for family in FAMILIES:
        for spec in (family.listing(arch) if family.listing is not None else ()):
            if spec is not None and spec.key not in seen:
                seen.add(spec.key)
                unique.append(spec)
    return unique
