"""Command line: ``python -m cuonline {demo, info, kernels, tune}``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import platform
import sys
import time
import warnings

import numpy as np

import cuonline


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuonline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="genomics-flavoured attention on the best engine here")
    demo.add_argument("--length", type=_positive_int, default=2048,
                      help="sequence length (default 2048)")
    demo.add_argument("--heads", type=_positive_int, default=4, help="attention heads (default 4)")
    demo.add_argument("--seed", type=int, default=0)
    commands.add_parser("info", help="versions and the engines available here")
    kernels = commands.add_parser("kernels", help="NVRTC listing of every CUDA specialisation")
    kernels.add_argument("--arch", default="sm_90", help="target, e.g. sm_80 or sm_90")
    kernels.add_argument("--json", action="store_true", help="machine-readable output")
    tune = commands.add_parser(
        "tune", help="time tile candidates on this GPU; later runs use the fastest",
        description="Time each tile candidate of the attention kernels on the current CUDA GPU "
                    "and store the fastest per (dtype, D) in the user's cache directory "
                    "($CUONLINE_CACHE_DIR/tuning or ~/.cache/cuonline/tuning), where later "
                    "runs on this GPU and cuonline version find them.")
    tune.add_argument("--dtypes", type=_dtype_list, default=_dtype_list(",".join(_TUNE_DTYPES)),
                      help="comma-separated element dtypes (default: all four; float32 tunes "
                           "both the exact SIMT kernels and precision='tf32')")
    tune.add_argument("--dims", type=_dim_list, default=(64, 128),
                      help="comma-separated head dims, tuned per bucket 32/64/128/256 "
                           "(default 64,128)")
    tune.add_argument("--quick", action="store_true",
                      help="built-in tiles and their neighbours only, N=2048, non-causal")
    tune.add_argument("--dry-run", action="store_true",
                      help="list the candidates and exit (no GPU needed)")
    tune.add_argument("--arch", default=None,
                      help="with --dry-run: target (default: this GPU's, else sm_90)")
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    return {"demo": run_demo, "info": run_info, "kernels": run_kernels,
            "tune": run_tune}[args.command](args)


# --------------------------------------------------------------------------------------------
# demo


def run_demo(args) -> int:
    """Random DNA -> one-hot -> embeddings -> causal attention with a relative-position bias."""
    xp, engine = _best_engine()
    rng = np.random.default_rng(args.seed)
    length, heads, d = args.length, args.heads, 64

    sequence = rng.choice(np.array(list("ACGT")), size=length)
    one_hot = (sequence[:, None] == np.array(list("ACGT"))[None, :]).astype(np.float32)
    # embed each base with its neighbours (a width-9 convolution as one matmul), then project
    # to queries, keys and values per head
    window = np.lib.stride_tricks.sliding_window_view(np.pad(one_hot, ((4, 4), (0, 0))),
                                                      9, axis=0).reshape(length, -1)
    embed = np.tanh(window @ rng.standard_normal((window.shape[1], 128), dtype=np.float32) / 6)
    proj = rng.standard_normal((3, heads, 128, d), dtype=np.float32) / 128**0.5
    q, k, v = (np.einsum("lc,hcd->hld", embed, w) for w in proj)
    # relative-position bias b(j - i), decaying with distance: rel_bias, one entry per
    # distance -(L - 1) .. L - 1, read by the engines per score (no L x L array)
    distances = np.arange(-(length - 1), length, dtype=np.float32)
    rel_bias = -np.log1p(np.abs(distances)) / 2

    q_x, k_x, v_x, rel_bias_x = (xp.asarray(a) for a in (q, k, v, rel_bias))
    # warm-up: the first call compiles (the CUDA variant of this shape, or the NumPy engine's
    # tile kernel, for which a small slice is enough), a one-time cost the timing leaves out
    w = length if xp is not np else min(length, 64)
    cuonline.attention(q_x[:, :w], k_x[:, :w], v_x[:, :w], causal=True, rel_bias=rel_bias_x)
    start = time.perf_counter()
    out = cuonline.attention(q_x, k_x, v_x, causal=True, rel_bias=rel_bias_x)
    _synchronize(xp)
    seconds = time.perf_counter() - start
    out = out.get() if hasattr(out, "get") else out

    # a dense float64 reference would be an L x L matrix per head (3.2 GB at L = 20000):
    # check a random sample of rows (always the first and the last) against one instead
    rows = _sample_rows(length, rng)
    error = max(np.abs(out[h][rows].astype(np.float64)
                       - _reference_rows(q[h], k[h], v[h], rel_bias, rows)).max()
                for h in range(heads))
    flops = 4 * heads * length * length * d / 2
    print(f"engine      : {engine}")
    print(f"input       : {length} bases of random DNA, one-hot -> {heads} heads x D={d}")
    print(f"shapes      : q, k, v {q.shape} float32; rel_bias {rel_bias.shape} "
          "(one entry per distance)")
    print("options     : causal=True, rel_bias (relative-position bias)")
    print(f"output      : {out.shape} {out.dtype}")
    print(f"time        : {seconds * 1e3:.1f} ms ({flops / seconds / 1e9:.1f} GFLOP/s)")
    checked = "every row" if len(rows) == length else f"{len(rows)} sampled rows"
    print(f"max |error| : {error:.2e} against a float64 reference ({checked} of each head)")
    return 0 if error < 1e-4 else 1


#: Rows of each head the demo checks against the float64 reference.
DEMO_CHECKED_ROWS = 256


def _sample_rows(length, rng):
    """Sorted row indices: all of them up to DEMO_CHECKED_ROWS, else a random sample of that
    many that includes the first row (sees one key) and the last (sees every key)."""
    if length <= DEMO_CHECKED_ROWS:
        return np.arange(length)
    inner = rng.choice(np.arange(1, length - 1), size=DEMO_CHECKED_ROWS - 2, replace=False)
    return np.sort(np.concatenate(([0, length - 1], inner)))


def _reference_rows(q, k, v, rel_bias, rows):
    """Float64 causal attention of one head (Lq = Lk) for the query ``rows`` only, with the
    bias of score ``(i, j)`` read densely from ``rel_bias`` at distance ``j - i``.

    Written here, not shared: the tests' oracle is not shipped, and the engines' own score
    pipeline would check itself; this is only the demo's two terms, for sampled rows."""
    s = q[rows].astype(np.float64) @ k.T.astype(np.float64) / np.sqrt(q.shape[-1])
    s += rel_bias[(k.shape[0] - 1) + np.arange(k.shape[0])[None, :] - rows[:, None]]
    s[np.arange(k.shape[0])[None, :] > rows[:, None]] = -np.inf      # causal: key j <= row
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _best_engine():
    gpu = _gpu()
    if gpu is not None:
        import cupy

        return cupy, f"cupy (CUDA kernels on {gpu})"
    from .engines.numpy import workers

    return np, f"numpy (tiled online softmax, {workers()} threads)"


