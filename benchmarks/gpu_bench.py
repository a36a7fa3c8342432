"""GPU benchmark: cuonline's CUDA engine beside naive CuPy and torch SDPA, on the same data.

Run by ``benchmarks/gpu_check.sh`` on a machine with a CUDA GPU, CuPy and (optionally) torch:

    python benchmarks/gpu_bench.py --out bench-out [--quick]

For each dtype (float16, float32, float64), head dimension (64, 128), length N (1024, 4096,
16384) and causal off/on it times, on one set of arrays shared through DLPack:

* ``cuonline``: ``cuonline.attention`` on CuPy arrays (our kernels: tensor cores for float16
  and float64, exact SIMT float32);
* ``cuonline-tf32``: float32 only, ``precision="tf32"`` (TF32 tensor cores);
* ``cuonline-mt``: float16 only, the tensor-core kernel with the other number of 16-row query
  tiles per warp than the built-in table's (``OTHER_M_TILES``, forced through the engine's
  ``tuned`` seam): one at D = 64 (4 warps, 64-key tiles, the built-in choice before two
  query tiles per warp), two at D = 128 (4 warps, 32-key tiles). Data for the tile table;
* ``naive-cupy``: ``softmax(q k^T * scale) v`` in CuPy with the scores materialised, same dtype;
* ``torch-<backend>``: ``scaled_dot_product_attention`` restricted to each SDPA backend (flash,
  efficient, cudnn, math) that accepts the case.

It reports TFLOP/s (4 * N^2 * D per head, halved when causal), the ratio to the best torch
backend, and the max error of each engine against a float64 cuonline reference on the first
rows (computed with the float64 kernel on a slice, cheap at every N). Results go to
``OUT/gpu_bench.json`` and ``OUT/gpu_bench.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

TOKENS = 65536   # batch*heads*N is held constant so every N costs about the same memory
CHECK_ROWS = 64  # query rows checked against the float64 reference
#: float16 tiles (warps, block_n, stages, m_tiles) of the ``cuonline-mt`` column, per D: the
#: other number of query tiles per warp than heuristics.MMA_TILES takes
OTHER_M_TILES = {64: (4, 64, 2, 1), 128: (4, 32, 2, 2)}


def flops(n, d, bh, causal):
    return 4.0 * bh * n * n * d / (2 if causal else 1)


def time_gpu(cupy, fn, repeat):
    """Median milliseconds of ``repeat`` runs after one warm-up, timed with CUDA events."""
    fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def naive(cupy, q, k, v, causal):
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.swapaxes(-1, -2)) * q.dtype.type(scale)
    if causal:
        n = s.shape[-1]
        s = cupy.where(cupy.tri(n, dtype=bool), s, -cupy.inf).astype(q.dtype)
    s = s - s.max(axis=-1, keepdims=True)
    p = cupy.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v


def torch_backends():
    """{name: callable(q, k, v, causal)} for each SDPA backend, or {} without torch."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    found = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def run(q, k, v, causal, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=causal)

        found["torch-" + name.split("_")[0].lower()] = run
    return found


def forced_tiles(q, k, v, causal, tiles):
    """A callable running the CUDA engine with the tensor-core tiles ``(warps, block_n,
    stages, m_tiles)`` forced, validated once (the public API validates on every call)."""
    from cuonline._validate import validate_attention
    from cuonline.engines import cuda
    from cuonline.engines.target import overrides
    from cuonline.kernels import heuristics

    p = validate_attention(q, k, v, backend="cupy", causal=causal)
    tuned = {("attention_fwd_mma", p.dtype.name, heuristics.d_bucket(max(p.d, p.dv))): tiles}

    def run():
        with overrides(tuned=tuned):
            return cuda.attention(p)[0]

    return run


def cases(quick):
    dtypes = ["float16", "float32", "float64"]
    dims = [64, 128]
    lengths = [1024, 4096] if quick else [1024, 4096, 16384]
    for dtype in dtypes:
        for d in dims:
            for n in lengths:
                for causal in (False, True):
                    yield dtype, d, n, causal


