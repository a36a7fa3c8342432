"""CPU benchmark of the backward pass: cuonline.attention_backward beside torch's, in one run.

    python benchmarks/bench_backward.py                 # N 1024, 4096 x D 64, 128 x f32, f64
    python benchmarks/bench_backward.py --quick         # a tiny smoke run (CI)
    python benchmarks/bench_backward.py --one-core      # per-core efficiency on a busy machine
    python benchmarks/bench_backward.py --causal yes    # the causal band (default: none)

For every case (N, D, dtype, causal) it times, on the same (B=1, H, N, D) arrays and the same output
gradient, the backward pass alone (both sides hold the forward's results):

* ``cuonline``: ``cuonline.attention_backward`` (NumPy engine, its thread pool), deterministic;
* ``torch``: ``out.backward(dout)`` through ``torch.nn.functional.scaled_dot_product_attention``
  on 4-D inputs that require grad, which selects torch's fused CPU flash kernel; the column
  ``torch backward`` prints the autograd node torch recorded, so a comparison against its
  unfused math path cannot pass unnoticed.

Throughput counts 2.5x the forward's FLOPs, 10 * Lq * Lk * D per head (the five matrix
products of the FlashAttention-2 backward), halved when causal (as bench_cpu.py counts). The
BLAS ceiling (a 2048^3 matrix product per dtype, all cores) is measured in the same run. The
summary gives the geometric mean and the worst of cuonline / torch, then cuonline's peak
traced allocation at --memory-length beside the size of its gradients. Figures move with
whatever else the machine does: compare ratios of one run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
import tracemalloc

import numpy as np
from bench_cpu import (best_seconds, blas_ceiling, case_arguments, case_inputs, case_title,
                       check_ceilings, min_seconds_argument, print_machine, use_min_seconds,
                       use_one_core)

import cuonline


def torch_backward():
    """``prepare(q, k, v, dout, causal) -> (run, node)``: a function that runs torch's backward
    of SDPA on these arrays and the name of the autograd node; None without torch."""
    try:
        import torch
    except ImportError:
        return None

    def prepare(q, k, v, dout, causal):
        tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        grad = torch.from_numpy(dout)

        def run():
            for t in (tq, tk, tv):
                t.grad = None
            out.backward(grad, retain_graph=True)

        return run, type(out.grad_fn).__name__

    return prepare


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_arguments(parser)
    parser.add_argument("--repeat", type=int, default=2)
    min_seconds_argument(parser)
    parser.add_argument("--memory-length", type=int, default=16384)
    parser.add_argument("--one-core", action="store_true",
                        help="everything on one thread, timed as CPU time (bench_cpu.py's)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one repeat: checks that the script runs")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="no",
                        help="the cases with the causal band, without, or both (default: "
                             "without, the 8 cases of docs/performance.md's tables)")
    args = parser.parse_args(argv)
    workers = use_one_core() if args.one_core else None
    if args.quick:
        args.lengths, args.dims, args.heads, args.repeat = [256], [64], 2, 1
        args.memory_length = 1024
    use_min_seconds(0 if args.quick else args.min_seconds)

    prepare = torch_backward()
    ceilings = {dt: blas_ceiling(dt, args.repeat) for dt in args.dtypes}
    print_machine("backward, " + case_title(args) + (", one core, CPU time" if args.one_core
                                                      else ""), ceilings, prepare is not None)
    header = (f"| {'N':>5} | {'D':>3} | {'dtype':<7} | causal | cuonline | torch | "
              f"torch backward"
              f"{' ' * 32} | cuonline/torch | cuonline/BLAS | torch/BLAS |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")

    rng = np.random.default_rng(0)
    ratios = []
    causal_cases = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for n, d, dt, causal in itertools.product(args.lengths, args.dims, args.dtypes,
                                              causal_cases):
        q, k, v, dout = case_inputs(rng, args, n, d, dt, 4)
        out, lse = cuonline.attention(q, k, v, return_lse=True, causal=causal)
        gflop = 10 * args.heads * n * n * d / 1e9 / (2 if causal else 1)
        ours = gflop / best_seconds(
            lambda: cuonline.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                workers=workers), args.repeat)
        theirs, node = float("nan"), "-"
        if prepare is not None:
            run, node = prepare(q, k, v, dout, causal)
            theirs = gflop / best_seconds(run, args.repeat)
            ratios.append(ours / theirs)
        print(f"| {n:>5} | {d:>3} | {dt:<7} | {'yes' if causal else 'no':<6} "
              f"| {ours:>8.1f} | {theirs:>5.1f} | {node:<46} "
              f"| {ours / theirs:>14.2f} | {ours / ceilings[dt]:>13.2f} "
              f"| {theirs / ceilings[dt]:>10.2f} |")
    if ratios:
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"cuonline / torch over {len(ratios)} cases: geometric mean {geomean:.2f}, "
              f"worst {min(ratios):.2f}")
    check_ceilings(ceilings, args.repeat)

    n, d = args.memory_length, 64
    q, k, v, dout = (rng.standard_normal((1, n, d), dtype=np.float32) for _ in range(4))
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    tracemalloc.start()
    start = time.perf_counter()
    cuonline.attention_backward(dout, q, k, v, out, lse)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    grads = 3 * n * d * 4
    print(f"memory: N={n} H=1 D={d} float32: cuonline backward peak traced allocation "
          f"{peak / 2**20:.1f} MiB (gradients {grads / 2**20:.1f} MiB; one N x N score matrix "
          f"would be {n * n * 4 / 2**30:.1f} GiB); {seconds:.1f} s")


if __name__ == "__main__":
    main()