def _synchronize(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _gpu():
    """Name of the current CUDA device, or None when CuPy has no usable GPU."""
    return _gpu_or_reason()[0]


def _gpu_or_reason():
    """``(name, None)`` of the current CUDA device, or ``(None, why there is none)``."""
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc})"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return props["name"].decode(), None
    except Exception as exc:  # noqa: BLE001 - no driver, no device, ...: each means "no GPU"
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


# --------------------------------------------------------------------------------------------
# info


def run_info(args) -> int:
    import scipy

    lines = {
        "cuonline": cuonline.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
    }
    # what decides the NumPy engine's speed: the compiled softmax kernels, BLAS, and the
    # library its products take
    lines["numba"] = _numba_status()
    lines.update(_blas_lines())
    lines["products"] = _products_line()
    # the optional libraries, each of the extra that brings it
    for name in ("cupy", "dask", "distributed", "zarr", "ml_dtypes"):
        lines[name] = _version_of(name)
    from .engines.numpy import workers

    engines = [f"numpy ({workers()} threads)"]
    gpu, reason = _gpu_or_reason()
    engines.append(f"cupy ({gpu})" if gpu else f"cupy: unavailable ({reason})")
    engines.append("emulate: " + (_emulation_status() or "available"))
    width = max(map(len, lines))
    for name, value in lines.items():
        print(f"{name:{width}s}: {value}")
    print(f"{'engines':{width}s}:")
    for engine in engines:
        print(f"  {engine}")
    return 0


