"""The attention options that a kernel variant compiles in: one table, read by everything else.

Each row of :data:`FEATURES` says what an option is called (the spec flag and the key tag), how
it follows from a :class:`cuonline._validate.Problem`, which ``#define`` turns it on in the
kernel text, which kernel parameters carry its data, and which kernel families support it.
The spec flags (:attr:`cuonline.kernels.specs.AttentionSpec.features`), the defines, the
plan's flags, the ``python -m cuonline kernels`` listing and the tune candidates are all
derived from this table; no other place lists the options.

Adding a score term is one row here, plus its validation rule in ``_validate``, its member of
the kernels' score pipeline (``kernels_cu/``), its NumPy term and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["BACKWARD_FAMILIES", "BACKWARD_FEATURES", "FEATURES", "FORWARD_FAMILIES",
           "Feature", "LAYOUT_FEATURES", "MMA_BACKWARD_FEATURES", "backward_of_problem", "by_name", "of_problem",
           "supported_by", "with_required"]

#: The attention forward and backward families (names as in :mod:`cuonline.kernels.families`).
#: Named here as the families each option supports; the registry checks that every name is
#: registered.
FORWARD_FAMILIES = ("attention_fwd_simt", "attention_fwd_mma")
BACKWARD_FAMILIES = ("attention_bwd_simt", "attention_bwd_mma")
#: The family of :func:`cuonline.attention_stats` (issue 21): every score option's row names it.
STATS_FAMILIES = ("attention_stats",)


@dataclass(frozen=True)
class Feature:
    """One attention option as the kernels see it.

    Attributes
    ----------
    name : str
        The spec flag and the tag in a variant's key (``window``, ``bias``, ...).
    of_problem : callable
        ``Problem -> bool``: whether a call needs it.
    define : str
        The ``#define`` (value 0 or 1) that compiles it in.
    arguments : tuple of str
        The kernel parameters that carry its data (names as in the families' signatures).
    families : tuple of str
        The forward kernel families that support it, and ``attention_stats`` where the
        statistics kernels do (every score term; not ``return_lse``).
    backward_families : tuple of str
        The backward kernel families that support it (its gradient, or none for a term that
        has none): the score pipeline's terms both, ``softcap_bias`` the SIMT one,
        ``return_lse`` none (the backward takes lse as an input).
    requires : tuple of str
        The features it modifies, which a variant with it always has too (validation refuses
        a call that sets it alone).
    """

    name: str
    of_problem: Callable
    define: str
    arguments: tuple
    families: tuple = FORWARD_FAMILIES + STATS_FAMILIES
    requires: tuple = ()
    backward_families: tuple = BACKWARD_FAMILIES


#: In key order. ``causal`` has no row: it is folded into ``window`` by validation.
FEATURES = (
    Feature("window", lambda p: p.has_window, "CUONLINE_HAS_WINDOW",
            ("window_left", "window_right")),
    Feature("bias", lambda p: p.bias is not None, "CUONLINE_HAS_BIAS", ("bias",)),
    # the bias is coarse: (i, j) reads its element (i // r, j // c) (``bias_block=(r, c)``)
    Feature("bias_block", lambda p: p.bias_block is not None, "CUONLINE_HAS_BIAS_BLOCK",
            ("bias_block_rows", "bias_block_cols"), requires=("bias",)),
    Feature("mask", lambda p: p.mask is not None, "CUONLINE_HAS_MASK", ("mask",)),
    Feature("kv_lengths", lambda p: p.kv_lengths is not None, "CUONLINE_HAS_KV_LENGTHS",
            ("kv_lengths",)),
    Feature("alibi", lambda p: p.alibi_slopes is not None, "CUONLINE_HAS_ALIBI",
            ("alibi_slopes",)),
    # Toeplitz bias rel_bias[rb + clip(delta, -rb, rb)] (``rel_bias``)
    Feature("rel_bias", lambda p: p.rel_bias is not None, "CUONLINE_HAS_REL_BIAS",
            ("rel_bias", "rel_bias_radius")),
    # rel_q[i] . rel_k[rk + clip(delta, -rk, rk)] added to the content score (``rel_q``,
    # ``rel_k``); its width Dr is a compile-time constant of the spec (``dr``), like D
    # (Dr = 0 adds exactly 0: no variant of its own)
    Feature("rel_qk", lambda p: p.rel_q is not None and p.dr > 0, "CUONLINE_HAS_REL_QK",
            ("rel_q", "rel_k", "rel_k_radius")),
    Feature("softcap", lambda p: p.softcap is not None, "CUONLINE_HAS_SOFTCAP", ("softcap",)),
    # the soft cap applies to the whole logit, after bias and ALiBi (``softcap_bias=True``)
    Feature("softcap_bias", lambda p: p.softcap_bias, "CUONLINE_SOFTCAP_BIAS", ("softcap",),
            requires=("softcap",), backward_families=("attention_bwd_simt",)),
    Feature("return_lse", lambda p: p.return_lse, "CUONLINE_RETURN_LSE", ("lse",),
            families=FORWARD_FAMILIES, backward_families=()),
    # a packed variable-length batch (cu_seqlens_q/k): a block -> (sequence, query tile) table
    # (the backward's dK/dV kernel: (sequence, key tile)) and per-sequence lengths, diagonals
    # and first rows (cuonline/kernels/varlen.py); no key split
    Feature("varlen", lambda p: getattr(p, "cu_seqlens_q", None) is not None,
            "CUONLINE_VARLEN", ("varlen_tiles", "varlen_seqs", "varlen_n_tiles"),
            families=FORWARD_FAMILIES),
)

#: Rows that change the launch's layout rather than add a score term: listed in variants of
#: their own, not in the listing's "every option" variants.
LAYOUT_FEATURES = ("varlen",)

_BY_NAME = {f.name: f for f in FEATURES}


def by_name(name: str) -> Feature:
    """The row called ``name``; ValueError naming the known ones otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown attention feature {name!r}; known: "
                         f"{', '.join(_BY_NAME)}") from None


