"""``python -m cuonline tune``: measure tile candidates on the GPU at hand, store the winners.

Four parts, the first, third and fourth of them pure or file-only (CPU-testable):

1. :func:`candidates`: the tile configurations worth measuring for one (arch, dtype, D bucket)
   and kernel family, each within the shared-memory and register budgets that
   :mod:`cuonline.kernels.heuristics` enforces for its own choices, the built-in one included.
2. :func:`measure`: on the current CuPy device, runs :func:`cuonline.engines.cuda.attention`
   with each candidate forced (its ``tuned`` seam), times it with CUDA events (warm-up, median
   of a few runs) on N = 4096 keys and queries, 16 batch x heads, causal off and on, checks its
   output against the built-in tiles' output, and keeps the fastest. A candidate that fails to
   compile, launch or agree, or that spills, is recorded and skipped.
3. Storage: one JSON document per (GPU name, compute capability, cuonline version) in
   ``$CUONLINE_CACHE_DIR/tuning/`` (default ``~/.cache/cuonline/tuning/``, or under
   ``$XDG_CACHE_HOME``), written atomically (temporary file + ``os.replace``).
4. Lookup: :func:`winners_from_document` turns a document into the table that
   :func:`cuonline.kernels.heuristics.tuned_tiles` reads; :func:`current_device_winners` loads
   the current GPU's file once per process (never at ``import cuonline``). A corrupt file, or
   one written by another cuonline version or for another GPU, is ignored with a warning.

A tile tuple is :class:`~cuonline.kernels.heuristics.MmaTiles` ``(warps, block_n, stages,
m_tiles)`` for the tensor-core family (``attention_mma``) and ``(warps, rows_per_warp,
keys_per_lane)`` for the SIMT family (``attention_fwd``). Winners are
keyed by ``(family, dtype, D bucket)``: the bucket is the smallest of 32, 64, 128, 256 that
holds max(D, Dv), as in the built-in table, and candidates are checked at the bucket's full
width, so a winner fits every narrower head too.

Nothing here imports CuPy at module level.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from . import heuristics
from .specs import MMA_MAX_HEAD_DIM, KernelSpec, MmaSpec

__all__ = ["FORMAT", "MMA_REGISTER_WORDS", "builtin_tiles", "candidates", "clear_cache",
           "current_device_winners", "default_family", "device_identity", "load_winners",
           "measure", "merge_documents", "mma_register_words", "spec_of", "store", "targets",
           "tuning_dir", "tuning_path", "winners_from_document"]

#: Version of the JSON document's layout.
FORMAT = 1
FAMILIES = ("attention_mma", "attention_fwd")
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Registers (32-bit words) per lane that a tensor-core candidate may tie up in fragments: see
#: :func:`mma_register_words`. The largest built-in tiles (f16 and tf32 at D = 256, f64 at
#: D = 128) come to 144 and compile without spills; 160 spilled in some variants: f16 at
#: D = 128 with 128-key tiles (with every option on; sm_80 already with the causal window
#: alone), and two query tiles per warp of 64 keys at D = 64 (every option on) or of 32 keys
#: at D = 128 (sm_80 with a window, sm_90 with the element-wise loader).
MMA_REGISTER_WORDS = 144
#: Values tried per tile parameter: (warps, block_n, stages, m_tiles) and (warps,
#: rows_per_warp, keys_per_lane). A full tune measures their product (within the budgets), a
#: quick one the built-in choice and its neighbours along one ladder at a time.
LADDERS = {"attention_mma": ((2, 4, 8), (16, 32, 64, 128), (1, 2), (1, 2)),
           "attention_fwd": ((4, 8), (2, 4, 8), (1, 2))}
#: Shape measured per candidate: ``(keys = queries, batch x heads, causal cases, runs)``.
SHAPE = {"n": 4096, "nbatch": 16, "causal": (False, True), "repeats": 5}
QUICK_SHAPE = {"n": 2048, "nbatch": 16, "causal": (False,), "repeats": 3}
#: Largest |candidate - built-in| allowed: twice the tests' tolerance against the exact result
#: (tests/conftest.py), since both are within it.
AGREEMENT = {"float16": 8e-3, "bfloat16": 6e-2, "tf32": 8e-3, "float32": 4e-5, "float64": 2e-12}


# --------------------------------------------------------------------------------------------
# candidates (pure)


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def _table_arch(arch: str) -> str:
    # As choose_mma_tiles: an arch without a table of its own takes the default one.
    return arch if arch in heuristics.SMEM_OPT_IN_LIMIT else heuristics.DEFAULT_ARCH


def default_family(dtype, d) -> str:
    """The family the dispatcher runs for ``dtype`` and head width ``d`` by default
    (``precision="highest"``)."""
    return "attention_mma" if heuristics.uses_mma(_name(dtype), d, d) else "attention_fwd"


def targets(dtype, d) -> list:
    """``(family, precision)`` pairs that serve ``dtype`` at head width ``d``: the default
    family, plus TF32 tensor cores for float32 (``precision="tf32"``)."""
    name = _name(dtype)
    out = [(default_family(name, d), "highest")]
    if name == "float32" and heuristics.uses_mma(name, d, d, "tf32"):
        out.append(("attention_mma", "tf32"))
    return out


def spec_of(family, dtype, d, tiles, **flags):
    """The kernel spec of ``tiles`` at D = Dv = ``d`` (the candidate's key, shared memory)."""
    name = _name(dtype)
    if family == "attention_mma":
        return MmaSpec(dtype=name, d=d, dv=d, **heuristics.MmaTiles(*tiles)._asdict(), **flags)
    warps, rows, keys = tiles
    return KernelSpec(dtype=name, acc="float64" if name == "float64" else "float32", d=d, dv=d,
                      warps=warps, rows_per_warp=rows, keys_per_lane=keys, **flags)


def builtin_tiles(arch, family, dtype, d, *, n=SHAPE["n"], nbatch=SHAPE["nbatch"]) -> tuple:
    """The heuristics' own choice for the measured shape (no stored winners)."""
    name, bucket = _name(dtype), heuristics.d_bucket(d)
    if family == "attention_mma":
        return heuristics.choose_mma_tiles(name, bucket, bucket, n, arch)
    return heuristics.choose_tiles(name, bucket, bucket, n, nbatch)


def mma_register_words(spec) -> int:
    """Registers per lane that an :class:`~cuonline.kernels.specs.MmaSpec` holds in fragments.

    Per 16-row query tile of a warp (``m_tiles`` of them): the O accumulator (16 rows x Dv / 32
    lanes) and the score accumulator (16 x block_n / 32), both twice for float64; and the Q
    fragments when attention_mma.cu keeps them in registers (``kQInRegs``: 4 words per k-step
    and query tile, when that is at most 32 words). Addresses, the softmax state and the option
    arguments come on top: ptxas's count is this plus 60 to 110.
    """
    k = int(spec.instruction.split(".")[3].split("k")[1])     # m16n8k16 -> 16
    words = 2 if spec.dtype == "float64" else 1
    dp, dvp = spec.padded_dims
    q_words = spec.m_tiles * (dp // k) * 4
    return (spec.m_tiles * (dvp // 2 + spec.block_n // 2) * words
            + (q_words if q_words <= 32 else 0))


def _fits(arch, family, dtype, d, tiles, smem_limit) -> bool:
    """Whether ``tiles`` keeps the budgets the heuristics keep, at head width ``d``."""
    name = _name(dtype)
    try:
        spec = spec_of(family, name, d, tiles)
    except ValueError:
        return False
    if family == "attention_mma":
        # Registers: see MMA_REGISTER_WORDS. A second f64 stage needs 32 words of headroom:
        # sm_90's ptxas spilled f64 at two stages with 128 words (D = 64, 64-key tiles) and 144
        # (D = 128, 16-key tiles; the built-in table entry says why).
        # Shared memory: this arch's opt-in limit (or the device's, if lower).
        need = mma_register_words(spec)
        if name == "float64" and spec.stages == 2:
            need += 32
        if need > MMA_REGISTER_WORDS:
            return False
        return spec.shared_bytes <= smem_limit
    warps, rows, keys = tiles
    words = 2 if name == "float64" else 1
    cols = math.ceil(d / 32)
    # choose_tiles's rules: the O accumulator within ACC_REGISTER_BUDGET, the scores within 16
    # registers, the block within SMEM_MAX (two blocks per sm_80 SM).
    return (rows * cols * words <= heuristics.ACC_REGISTER_BUDGET
            and rows * keys * words <= 16
            and spec.shared_bytes <= min(heuristics.SMEM_MAX, smem_limit))


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
        ``"attention_mma"`` or ``"attention_fwd"``; default: the family the dispatcher runs
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
        for ``attention_mma``, ``(warps, rows_per_warp, keys_per_lane)`` for ``attention_fwd``.

    Notes
    -----
    Tensor cores: warps in {2, 4, 8}, key tiles of 16 to 128 keys, one or two stages, one or
    two 16-row query tiles per warp; the fragments within :data:`MMA_REGISTER_WORDS`
    (:func:`mma_register_words`) and shared memory within the opt-in limit. SIMT: 4 or 8 warps, 2 to 8 rows per warp, 1 or 2
    keys per lane, within the register and shared budgets of
    :func:`~cuonline.kernels.heuristics.choose_tiles`.

    Examples
    --------
    >>> from cuonline.kernels.tuning import candidates
    >>> [tuple(tiles) for tiles in candidates("sm_90", "float16", 64, quick=True)]
    [(4, 32, 2, 2), (2, 32, 2, 2), (8, 32, 2, 2), (4, 16, 2, 2), (4, 32, 1, 2), (4, 32, 2, 1)]
    """
    name = _name(dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    bucket = heuristics.d_bucket(d)
    family = family or default_family(name, bucket)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if family == "attention_mma" and bucket > MMA_MAX_HEAD_DIM[name]:
        return []
    arch = _table_arch(arch)
    limit = heuristics.SMEM_OPT_IN_LIMIT[arch]
    limit = limit if smem_limit is None else min(limit, smem_limit)
    builtin = builtin_tiles(arch, family, name, bucket)
    ladders = LADDERS[family]
    if quick:
        grid = _neighbours(builtin, ladders)
    else:
        grid = itertools.product(*ladders)
    if family == "attention_mma":
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
# storage (files only)


def tuning_dir() -> Path:
    """``$CUONLINE_CACHE_DIR/tuning``, else ``$XDG_CACHE_HOME/cuonline/tuning``, else
    ``~/.cache/cuonline/tuning``: the cache rule of :func:`cuonline._environment.cache_root`,
    which raises ValueError for a bad ``CUONLINE_CACHE_DIR``."""
    from .. import _environment  # noqa: PLC0415

    return _environment.cache_dir("tuning")


def _version() -> str:
    import cuonline  # noqa: PLC0415 - this module is imported while cuonline initialises

    return cuonline.__version__


def tuning_path(gpu: str, arch: str, version: str | None = None) -> Path:
    """The file of one (GPU name, arch, cuonline version), e.g.
    ``nvidia-h200_sm_90_cuonline-0.1.0.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return tuning_dir() / f"{slug}_{arch}_cuonline-{version or _version()}.json"


def winners_from_document(doc, *, gpu: str, arch: str, version: str | None = None) -> dict:
    """The winners table of one stored document: ``{(family, dtype, bucket): tiles}``.

    Raises ValueError, naming the problem, when the document is not of this format, this
    cuonline version, this GPU and arch, or when an entry's tiles are not among this version's
    :func:`candidates` (so only configurations within the budgets ever run).
    """
    version = version or _version()
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


def load_winners(path, *, gpu: str, arch: str, version: str | None = None) -> dict:
    """Read ``path`` into a winners table; ``{}`` when it does not exist. A corrupt, foreign or
    invalid file gives ``{}`` and a RuntimeWarning, never an exception."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"cuonline: ignoring tuning file {path}: {exc}", RuntimeWarning,
                      stacklevel=2)
        return {}
    try:
        return winners_from_document(json.loads(text), gpu=gpu, arch=arch, version=version)
    except ValueError as exc:   # json.JSONDecodeError is a ValueError
        warnings.warn(f"cuonline: ignoring tuning file {path} (built-in tiles used): {exc}",
                      RuntimeWarning, stacklevel=2)
        return {}


def merge_documents(old, new) -> dict:
    """``new`` with the entries of ``old`` (same GPU and version) that it does not replace."""
    keys = {(e["family"], e["dtype"], e["d"]) for e in new["entries"]}
    kept = [e for e in (old or {}).get("entries", [])
            if (e["family"], e["dtype"], e["d"]) not in keys]
    return dict(new, entries=kept + list(new["entries"]))


def store(doc, path=None) -> Path:
    """Write ``doc`` atomically, merged with the valid document already at ``path`` (default:
    :func:`tuning_path` of ``doc``'s GPU, arch and version); return the path."""
    path = Path(path or tuning_path(doc["gpu"], doc["arch"], doc["cuonline"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        winners_from_document(old, gpu=doc["gpu"], arch=doc["arch"], version=doc["cuonline"])
    except (OSError, ValueError):
        old = None     # missing or unusable: replaced
    doc = merge_documents(old, doc)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)    # readers see the old file or the new one, never a torn one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    clear_cache()
    return path


_cache = {}
_cache_lock = threading.Lock()


def clear_cache():
    """Forget the tables loaded by :func:`current_device_winners` (after a new ``tune``)."""
    with _cache_lock:
        _cache.clear()


def device_identity(device_id=None) -> tuple:
    """``(GPU name, "sm_XY")`` of a CuPy device (default: the current one)."""
    import cupy  # noqa: PLC0415

    device = cupy.cuda.Device(device_id)
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return name, f"sm_{device.compute_capability}"


def current_device_winners() -> dict:
    """The stored winners for the current CuPy device, loaded once per process and device."""
    import cupy  # noqa: PLC0415

    device_id = cupy.cuda.Device().id
    with _cache_lock:
        if device_id in _cache:
            return _cache[device_id]
    try:
        gpu, arch = device_identity(device_id)
    except Exception:  # noqa: BLE001 - no identity, no winners: the built-in tiles
        table = {}
    else:
        table = load_winners(tuning_path(gpu, arch), gpu=gpu, arch=arch)
    with _cache_lock:
        _cache[device_id] = table
    return table


# --------------------------------------------------------------------------------------------
# measuring (a CUDA GPU)


def _time_ms(fn, repeats):
    """Median milliseconds of ``fn()`` between two CUDA events, after two warm-up calls (the
    first compiles)."""
    import cupy  # noqa: PLC0415

    for _ in range(2):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def _inputs(dtype, d, n, nbatch, seed=0):
    """q, k, v as CuPy arrays ``(nbatch, n, d)`` drawn from N(0, 1) (on the host: bfloat16
    goes through ml_dtypes)."""
    import cupy  # noqa: PLC0415

    if dtype == "bfloat16":
        import ml_dtypes  # noqa: PLC0415

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    return tuple(cupy.asarray(rng.standard_normal((nbatch, n, d), dtype=np.float32).astype(dt))
                 for _ in range(3))


def _kernel_usage(cuda, problem, family, arch, num_sms, tuned):
    """``(registers, local memory bytes)`` per thread of the forward kernel that the engine
    compiled for ``problem`` with ``tuned`` (CuPy reads them from the loaded module)."""
    plan = heuristics.plan_attention(problem, num_sms=num_sms, arch=arch, family=family,
                                     cp_async=cuda.cp_async_aligned(problem), tuned=tuned)
    kernel = cuda._module(plan.spec, "cupy", None, None).get_function(plan.spec.entry)
    return int(kernel.num_regs), int(kernel.local_size_bytes)


def measure(dtypes=("float16", "bfloat16", "float32", "float64"), dims=(64, 128), *,
            quick=False, progress=None) -> dict:
    """Time every candidate on the current CuPy device; return the document :func:`store`
    writes.

    For each dtype, each D bucket of ``dims`` and each family that serves them
    (:func:`targets`), every candidate runs through
    :func:`cuonline.engines.cuda.attention` with its tiles forced (``tuned=``), on q, k, v of
    shape ``(16, N, D)`` with N = 4096 (``quick``: 2048, non-causal only, the built-in's
    neighbours only), causal off and on; its time is the median of a few runs between CUDA
    events, summed over the causal cases. A candidate whose output differs from the built-in
    tiles' by more than :data:`AGREEMENT`, whose kernel uses local memory (spills: CuPy reports
    the compiled kernel's registers and local bytes), or that fails to compile or launch, is
    recorded with its error and skipped. ``progress`` (a callable taking a line) reports each
    measurement.
    """
    import cupy  # noqa: PLC0415

    from .._validate import validate_attention  # noqa: PLC0415
    from ..engines import cuda  # noqa: PLC0415

    say = progress or (lambda line: None)
    shape = QUICK_SHAPE if quick else SHAPE
    gpu, arch = device_identity()
    device = cupy.cuda.Device()
    num_sms = int(device.attributes["MultiProcessorCount"])
    smem_limit = int(device.attributes.get("MaxSharedMemoryPerBlockOptin", 0)) or None
    entries = []
    for dtype in dtypes:
        for bucket in sorted({heuristics.d_bucket(d) for d in dims}):
            for family, precision in targets(dtype, bucket):
                entry = _measure_one(cuda, validate_attention, family, precision, dtype,
                                     bucket, arch, num_sms, smem_limit, shape, quick, say)
                if entry is not None:
                    entries.append(entry)
    return {"format": FORMAT, "cuonline": _version(), "gpu": gpu, "arch": arch,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "entries": entries}


def _measure_one(cuda, validate_attention, family, precision, dtype, bucket, arch, num_sms,
                 smem_limit, shape, quick, say):
    label = f"{family}/{'tf32' if precision == 'tf32' else dtype}/d{bucket}"
    tiles_list = candidates(arch, dtype, bucket, family, quick=quick, smem_limit=smem_limit)
    try:
        q, k, v = _inputs(dtype, bucket, shape["n"], shape["nbatch"])
        problems = [validate_attention(q, k, v, scale=None, causal=causal, window=None,
                                       bias=None, mask=None, kv_lengths=None,
                                       alibi_slopes=None, softcap=None, return_lse=False,
                                       backend="cupy", precision=precision)
                    for causal in shape["causal"]]
    except Exception as exc:  # noqa: BLE001 - e.g. bfloat16 without ml_dtypes: skip the key
        say(f"{label}: skipped ({type(exc).__name__}: {exc})")
        return None
    tolerance = AGREEMENT["tf32" if precision == "tf32" else dtype]
    reference, results = None, []
    for tiles in tiles_list:
        key = (family, dtype, bucket)
        table = {key: tiles}
        row = {"tiles": list(tiles), "key": spec_of(family, dtype, bucket, tiles).key,
               "ms": None, "registers": None, "error": None}
        try:
            run = [lambda p=p: cuda.attention(p, family=family, arch=arch, num_sms=num_sms,
                                              tuned=table)[0] for p in problems]
            out = run[0]()
            if reference is None:
                reference = out         # the built-in tiles' output (listed first)
            diff = float(abs(out.astype("float64") - reference.astype("float64")).max())
            if not diff <= tolerance:
                raise ValueError(f"output differs from the built-in tiles' by {diff:.3g} "
                                 f"(allowed {tolerance:g})")
            usage = [_kernel_usage(cuda, p, family, arch, num_sms, table) for p in problems]
            row["registers"] = max(regs for regs, _ in usage)
            local = max(nbytes for _, nbytes in usage)
            if local:
                # spills (or a stack frame) go to local memory: not a configuration to keep
                raise ValueError(f"uses {local} bytes of local memory per thread (spills)")
            row["ms"] = round(sum(_time_ms(fn, shape["repeats"]) for fn in run), 4)
        except Exception as exc:  # noqa: BLE001 - compile, launch or agreement: record, skip
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        results.append(row)
        say(f"{label} {row['key']}: " + (f"{row['ms']:.3f} ms" if row["error"] is None
                                        else f"failed ({row['error']})"))
    timed = [r for r in results if r["error"] is None]
    if not timed:
        return None
    best = min(timed, key=lambda r: r["ms"])
    return {"family": family, "dtype": dtype, "d": bucket, "precision": precision,
            "tiles": best["tiles"], "builtin": list(tiles_list[0]),
            "shape": {"n": shape["n"], "nbatch": shape["nbatch"],
                      "causal": list(shape["causal"]), "repeats": shape["repeats"]},
            "results": results}
