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

Two more sections, each its own run:

* ``--section genomics`` (``OUT/gpu_genomics.md``): the genomics score terms beside their dense
  ``(H, L, L)`` bias on the same logits, as benchmarks/bench_genomics.py on the CPU: an
  Enformer-style layer (``rel_q``/``rel_k``) at L = 1536 and 4096 and an AlphaGenome-style one
  (8 query heads on 1 kv head, ``bias_block=16``, ``softcap_bias``) at L = 4096, float16 and
  float32, with the bytes each holds;
* ``--section backward`` (``OUT/gpu_backward.md``): ``cuonline.attention_backward`` beside
  torch's flash and efficient SDPA backward (autograd, 4-D inputs, the node printed) and, in
  float64, the explicit backward formulas in naive CuPy (scores materialised); TFLOP/s count
  the backward as 2.5x the forward's FLOPs.
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


def genomics_cases(quick):
    """(layer, L, dtype): the rows of ``--section genomics``."""
    lengths = [1536] if quick else [1536, 4096]
    for dtype in ("float16", "float32"):
        for n in lengths:
            yield "enformer", n, dtype
        yield "alphagenome", 4096, dtype


def genomics_arrays(cupy, layer, n, dtype, rng):
    """``(q, k, v, native options, dense options, native bytes)`` of one layer, batch 1."""
    heads, block = 8, 16
    if layer == "enformer":
        dk, dv = 64, 192
        q, k = (rng.standard_normal((1, heads, n, dk), dtype=cupy.float32) for _ in range(2))
        v = rng.standard_normal((1, heads, n, dv), dtype=cupy.float32)
        rel_q = rng.standard_normal((1, heads, n, dk), dtype=cupy.float32) * 0.125
        rel_k = rng.standard_normal((heads, 2 * n - 1, dk), dtype=cupy.float32)
        delta = cupy.arange(n)[None, :] - cupy.arange(n)[:, None]
        dense = cupy.stack([rel_q[0, h] @ rel_k[h].T for h in range(heads)])     # (H, L, 2L-1)
        dense = cupy.take_along_axis(dense, cupy.broadcast_to((n - 1) + delta, (heads, n, n)),
                                     axis=-1)[None]
        native = dict(rel_q=rel_q, rel_k=rel_k)
        common = {}
    else:
        dk, dv = 128, 192
        q = rng.standard_normal((1, heads, n, dk), dtype=cupy.float32)
        k, v = (rng.standard_normal((1, 1, n, e), dtype=cupy.float32) for e in (dk, dv))
        pair = rng.standard_normal((1, heads, n // block, n // block), dtype=cupy.float32)
        dense = cupy.repeat(cupy.repeat(pair, block, axis=-2), block, axis=-1)
        native = dict(bias=pair, bias_block=block)
        common = dict(softcap=5.0, softcap_bias=True)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    native_bytes = sum(x.nbytes for x in native.values() if hasattr(x, "nbytes"))
    return q, k, v, dict(common, **native), dict(common, bias=dense), native_bytes


def run_genomics(args, out):
    import cupy

    import cuonline

    rng = cupy.random.default_rng(0)
    lines = ["| layer | L | dtype | native ms | dense ms | dense / native | term MiB | "
             "dense MiB | max diff |", "|" + "---|" * 9]
    for layer, n, dtype in genomics_cases(args.quick):
        cells = [layer, str(n), dtype]
        try:
            q, k, v, native, dense, native_bytes = genomics_arrays(cupy, layer, n, dtype, rng)
            t_native = time_gpu(cupy, lambda: cuonline.attention(q, k, v, **native), args.repeat)
            t_dense = time_gpu(cupy, lambda: cuonline.attention(q, k, v, **dense), args.repeat)
            diff = float(cupy.abs(cuonline.attention(q, k, v, **native).astype(cupy.float32)
                                  - cuonline.attention(q, k, v, **dense)).max())
            cells += [f"{t_native:.2f}", f"{t_dense:.2f}", f"{t_dense / t_native:.2f}",
                      f"{native_bytes / 2**20:.1f}", f"{dense['bias'].nbytes / 2**20:.1f}",
                      f"{diff:.1e}"]
        except Exception as exc:  # noqa: BLE001 - a failing case is a result
            cells += [f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"] + [""] * 5
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        (out / "gpu_genomics.md").write_text("\n".join(lines) + "\n")
        cupy.get_default_memory_pool().free_all_blocks()


def naive_backward(cupy, q, k, v, dout):
    """The explicit backward formulas with the scores materialised (no causal), same dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.swapaxes(-1, -2)) * scale
    p = cupy.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ v
    dv = p.swapaxes(-1, -2) @ dout
    dp = dout @ v.swapaxes(-1, -2)
    ds = p * (dp - (dout * o).sum(axis=-1, keepdims=True))
    return ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, dv


def backward_cases(quick):
    """(dtype, D, N, causal) of ``--section backward``."""
    for dtype in ("float16", "float32", "float64"):     # CuPy has no bfloat16 arrays
        for d in (64, 128):
            for n in ([4096] if quick else [1024, 4096]):
                yield dtype, d, n, False


def run_backward(args, out):
    import cupy

    import cuonline

    torch_fns = torch_backends()
    lines = ["| dtype | D | N | engine | TFLOP/s | note |", "|" + "---|" * 6]
    rng = cupy.random.default_rng(0)
    for dtype, d, n, causal in backward_cases(args.quick):
        bh = max(1, TOKENS // n)
        fl = 2.5 * flops(n, d, bh, causal)
        q, k, v, dout = (rng.standard_normal((bh, n, d), dtype=cupy.float64).astype(dtype)
                         for _ in range(4))
        o, lse = cuonline.attention(q, k, v, causal=causal, return_lse=True)
        engines = {"cuonline": (lambda: cuonline.attention_backward(
            dout, q, k, v, o, lse, causal=causal), "deterministic")}
        if dtype == "float64":
            engines["naive-cupy"] = (lambda: naive_backward(cupy, q, k, v, dout), "explicit")
        if torch_fns:
            import torch
            tdt = getattr(torch, dtype)
            tq, tk, tv, tdo = (torch.randn((1, bh, n, d), device="cuda", dtype=tdt)
                               for _ in range(4))
            for name in ("torch-flash", "torch-efficient"):
                fn = torch_fns.get(name)
                if fn is None:
                    continue
                leaves = [x.detach().requires_grad_(True) for x in (tq, tk, tv)]
                try:
                    result = fn(*leaves, causal)
                except Exception as exc:  # noqa: BLE001
                    lines.append(f"| {dtype} | {d} | {n} | {name} | - | refused: "
                                 f"{type(exc).__name__} |")
                    continue

                def step(result=result, leaves=leaves):
                    for x in leaves:
                        x.grad = None
                    result.backward(tdo, retain_graph=True)

                engines[name] = (step, type(result.grad_fn).__name__)
        for name, (fn, note) in engines.items():
            try:
                ms = time_gpu(cupy, fn, args.repeat)
                lines.append(f"| {dtype} | {d} | {n} | {name} | {fl / ms / 1e9:.1f} | {note} |")
            except Exception as exc:  # noqa: BLE001 - a failing case is a result
                lines.append(f"| {dtype} | {d} | {n} | {name} | - | error: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]} |")
            print(lines[-1], flush=True)
            (out / "gpu_backward.md").write_text("\n".join(lines) + "\n")
        cupy.get_default_memory_pool().free_all_blocks()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N in {1024, 4096} only")
    parser.add_argument("--section", choices=("forward", "genomics", "backward"),
                        default="forward")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if args.section == "genomics":
        run_genomics(args, out)
    elif args.section == "backward":
        run_backward(args, out)
    else:
        rows = run(args, out)
        print(save(out, rows))
    print(f"benchmark time {time.time() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