def supported_by(family: str) -> tuple:
    """The rows ``family`` (forward or backward) supports, in key order."""
    return tuple(f for f in FEATURES if family in f.families + f.backward_families)


def with_required(names) -> tuple:
    """``names`` and the features they require, in key order (a variant that can run)."""
    wanted = set(names)
    for name in names:
        wanted.update(by_name(name).requires)
    return tuple(f.name for f in FEATURES if f.name in wanted)


def of_problem(problem, family: str) -> tuple:
    """Names of the features ``problem`` needs, in key order; ValueError when ``family`` does
    not support one of them (the dispatcher picks only families that do)."""
    names = tuple(f.name for f in FEATURES if f.of_problem(problem))
    missing = [n for n in names if family not in _BY_NAME[n].families]
    if missing:
        raise ValueError(f"kernel family {family!r} does not support {', '.join(missing)}")
    return names


# --------------------------------------------------------------------------------------------
# the attention backward (issue 13)

#: The rows of :data:`FEATURES` whose gradients the backward kernels give (the SIMT backward
#: supports every one the backward has; not return_lse, an input of the backward), from the
#: table's ``families``.
BACKWARD_FEATURES = tuple(f.name for f in supported_by(BACKWARD_FAMILIES[0]))
#: Those the tensor-core backward (``attention_bwd_mma``) compiles in; a call with another one
#: (the soft cap of the whole logit) runs on ``attention_bwd_simt``.
MMA_BACKWARD_FEATURES = tuple(f.name for f in supported_by(BACKWARD_FAMILIES[1]))


def backward_of_problem(problem) -> tuple:
    """Names of the features a backward call of ``problem`` needs, in key order (never
    ``return_lse``); ValueError naming those the backward kernels do not support."""
    names = tuple(f.name for f in FEATURES if f.name != "return_lse" and f.of_problem(problem))
    missing = [n for n in names if n not in BACKWARD_FEATURES]
    if missing:
        raise ValueError(f"the CUDA engine's attention backward (kernel family "
                         f"{BACKWARD_FAMILIES[0]!r}) does not support {', '.join(missing)} yet; "
                         f"use backend='numpy' for these gradients")
    return names


# --------------------------------------------------------------------------------------------
# the statistics of the attention weights (issue 21)

__all__ += ["STATS_FAMILIES", "stats_of_problem"]


def stats_of_problem(problem) -> tuple:
    """Names of the features the statistics kernels need for the score options of
    ``problem`` (the :class:`cuonline._validate.Problem` of a ``StatsProblem``), in key order;
    ValueError naming those the family does not support."""
    names = tuple(f.name for f in FEATURES if f.name != "return_lse" and f.of_problem(problem))
    missing = [n for n in names if STATS_FAMILIES[0] not in _BY_NAME[n].families]
    if missing:
        raise ValueError(f"the CUDA engine's attention_stats (kernel family "
                         f"{STATS_FAMILIES[0]!r}) does not support {', '.join(missing)} yet; "
                         f"use backend='numpy'")
    return names