def _version_of(module):
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "not installed"


def _numba_status():
    """numba's version and whether the NumPy engine runs its compiled kernels: it compiles
    them on first use and, where it cannot, warns and runs its ufunc passes (slower)."""
    try:
        import numba
    except ImportError:
        return "not installed: the NumPy engine runs its ufunc passes (slower)"
    if numba.config.DISABLE_JIT:
        return (f"{numba.__version__}, off (NUMBA_DISABLE_JIT=1): the NumPy engine's kernels "
                "run as Python (much slower)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cuonline.softmax(np.zeros((2, 3), np.float32))      # compiles the kernel, or warns
    if any(issubclass(w.category, RuntimeWarning) and "compiled kernel" in str(w.message)
           for w in caught):
        return (f"{numba.__version__}, off (its kernels do not compile here): the NumPy "
                "engine runs its ufunc passes (slower)")
    return f"{numba.__version__}, on (the NumPy engine's softmax work runs compiled)"


def _blas_lines():
    """One line per BLAS library loaded: implementation, version, kernel set, threads, file."""
    from .engines.cpu_runtime import blas_libraries

    libraries = blas_libraries()
    if not libraries:
        return {"blas": "none found by threadpoolctl"}
    return {"blas" if n == 0 else f"blas {n + 1}": line for n, line in enumerate(libraries)}


def _products_line():
    """The library the NumPy engine's matrix products run on, or why it cannot say."""
    from .engines import cpu_blas

    try:
        return cpu_blas.describe()
    except ValueError as exc:               # a bad CUONLINE_CPU_BLAS: said, not raised
        return f"unknown: {exc}"


def _emulation_status():
    try:
        from .testing import emulate
    except ImportError as exc:
        return f"unavailable ({exc})"
    problem = getattr(emulate, "compiler_problem", lambda: None)()
    return None if problem is None else f"unavailable ({problem})"


# --------------------------------------------------------------------------------------------
# kernels


def run_kernels(args) -> int:
    from .toolchain import nvrtc

    try:
        rows = _listing(nvrtc, args.arch)
    except nvrtc.NvrtcUnavailable as exc:
        print(f"python -m cuonline kernels: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    columns = ["key", "registers", "spill_stores", "spill_loads", "stack_bytes",
               "shared_bytes", "seconds"]
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)))
    return 0


def _listing(nvrtc, arch):
    """``nvrtc.listing(arch)``, one variant at a time with a progress line each on stderr
    (the whole listing takes about a minute)."""
    from .kernels import families

    specs = families.listing_specs(arch)
    rows = []
    for n, spec in enumerate(specs, 1):
        report = nvrtc.compile_spec(spec, arch)
        row = report.as_dict()
        row["kernels"] = [dataclasses.asdict(k) for k in report.kernels]
        row["threads"] = spec.threads
        row["shared_bytes"] = spec.shared_bytes
        row["static_shared_bytes"] = max((k.shared_bytes for k in report.kernels), default=0)
        rows.append(row)
        print(f"compiled {n:{len(str(len(specs)))}d}/{len(specs)} for {arch}: {spec.key} "
              f"({report.seconds:.1f} s)", file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------------------------
# tune

_TUNE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _dtype_list(text):
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in _TUNE_DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"dtypes must be among {', '.join(_TUNE_DTYPES)}, got {text!r}")
    return names


