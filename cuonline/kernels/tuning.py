"""``python -m cuonline tune``: the pure parts (CPU-testable, no CuPy, no files).

1. :func:`candidates`: the tile configurations worth measuring for one (arch, dtype, D bucket)
   and kernel family, each within the shared-memory and register budgets that
   :mod:`cuonline.kernels.heuristics` enforces for its own choices, the built-in one included.
2. The stored document: :func:`winners_from_document` turns one into the table that
   :func:`cuonline.kernels.heuristics.tuned_tiles` reads (refusing anything that is not a
   candidate of this version), :func:`merge_documents` merges a new one into an old one.

The measuring on a GPU (:mod:`cuonline.engines.tune`) and the files, one per (GPU name,
compute capability, cuonline version) in the cache directory
(:mod:`cuonline.engines.tuning_files`), live on the engine side.

A tile tuple is :class:`~cuonline.kernels.heuristics.MmaTiles` ``(warps, block_n, stages,
m_tiles)`` for the tensor-core family (``attention_fwd_mma``) and ``(warps, rows_per_warp,
keys_per_lane)`` for the SIMT family (``attention_fwd_simt``). Winners are keyed by
``(family, dtype, D bucket)``: the bucket is the smallest of 32, 64, 128, 256 that holds
max(D, Dv), as in the built-in table, and candidates are checked at the bucket's full width, so
a winner fits every narrower head too.
"""

from __future__ import annotations

import itertools
import math

from . import families, heuristics
from .specs import MMA_MAX_HEAD_DIM, AttentionMmaSpec, AttentionSimtSpec, acc_name, dtype_name

__all__ = ["AGREEMENT", "DTYPES", "FAMILIES", "FORMAT", "LADDERS", "MMA_REGISTER_WORDS",
           "QUICK_SHAPE", "SHAPE", "builtin_tiles", "candidates", "default_family",
           "merge_documents", "mma_register_words", "spec_of", "targets",
           "winners_from_document"]

#: Version of the JSON document's layout (2: the families are named attention_fwd_simt and
#: attention_fwd_mma).
FORMAT = 2
SIMT = AttentionSimtSpec.family
MMA = AttentionMmaSpec.family
#: The families tune measures: the attention forward families of the registry.
FAMILIES = tuple(f.name for f in families.forward_families())
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Registers (32-bit words) per lane that a tensor-core candidate may tie up in fragments: see
#: :func:`mma_register_words`. The largest built-in tiles need 144; 160 spilled
#: (docs/kernels.md, "Tile tables").
MMA_REGISTER_WORDS = 144
#: Values tried per tile parameter: (warps, block_n, stages, m_tiles) and (warps,
#: rows_per_warp, keys_per_lane). A full tune measures their product (within the budgets), a
#: quick one the built-in choice and its neighbours along one ladder at a time.
LADDERS = {MMA: ((2, 4, 8), (16, 32, 64, 128), (1, 2), (1, 2)),
           SIMT: ((4, 8), (2, 4, 8), (1, 2))}
#: Shape measured per candidate: ``(keys = queries, batch x heads, causal cases, runs)``.
SHAPE = {"n": 4096, "nbatch": 16, "causal": (False, True), "repeats": 5}
QUICK_SHAPE = {"n": 2048, "nbatch": 16, "causal": (False,), "repeats": 3}
#: Largest |candidate - built-in| allowed: twice the tests' tolerance against the exact result
#: (tests/conftest.py), since both are within it.
AGREEMENT = {"float16": 8e-3, "bfloat16": 6e-2, "tf32": 8e-3, "float32": 4e-5, "float64": 2e-12}


# --------------------------------------------------------------------------------------------
# candidates (pure)


def _table_arch(arch: str) -> str:
    # As choose_mma_tiles: an arch without a table of its own takes the default one.
    return arch if arch in heuristics.SMEM_OPT_IN_LIMIT else heuristics.DEFAULT_ARCH


def default_family(dtype, d, arch=heuristics.DEFAULT_ARCH) -> str:
    """The family the dispatcher runs on ``arch`` for ``dtype`` and head width ``d`` by
    default (``precision="highest"``): below sm_80, the SIMT family for every dtype."""
    return families.select_forward(dtype_name(dtype), d, d, "highest", arch).name


def targets(dtype, d, arch=heuristics.DEFAULT_ARCH) -> list:
    """``(family, precision)`` pairs that serve ``dtype`` at head width ``d`` on ``arch``: the
    default family, plus TF32 tensor cores for float32 (``precision="tf32"``) where the arch
    has them."""
    name = dtype_name(dtype)
    out = [(default_family(name, d, arch), "highest")]
    if name == "float32":
        tf32 = families.select_forward(name, d, d, "tf32", arch).name
        if tf32 != out[0][0]:
            out.append((tf32, "tf32"))
    return out