def save(out, rows):
    """Write the JSON and the table so far: a run cut short by a timeout still reports."""
    (out / "gpu_bench.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (out / "gpu_bench.md").write_text(table)
    return table


def run(args, out):
    import cupy

    import cuonline

    torch_fns = torch_backends()
    if torch_fns:
        import torch
    rows = []
    rng = cupy.random.default_rng(0)
    for dtype, d, n, causal in cases(args.quick):
        bh = max(1, TOKENS // n)
        shape = (bh, n, d)
        q, k, v = (rng.standard_normal(shape, dtype=cupy.float64).astype(dtype) for _ in range(3))
        # float64 reference for the last CHECK_ROWS queries (bottom-right causal alignment keeps
        # them aligned with the same keys), computed by our float64 kernel, which the test
        # suite checks against the oracle; cheap at every N
        q64, k64, v64 = (x.astype(cupy.float64) for x in (q, k, v))
        lq_ref = min(CHECK_ROWS, n)
        ref = cuonline.attention(q64[:, -lq_ref:], k64, v64, causal=causal)
        fl = flops(n, d, bh, causal)
        engines = {
            "cuonline": lambda: cuonline.attention(q, k, v, causal=causal),
            "naive-cupy": lambda: naive(cupy, q, k, v, causal),
        }
        if dtype == "float32":
            engines["cuonline-tf32"] = lambda: cuonline.attention(q, k, v, causal=causal,
                                                                  precision="tf32")
        if dtype == "float16":
            engines["cuonline-mt"] = forced_tiles(q, k, v, causal, OTHER_M_TILES[d])
        if torch_fns:
            tq, tk, tv = (torch.from_dlpack(x)[None] for x in (q, k, v))   # (1, bh, n, d)
            for name, fn in torch_fns.items():
                engines[name] = (lambda fn=fn: fn(tq, tk, tv, causal))
        for name, fn in engines.items():
            row = dict(dtype=dtype, d=d, n=n, bh=bh, causal=causal, engine=name)
            try:
                ms = time_gpu(cupy, fn, args.repeat)
                result = fn()
                if not isinstance(result, cupy.ndarray):
                    result = cupy.from_dlpack(result).reshape(bh, n, -1)
                err = float(cupy.abs(result[:, -lq_ref:].astype(cupy.float64) - ref).max())
                row.update(ms=ms, tflops=fl / ms / 1e9, max_error=err)
            except Exception as exc:  # noqa: BLE001 - a backend refusing a case is a result
                row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            rows.append(row)
            print(format_row(row), flush=True)
            save(out, rows)
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def format_row(row):
    head = (f"{row['dtype']:>8} d={row['d']:<3} n={row['n']:<6} "
            f"{'causal' if row['causal'] else 'full':6} {row['engine']:<16}")
    if "error" in row:
        return f"{head} refused: {row['error']}"
    return f"{head} {row['tflops']:8.2f} TFLOP/s  err {row['max_error']:.2e}"


def markdown(rows):
    """A table with one line per case: TFLOP/s of each engine and cuonline / best torch."""
    engines = []
    for r in rows:
        if r["engine"] not in engines:
            engines.append(r["engine"])
    by_case = {}
    for r in rows:
        by_case.setdefault((r["dtype"], r["d"], r["n"], r["causal"]), {})[r["engine"]] = r
    header = ["dtype", "D", "N", "causal"] + engines + ["cuonline / best torch",
                                                         "cuonline max err"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (dtype, d, n, causal), found in by_case.items():
        cells = [dtype, str(d), str(n), "yes" if causal else "no"]
        for e in engines:
            r = found.get(e)
            cells.append("-" if r is None or "error" in r else f"{r['tflops']:.1f}")
        torch_best = max((r["tflops"] for e, r in found.items()
                          if e.startswith("torch") and "tflops" in r), default=None)
        ours = found.get("cuonline", {})
        ratio = (f"{ours['tflops'] / torch_best:.2f}" if torch_best and "tflops" in ours
                 else "-")
        cells += [ratio, f"{ours['max_error']:.1e}" if "max_error" in ours else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N in {1024, 4096} only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    rows = run(args, out)
    print(save(out, rows))
    print(f"benchmark time {time.time() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
