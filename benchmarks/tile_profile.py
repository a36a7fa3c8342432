"""Where the time of one forward tile goes on this machine, and what a faster BLAS would give.

    python benchmarks/tile_profile.py                   # float32 and float64, D 64 and 128
    python benchmarks/tile_profile.py --quick           # tiny repeat counts (CI smoke run)

One thread, CPU time, on the tile shape the NumPy engine takes from this machine's L2
(``cuonline.engines.numpy.blocks``): rows x keys queries against keys, head size D. For each
case it times the three steps of a forward tile of ``cuonline.engines.numpy``:

* ``q kᵀ``: the score product (rows x D times D x keys), on the library the engine's products
  take here (``cuonline.engines.cpu_blas``: NumPy's OpenBLAS or MKL; the preamble says which),
  as the engine does;
* ``softmax``: the compiled online-softmax tile kernel
  (``cuonline.engines.cpu_runtime.tile_kernel``) on those scores;
* ``P v``: the value product (rows x keys times keys x D), added into the output in place as
  the engine does;

and beside each product the same product through torch's CPU ``matmul`` (on x86 builds of
torch, Intel MKL; the column says which BLAS torch was built with). The last columns give the
tile at the engine's and at torch's product speeds: what the engine would reach per core with the
other library's products and its own softmax kernel. This is the profile behind issue 23's
finding on the 2-core Intel machine of docs/performance.md (machine C).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from bench_cpu import blas_ceiling, print_machine, use_one_core

from cuonline.engines import numpy as forward
from cuonline.engines.cpu_blas import product
from cuonline.engines.cpu_runtime import tile_kernel


def seconds(fn, repeat):
    """Best mean CPU time of ``fn`` over 5 rounds of ``repeat`` calls, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(repeat):
            fn()
        best = min(best, (time.process_time() - start) / repeat)
    return best


def torch_blas():
    """``(matmul, name)``: torch's product into NumPy arrays and the BLAS torch was built
    with; ``(None, "torch not installed")`` without torch."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    config = torch.__config__.show()
    name = next((part.split("=")[1] for line in config.splitlines()
                 for part in line.replace(",", " ").split() if part.startswith("BLAS_INFO=")),
                "unknown")

    def matmul(a, b, out):
        torch.matmul(torch.from_numpy(a), torch.from_numpy(b), out=torch.from_numpy(out))

    return matmul, name


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--quick", action="store_true",
                        help="few repeats: checks that the script runs")
    args = parser.parse_args(argv)
    use_one_core()
    other, blas_name = torch_blas()
    ceilings = {dt: blas_ceiling(dt, 1 if args.quick else 3) for dt in args.dtypes}
    print_machine("One forward tile, one thread, CPU time", ceilings,
                  with_torch=other is not None)
    print(f"torch's products: {blas_name}" if other else "torch's products: not measured")
    print("| dtype | tile | D | q kᵀ us | softmax us | P v us | products GFLOP/s "
          "| torch q kᵀ us | torch P v us | tile GFLOP/s | with torch's products |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        rows, keys = forward.blocks(dtype)
        kernel = tile_kernel(dtype)
        for d in args.dims:
            q = rng.standard_normal((rows, d)).astype(dtype)
            k = rng.standard_normal((keys, d)).astype(dtype)
            v = rng.standard_normal((keys, d)).astype(dtype)
            s = np.empty((rows, keys), dtype)
            o = np.zeros((rows, d), dtype)
            np.matmul(q, k.T, out=s)
            scores = s.copy()
            m = np.full(rows, -np.inf, dtype)
            l = np.zeros(rows, dtype)
            lo, hi = np.zeros(rows, np.int64), np.full(rows, keys, np.int64)
            repeat = 3 if args.quick else max(5, int(2e8 / (rows * keys * d)))
            qk = seconds(lambda: product(q, k.T, s), repeat)
            soft = float("nan")
            if kernel is not None:
                def sweep():
                    np.copyto(s, scores)        # the kernel overwrites its scores
                    kernel(s, m, l, o, lo, hi)
                soft = seconds(sweep, repeat) - seconds(lambda: np.copyto(s, scores), repeat)
            pv = seconds(lambda: product(scores, v, o, add=True), repeat)
            flops = 2 * rows * keys * d
            cells = [f"{qk * 1e6:.0f}", f"{soft * 1e6:.0f}", f"{pv * 1e6:.0f}",
                     f"{2 * flops / (qk + pv) / 1e9:.0f}"]
            if other is not None:
                kt = np.ascontiguousarray(k.T)
                tqk = seconds(lambda: other(q, kt, s), repeat)
                tpv = seconds(lambda: other(scores, v, o), repeat)
                cells += [f"{tqk * 1e6:.0f}", f"{tpv * 1e6:.0f}"]
                with_other = f"{2 * flops / (tqk + soft + tpv) / 1e9:.0f}"
            else:
                cells += ["-", "-"]
                with_other = "-"
            cells += [f"{2 * flops / (qk + soft + pv) / 1e9:.0f}", with_other]
            print(f"| {dtype} | {rows}x{keys} | {d} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