def spec_of(family, dtype, d, tiles, **flags):
    """The kernel spec of ``tiles`` at D = Dv = ``d`` (the candidate's key, shared memory);
    ``flags``: ``features=``, ``split=`` of :class:`~cuonline.kernels.specs.AttentionSpec`."""
    name = dtype_name(dtype)
    if family == MMA:
        return AttentionMmaSpec(dtype=name, d=d, dv=d, **heuristics.MmaTiles(*tiles)._asdict(),
                                **flags)
    warps, rows, keys = tiles
    return AttentionSimtSpec(dtype=name, acc=acc_name(name), d=d, dv=d, warps=warps,
                             rows_per_warp=rows, keys_per_lane=keys, **flags)


def builtin_tiles(arch, family, dtype, d, *, n=SHAPE["n"], nbatch=SHAPE["nbatch"]) -> tuple:
    """The heuristics' own choice for the measured shape on ``arch`` (no stored winners)."""
    name, bucket = dtype_name(dtype), heuristics.d_bucket(d)
    if family == MMA:
        return heuristics.choose_mma_tiles(name, bucket, bucket, n, arch)
    return heuristics.choose_tiles(name, bucket, bucket, n, nbatch, arch=arch)


def mma_register_words(spec) -> int:
    """Registers per lane that an :class:`~cuonline.kernels.specs.AttentionMmaSpec` holds in
    fragments.

    Per 16-row query tile of a warp (``m_tiles`` of them): the O accumulator (16 rows x Dv / 32
    lanes) and the score accumulator (16 x block_n / 32), both twice for float64; and the Q
    fragments when attention_fwd_mma.cu keeps them in registers (``kQInRegs``: 4 words per k-step
    and query tile, when that is at most 32 words). Addresses, the softmax state and the option
    arguments come on top: ptxas's count is this plus 60 to 110.
    """
    k = int(spec.instruction.split(".")[3].split("k")[1])     # m16n8k16 -> 16
    words = spec.acc_itemsize // 4
    dp, dvp = spec.padded_dims
    q_words = spec.m_tiles * (dp // k) * 4
    return (spec.m_tiles * (dvp // 2 + spec.block_n // 2) * words
            + (q_words if q_words <= 32 else 0))


def _fits(arch, family, dtype, d, tiles, smem_limit) -> bool:
    """Whether ``tiles`` keeps the budgets the heuristics keep, at head width ``d``."""
    name = dtype_name(dtype)
    try:
        spec = spec_of(family, name, d, tiles)
    except ValueError:
        return False
    if family == MMA:
        # Registers: see MMA_REGISTER_WORDS. A second f64 stage needs 32 words of headroom
        # (docs/kernels.md, "Tile tables").
        # Shared memory: this arch's opt-in limit (or the device's, if lower).
        need = mma_register_words(spec)
        if name == "float64" and spec.stages == 2:
            need += 32
        if need > MMA_REGISTER_WORDS:
            return False
        return spec.shared_bytes <= smem_limit
    warps, rows, keys = tiles
    words = spec.acc_itemsize // 4
    cols = math.ceil(d / 32)
    # choose_tiles's rules: the O accumulator within ACC_REGISTER_BUDGET, the scores within 16
    # registers, the block within SMEM_MAX (two blocks per sm_80 SM) and the arch's limit.
    return (rows * cols * words <= heuristics.ACC_REGISTER_BUDGET
            and rows * keys * words <= 16
            and spec.shared_bytes <= min(heuristics.simt_smem_limit(arch), smem_limit))


def candidates(arch, dtype, d, family=None, *, quick=False, smem_limit=None) -> list:
    """Tile configurations worth measuring for ``(arch, dtype, D bucket of d)``.

    Parameters
    ----------
    arch : str
        ``"sm_80"``, ``"sm_90"`` (other archs use the sm_90 table and limits, as the
        heuristics do).
    dtype : str or dtype
        Element dtype.
    d : int
        Head width max(D, Dv); candidates are checked at its bucket's full width.
    family : str, optional
        ``"attention_fwd_mma"`` or ``"attention_fwd_simt"``; default: the family the
        dispatcher runs on ``arch``
        (:func:`default_family`).
    quick : bool
        Only the built-in choice and its neighbours one step away in one parameter.
    smem_limit : int, optional
        Dynamic shared memory a block may use on the device (default: the arch's opt-in limit).

    Returns
    -------
    list of tuple
        The built-in choice first, then the others in a fixed order;
        :class:`~cuonline.kernels.heuristics.MmaTiles` ``(warps, block_n, stages, m_tiles)``
        for ``attention_fwd_mma``, ``(warps, rows_per_warp, keys_per_lane)`` for
        ``attention_fwd_simt``.

    Notes
    -----
    Tensor cores: warps in {2, 4, 8}, key tiles of 16 to 128 keys, one or two stages, one or
    two 16-row query tiles per warp; the fragments within :data:`MMA_REGISTER_WORDS`
    (:func:`mma_register_words`) and shared memory within the opt-in limit. SIMT: 4 or 8 warps,
    2 to 8 rows per warp, 1 or 2 keys per lane, within the register and shared budgets of
    :func:`~cuonline.kernels.heuristics.choose_tiles`.

    Examples
    --------
    >>> from cuonline.kernels.tuning import candidates
    >>> [tuple(tiles) for tiles in candidates("sm_90", "float16", 64, quick=True)]
    [(4, 32, 2, 2), (2, 32, 2, 2), (8, 32, 2, 2), (4, 16, 2, 2), (4, 32, 1, 2), (4, 32, 2, 1)]
    """
    name = dtype_name(dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    bucket = heuristics.d_bucket(d)
    family = family or default_family(name, bucket, arch)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if family == MMA and (bucket > MMA_MAX_HEAD_DIM[name] or not heuristics.mma_supported(arch)):
        return []
    if family == MMA:
        arch = _table_arch(arch)
    limit = heuristics.SMEM_OPT_IN_LIMIT.get(arch) or heuristics.simt_smem_limit(arch)
    limit = limit if smem_limit is None else min(limit, smem_limit)
    builtin = builtin_tiles(arch, family, name, bucket)
    ladders = LADDERS[family]
    if quick:
        grid = _neighbours(builtin, ladders)
    else:
        grid = itertools.product(*ladders)
    if family == MMA:
        grid = [heuristics.MmaTiles(*tiles) for tiles in grid]
    out = [builtin]
    for tiles in grid:
        if tiles not in out and min(tiles) >= 1 and _fits(arch, family, name, bucket, tiles,
                                                          limit):
            out.append(tiles)
    return out


def _neighbours(builtin, ladders):
    """Tiles one step away from ``builtin`` along one parameter's ladder."""
    out = []
    for i, ladder in enumerate(ladders):
        values = sorted(set(ladder) | {builtin[i]})
        j = values.index(builtin[i])
        for other in (j - 1, j + 1):
            if 0 <= other < len(values):
                tiles = list(builtin)
                tiles[i] = values[other]
                out.append(tuple(tiles))
    return out


# --------------------------------------------------------------------------------------------
# stored documents (pure: the files are read and written by cuonline.engines.tuning_files)


def winners_from_document(doc, *, gpu: str, arch: str, version: str) -> dict:
    """The winners table of one stored document: ``{(family, dtype, bucket): tiles}``.

    Raises ValueError, naming the problem, when the document is not of this format, this
    cuonline version, this GPU and arch, or when an entry's tiles are not among this version's
    :func:`candidates` (so only configurations within the budgets ever run).
    """
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    for field, expected in (("format", FORMAT), ("cuonline", version), ("gpu", gpu),
                            ("arch", arch)):
        if doc.get(field) != expected:
            raise ValueError(f"{field} is {doc.get(field)!r}, expected {expected!r}")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise ValueError("'entries' must be a list")
    table = {}
    for entry in entries:
        try:
            family, dtype, d = entry["family"], entry["dtype"], entry["d"]
            tiles = tuple(entry["tiles"])
            allowed = (family in FAMILIES and dtype in DTYPES and d in heuristics.D_BUCKETS
                       and tiles in candidates(arch, dtype, d, family))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed entry {entry!r}: {exc}") from None
        if not allowed:
            raise ValueError(f"entry {family}/{dtype}/d{d} has tiles {list(tiles)}, not a "
                             f"candidate of this version")
        table[(family, dtype, d)] = tiles
    return table


def merge_documents(old, new) -> dict:
    """``new`` with the entries of ``old`` (same GPU and version) that it does not replace."""
    keys = {(e["family"], e["dtype"], e["d"]) for e in new["entries"]}
    kept = [e for e in (old or {}).get("entries", [])
            if (e["family"], e["dtype"], e["d"]) not in keys]
    return dict(new, entries=kept + list(new["entries"]))
