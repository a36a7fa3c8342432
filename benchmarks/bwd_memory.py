"""Peak extra host memory of the emulated CUDA backward's Python side (its workspaces and
reductions), measured with tracemalloc (the emulated engine's arrays are NumPy arrays).

The kernels themselves are replaced by a no-op that reports rows of weights summing to 1
(the lse check passes): what is measured is what the engine allocates around them, at sizes
the emulator would take minutes to run. Run from a checkout:

    PYTHONPATH=. python benchmarks/bwd_memory.py [--length 2048]

The table in docs/kernels.md ("Backward memory") comes from this script.
"""

from __future__ import annotations

import argparse
import tracemalloc

import numpy as np

import cuonline
from cuonline.engines import target as target_module
from cuonline.kernels import arguments


class _NoKernel:
    """A launch that writes nothing but row sums of 1 (what a correct kernel reports)."""

    def __call__(self, grid, block, args, shared_mem=0):
        args[arguments.ATTENTION_BWD_SIGNATURE.index("row_sums")][...] = 1


class _NoModule:
    def get_function(self, name):
        return _NoKernel()


def peak_bytes(length, heads, d, **options):
    """Peak bytes tracemalloc sees during one ``attention_backward`` on backend='emulate'
    with the kernels stubbed (inputs and forward results allocated before)."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((heads, length, d)).astype(np.float32)
                     for _ in range(4))
    out = np.zeros_like(q)
    lse = np.zeros((heads, length), dtype=np.float32)
    original = target_module.Target.module
    target_module.Target.module = lambda self, spec: _NoModule()
    try:
        tracemalloc.start()
        cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", **options)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        target_module.Target.module = original
    return peak


def cases(length, heads, rng=np.random.default_rng(1)):
    """The configurations of the table: name -> options."""
    return {
        "no bias-type term": {},
        "head-shared bias (1, L, L)": dict(bias=rng.standard_normal((1, length, length))
                                           .astype(np.float32)),
        "block bias (1, L/8, L/8), 8x8 blocks": dict(
            bias=rng.standard_normal((1, length // 8, length // 8)).astype(np.float32),
            bias_block=8),
        "rel_bias, radius L - 1": dict(rel_bias=rng.standard_normal(2 * length - 1)
                                       .astype(np.float32)),
        "rel_q/rel_k, Dr 16, radius L - 1": dict(
            rel_q=rng.standard_normal((heads, length, 16)).astype(np.float32),
            rel_k=rng.standard_normal((2 * length - 1, 16)).astype(np.float32)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d", type=int, default=64)
    a = parser.parse_args()
    place_bytes = a.heads * a.length * a.length * 4
    print(f"L = {a.length}, {a.heads} heads, D = {a.d}, float32; one (heads, L, L) float32 "
          f"array = {place_bytes / 2**20:.0f} MiB")
    print(f"{'case':36s} {'peak MiB':>10s} {'x (heads, L, L)':>16s}")
    for name, options in cases(a.length, a.heads).items():
        peak = peak_bytes(a.length, a.heads, a.d, **options)
        print(f"{name:36s} {peak / 2**20:10.1f} {peak / place_bytes:16.2f}")


if __name__ == "__main__":
    main()