def _dim_list(text):
    try:
        dims = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        dims = ()
    if not dims or not all(1 <= d <= 256 for d in dims):
        raise argparse.ArgumentTypeError(f"dims must be integers in 1..256, got {text!r}")
    return dims


def _tune_keys(args, arch):
    """``(dtype, bucket, family, precision)`` in the order tune measures them on ``arch``."""
    from .kernels import heuristics, tuning

    buckets = sorted({heuristics.d_bucket(d) for d in args.dims})
    return [(dtype, bucket, family, precision) for dtype in args.dtypes for bucket in buckets
            for family, precision in tuning.targets(dtype, bucket, arch)]


def _label(dtype, bucket, family, precision):
    return f"{family}/{'tf32' if precision == 'tf32' else dtype}/d{bucket}"


def run_tune(args) -> int:
    from .engines import tune, tuning_files

    if args.dry_run:
        return _tune_dry_run(args)
    gpu, reason = _gpu_or_reason()
    if gpu is None:
        print(f"python -m cuonline tune needs a CUDA GPU ({reason}); "
              f"--dry-run lists the candidates without one", file=sys.stderr)
        return 1
    doc = tune.measure(args.dtypes, args.dims, quick=args.quick,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    if not doc["entries"]:
        print("cuonline tune: no candidate ran; nothing stored", file=sys.stderr)
        return 1
    path = tuning_files.store(doc)
    if args.json:
        json.dump({"path": str(path), "document": doc}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{doc['gpu']} ({doc['arch']}), cuonline {doc['cuonline']}: stored in {path}")
    for entry in doc["entries"]:
        times = {tuple(r["tiles"]): r["ms"] for r in entry["results"]}
        builtin, best = tuple(entry["builtin"]), tuple(entry["tiles"])
        label = _label(entry["dtype"], entry["d"], entry["family"], entry["precision"])
        before = times.get(builtin)
        ratio = f"  ({before / times[best]:.2f}x)" if before else ""
        print(f"  {label:28s} built-in {builtin}: "
              f"{'failed' if before is None else f'{before:.3f} ms'}  ->  "
              f"{best}: {times[best]:.3f} ms{ratio}")
    return 0


def _tune_dry_run(args) -> int:
    from .kernels import heuristics, tuning

    arch = args.arch
    if arch is None:
        gpu, _ = _gpu_or_reason()
        if gpu is not None:
            from .engines import tuning_files

            arch = tuning_files.device_identity()[1]
        else:
            arch = heuristics.DEFAULT_ARCH
    try:
        heuristics.arch_number(arch)
    except ValueError as exc:
        print(f"python -m cuonline tune: --arch: {exc}", file=sys.stderr)
        return 2
    rows = []
    for dtype, bucket, family, precision in _tune_keys(args, arch):
        for i, tiles in enumerate(tuning.candidates(arch, dtype, bucket, family,
                                                    quick=args.quick)):
            spec = tuning.spec_of(family, dtype, bucket, tiles)
            rows.append({"family": family, "dtype": dtype, "d": bucket,
                         "precision": precision, "tiles": list(tiles), "key": spec.key,
                         "shared_bytes": spec.shared_bytes, "builtin": i == 0})
    if args.json:
        json.dump({"arch": arch, "candidates": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"candidates for {arch} (nothing measured: --dry-run)")
    label = None
    for row in rows:
        here = _label(row["dtype"], row["d"], row["family"], row["precision"])
        if here != label:
            label = here
            count = sum(_label(r["dtype"], r["d"], r["family"], r["precision"]) == here
                        for r in rows)
            print(f"{label}: {count} candidates")
        note = "  built-in" if row["builtin"] else ""
        print(f"  {row['key']:48s} tiles {tuple(row['tiles'])!s:13s} "
              f"shared {row['shared_bytes'] / 1024:6.1f} KiB{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
