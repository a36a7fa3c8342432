"""The NumPy engine's compiled task loops against its Python loops, in one process.

    python benchmarks/task_loops.py --one-core          # one thread, CPU time
    python benchmarks/task_loops.py                     # the engine's threads, wall time
    python benchmarks/task_loops.py --quick             # tiny sizes (CI smoke run)
    python benchmarks/task_loops.py --compare stacks --lengths 256 512 --heads 64

``--compare stacks`` times the stacks of batch elements (``numpy.stack_plan``,
``numpy_backward._stacks``: several elements per compiled call) against a task per element
(each element's own compiled walk or key blocks) instead: the same bits, other task lists.

For the plain score the forward walks query blocks' key tiles in compiled calls
(``cuonline/engines/_task_kernels.py``: ``forward_stack``, a stack of blocks, each its
``forward_walk``) and the backward does a key block's query tiles in one (``backward_block``),
BLAS called from compiled code; every other call runs the engine's Python loop over the same
tiles, with the same products and the same bits. This script runs each case both ways,
alternating the two within the process (the compiled form switched off through the engine's
``_stack_walk`` and ``_compiled_block``), and prints each form's best GFLOP/s and the ratio
of the median times, compiled / Python loop: below 1 is the compiled form's gain.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import numpy as np
from bench_cpu import blas_ceiling, case_arguments, print_machine, use_one_core

import cuonline
from cuonline.engines import numpy as forward
from cuonline.engines import numpy_backward as backward

COMPILED = (forward._stack_walk, backward._compiled_block)
STACKS = (forward.stack_plan, backward._stacks)
# per comparison: the form switched off, then the form switched on (the ratio's numerator)
FORMS = {"loops": ("Python loop", "compiled"), "stacks": ("task per element", "stacks")}


def use(form):
    """Run the engine with one form of the comparisons in FORMS on, the others as shipped."""
    forward._stack_walk, backward._compiled_block = COMPILED
    forward.stack_plan, backward._stacks = STACKS
    if form == "Python loop":
        forward._stack_walk = lambda p, element: None
        backward._compiled_block = lambda *args: 0
    elif form == "task per element":
        forward.stack_plan = lambda p: None
        backward._stacks = lambda p, groups: None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5,
                        help="calls of each form per case, alternated (default 5)")
    parser.add_argument("--one-core", action="store_true",
                        help="one thread each, timed as this process's CPU time")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--compare", choices=sorted(FORMS), default="loops",
                        help="compiled task loops against Python loops (default), or stacks "
                             "of batch elements against a task per element")
    args = parser.parse_args(argv)
    off, on = FORMS[args.compare]
    if args.quick:
        args.lengths, args.dims, args.rounds = [300], [16], 2
        args.heads = 8 if args.compare == "stacks" else 2      # stacks need 2 a core
    workers = use_one_core() if args.one_core else None
    clock = time.process_time if args.one_core else time.perf_counter
    ceilings = {dt: blas_ceiling(dt, 1 if args.quick else 3) for dt in args.dtypes}
    print_machine(f"The {on} form against the {off} form, B=1 H="
                  f"{args.heads}" + (", one core, CPU time" if args.one_core else ", wall time"),
                  ceilings, with_torch=importlib.util.find_spec("torch") is not None)
    print(f"| pass | N | D | dtype | causal | {off} GFLOP/s | {on} GFLOP/s "
          f"| time {on} / {off} |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for n in args.lengths:
            for d in args.dims:
                q, k, v = (rng.standard_normal((1, args.heads, n, d)).astype(dtype)
                           for _ in range(3))
                for causal in (False, True):
                    out, lse = cuonline.attention(q, k, v, causal=causal, return_lse=True)
                    dout = rng.standard_normal(out.shape).astype(dtype)
                    calls = {
                        "forward": lambda: cuonline.attention(
                            q, k, v, causal=causal, workers=workers),
                        "backward": lambda: cuonline.attention_backward(
                            dout, q, k, v, out, lse, causal=causal, workers=workers),
                    }
                    for name, call in calls.items():
                        times = {off: [], on: []}
                        for r in range(args.rounds + 1):        # the first round warms up
                            for form in (off, on)[::1 if r % 2 else -1]:
                                use(form)
                                start = clock()
                                call()
                                if r:
                                    times[form].append(clock() - start)
                        use(on)
                        flop = 4 * args.heads * n * n * d / (2 if causal else 1)
                        flop *= 2.5 if name == "backward" else 1
                        rate = {f: flop / min(ts) / 1e9 for f, ts in times.items()}
                        ratio = statistics.median(times[on]) / statistics.median(times[off])
                        print(f"| {name} | {n} | {d} | {dtype} | {'yes' if causal else 'no'} "
                              f"| {rate[off]:.1f} | {rate[on]:.1f} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
