"""Host time per call of the CUDA engine's Python side, on the emulated backend.

    python benchmarks/host_overhead.py            # 200 calls per case
    python benchmarks/host_overhead.py --calls 20

For small forward and backward calls of ``backend="emulate"`` it times whole calls and, inside
them, the kernel launches (``EmulatedKernel.__call__``); the difference is what the engine
does on the host per call: the target, the plan, the typed arguments, the module lookup and
the host arrays around them (Delta, workspaces, reductions). The first call of each case
compiles its modules and is not counted. The kernels run on the CPU here, so only the host
column says anything about a GPU call; compare runs of one machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import cuonline
from cuonline.testing import emulate

CASES = {
    "forward f32 causal": dict(causal=True),
    "forward f32 bias": dict(bias="bias"),
    "backward f32 causal": dict(causal=True, backward=True),
    "backward f32 bias": dict(bias="bias", backward=True),
}


class KernelClock:
    """Adds up the seconds spent inside emulated kernel launches while installed."""

    def __init__(self):
        self.seconds = 0.0
        self._original = emulate.EmulatedKernel.__call__

    def __enter__(self):
        original, clock = self._original, self

        def timed(kernel, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(kernel, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start

        emulate.EmulatedKernel.__call__ = timed
        return self

    def __exit__(self, *exc):
        emulate.EmulatedKernel.__call__ = self._original


def one_case(options, calls):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 17, 16)).astype(np.float32) for _ in range(3))
    options = dict(options)
    backward = options.pop("backward", False)
    if options.get("bias") == "bias":
        options["bias"] = rng.standard_normal((17, 17)).astype(np.float32)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)

    def call():
        if backward:
            return cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate",
                                               **options)
        return cuonline.attention(q, k, v, backend="emulate", **options)

    call()                                  # compiles (or loads) the modules: not counted
    totals, hosts = [], []
    for _ in range(calls):
        with KernelClock() as clock:
            start = time.perf_counter()
            call()
            total = time.perf_counter() - start
        totals.append(total)
        hosts.append(total - clock.seconds)
    return statistics.median(totals), statistics.median(hosts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    print(f"emulated CUDA engine, median of {args.calls} calls (q, k, v: 2 x 17 x 16 float32)")
    print("| case | call (ms) | host side (ms) |")
    print("|---|---:|---:|")
    for name, options in CASES.items():
        total, host = one_case(options, args.calls)
        print(f"| {name} | {1e3 * total:.2f} | {1e3 * host:.3f} |")


if __name__ == "__main__":
    main()
