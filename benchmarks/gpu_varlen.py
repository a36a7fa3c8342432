"""Packed variable-length batches on a lent GPU (run by benchmarks/gpu_check.sh): checks, then figures.

1. Checks: the forward (out, lse) and the backward (every gradient) of packed batches on the
   CUDA engine (``backend="cupy"``, both kernel families as the dispatcher picks them: float16
   and float64 on the tensor cores, float32 on SIMT) against the NumPy engine on host copies,
   with empty and one-token sequences and the per-sequence options.
2. Figures (issue 20's rows): ESM-2-like lengths (``bench_varlen.lengths``: 256 sequences,
   mean near 325, tail to 1,024), 20 heads, D 64, float16 and float32: packed
   (``cu_seqlens``), padded to the longest with ``kv_lengths`` and a loop of one call per
   sequence; forward, and backward with the forward's results held; GPU time by CUDA events.

Prints one line per check and the table, writes them to ``$OUT/gpu_varlen.md`` (or
``--out``); exit status 1 if a check failed.

    python benchmarks/gpu_varlen.py --out bench-out
    python benchmarks/gpu_varlen.py --dry-run        # the checks, emulated on the CPU, tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_varlen import lengths  # noqa: E402

import cuonline  # noqa: E402

LINES: list[str] = []
FAILED: list[str] = []
#: max |error| / max(1, max |reference|) allowed against the NumPy engine, per dtype
TOLERANCE = {"float16": 2e-2, "float32": 2e-4, "float64": 1e-10}


def say(line: str) -> None:
    LINES.append(line)
    print(line, flush=True)


def cu(lens):
    return np.concatenate(([0], np.cumsum(lens))).astype(np.int64)


def check_case(xp, backend, name, dtype, lens_q, lens_k, heads, d, options):
    """One packed batch on ``backend`` against the NumPy engine on host copies."""
    rng = np.random.default_rng(len(LINES))
    cq, ck = cu(lens_q), cu(lens_k)
    host = [rng.standard_normal((heads, int(c[-1]), d)).astype(dtype) for c in (cq, ck, ck)]
    dout = rng.standard_normal(host[0].shape).astype(dtype)
    if "rel_q" in options:
        options = dict(options, rel_q=rng.standard_normal((heads, int(cq[-1]), 8)))
    packed = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, **options)
    ref_out, ref_lse = cuonline.attention(*host, return_lse=True, **packed)
    ref = cuonline.attention_backward(dout, *host, ref_out, ref_lse, **packed)
    dev = [xp.asarray(x) for x in host]
    dev_options = {n: (xp.asarray(x) if isinstance(x, np.ndarray) and not n.startswith("cu_")
                       else x) for n, x in packed.items()}
    out, lse = cuonline.attention(*dev, return_lse=True, backend=backend, **dev_options)
    g = cuonline.attention_backward(xp.asarray(dout), *dev, out, lse, backend=backend,
                                    **dev_options)

    def host_of(x):
        return np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64)

    worst = 0.0
    pairs = [("out", out, ref_out), ("lse", lse, ref_lse)] + [
        (f, getattr(g, f), getattr(ref, f)) for f in ("dq", "dk", "dv", "drel_bias", "drel_q",
                                                      "drel_k") if getattr(ref, f) is not None]
    for field, got, want in pairs:
        got, want = host_of(got), host_of(want)
        finite = np.isfinite(want)
        if not np.array_equal(np.isfinite(got), finite):
            worst = np.inf
            continue
        scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
        worst = max(worst, float(np.abs(got[finite] - want[finite]).max(initial=0.0)) / scale)
    ok = worst <= TOLERANCE[np.dtype(dtype).name]
    say(f"{'ok  ' if ok else 'FAIL'} {name} {np.dtype(dtype).name}: max relative error "
        f"{worst:.3g} (tol {TOLERANCE[np.dtype(dtype).name]:g})")
    if not ok:
        FAILED.append(name)


def checks(xp, backend, tiny):
    heads, d = (2, 16) if tiny else (4, 64)
    # empty sequences on either side, one-token ones, lengths around the tiles and beyond
    lens_q = [5, 0, 17, 1, 3, 65, 1, 130] if tiny else [5, 0, 17, 1, 3, 64, 65, 1, 300, 129]
    lens_k = [5, 4, 17, 1, 0, 33, 2, 130] if tiny else [5, 4, 17, 1, 0, 64, 31, 2, 300, 200]
    cases = {
        "plain": {},
        "causal": {"causal": True},
        "alibi_window": {"alibi_slopes": np.linspace(0.1, 0.5, heads), "window": (40, 0)},
        "rel_qk_softcap": {"rel_q": True, "rel_k": np.random.default_rng(1).standard_normal(
            (1, 65, 8)), "softcap": 3.0, "rel_bias": np.random.default_rng(2).standard_normal(
                (heads, 33))},
    }
    dtypes = (np.float64,) if tiny else (np.float16, np.float32, np.float64)
    for dtype in dtypes:
        for name, options in cases.items():
            try:
                check_case(xp, backend, name, dtype, lens_q, lens_k, heads, d, options)
            except Exception:  # noqa: BLE001 - every check reports, whatever fails
                say(f"FAIL {name} {np.dtype(dtype).name}: raised\n{traceback.format_exc()}")
                FAILED.append(name)


def gpu_seconds(cupy, fn, repeat):
    """Best GPU time of ``fn`` (CUDA events around it; one warm-up call first)."""
    fn()
    cupy.cuda.Device().synchronize()
    best = np.inf
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return best


def figures(cupy, sequences, heads, d, repeat):
    lens = lengths(sequences)
    c = cu(lens)
    say(f"\n{sequences} sequences (mean {lens.mean():.0f}, max {lens.max()}), {heads} heads, "
        f"D {d}; padded/packed work {len(lens) * lens.max() * lens.mean() / (lens**2).sum():.2f}x")
    say("| dtype | layout | forward ms | backward ms | forward TFLOP/s (useful) |")
    say("|---|---|---:|---:|---:|")
    flops = 4 * heads * d * float((lens.astype(np.float64) ** 2).sum())
    for dtype in (np.float16, np.float32):
        rng = np.random.default_rng(0)
        x = cupy.asarray(rng.standard_normal((heads, int(c[-1]), d)).astype(dtype))
        padded = cupy.zeros((len(lens), heads, int(lens.max()), d), dtype)
        for b in range(len(lens)):
            padded[b, :, :lens[b]] = x[:, c[b]:c[b + 1]]
        kv = cupy.asarray(lens[:, None])
        parts = [x[:, c[b]:c[b + 1]] for b in range(len(lens))]
        layouts = {
            "packed": [(x, dict(cu_seqlens_q=c, cu_seqlens_k=c))],
            "padded": [(padded, dict(kv_lengths=kv))],
            "loop": [(p, {}) for p in parts],
        }
        for name, calls in layouts.items():
            held = []
            for a, kw in calls:
                out, lse = cuonline.attention(a, a, a, return_lse=True, **kw)
                held.append((a, kw, out, lse))
            fwd = gpu_seconds(cupy, lambda: [cuonline.attention(a, a, a, **kw)
                                             for a, kw, _, _ in held], repeat)
            bwd = gpu_seconds(cupy, lambda: [cuonline.attention_backward(
                cupy.ones_like(o), a, a, a, o, s, **kw) for a, kw, o, s in held], repeat)
            say(f"| {np.dtype(dtype).name} | {name} | {fwd * 1e3:.2f} | {bwd * 1e3:.2f} | "
                f"{flops / fwd / 1e12:.1f} |")
            del held
        del padded, parts
        cupy.get_default_memory_pool().free_all_blocks()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--dry-run", action="store_true",
                        help="the checks only, emulated on the CPU with tiny shapes")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    start = time.perf_counter()
    if args.dry_run:
        checks(np, "emulate", tiny=True)
    else:
        import cupy  # noqa: PLC0415 - a GPU run only
        checks(cupy, "cupy", tiny=False)
        say(f"checks: {time.perf_counter() - start:.1f} s")
        try:
            figures(cupy, args.sequences, args.heads, args.d, args.repeat)
        except Exception:  # noqa: BLE001 - the checks above are kept whatever fails here
            say(f"FAIL figures: raised\n{traceback.format_exc()}")
            FAILED.append("figures")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_varlen.md").write_text("\n".join(LINES) + "\n")
    print(f"{len(FAILED)} failed; {time.perf_counter() - start:.1f} s")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
