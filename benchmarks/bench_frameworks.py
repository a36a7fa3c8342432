"""cuonline inside JAX and torch on the CPU, beside their own attention: one run, Markdown tables.

* JAX: ``jit(cuonline.jax.attention)`` and ``jit(grad(...))`` beside
  ``jax.nn.dot_product_attention`` (XLA, which forms the score matrix), and the callback's
  overhead against calling cuonline on NumPy arrays directly (``cuonline.attention`` and
  ``cuonline.attention_vjp``).
* torch: ``cuonline.torch.attention`` forward + backward beside
  ``torch.nn.functional.scaled_dot_product_attention`` (its fused CPU kernel).

float32, causal, q, k, v of shape (1, heads, N, 64). Time: the best of ``--repeat`` runs after
one warm-up, in this process. Peak memory: each path once more in a fresh process (so no
allocator keeps memory from another path), after compiling (XLA ahead of time at size N,
cuonline's NumPy kernels at a small size): the high-water mark of its resident memory
(``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``) above the resident
memory just before the call, inputs excluded, with glibc's mmap threshold fixed so that
memory freed earlier is not reused unseen. Linux only for the memory columns.

    python benchmarks/bench_frameworks.py                 # N = 1024 .. 16384
    python benchmarks/bench_frameworks.py --quick         # N = 256, 512
    python benchmarks/bench_frameworks.py --no-memory     # times only
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import cuonline

#: the JAX and torch paths, in table order: name -> what it runs
JAX_PATHS = {
    "direct": "cuonline.attention on NumPy arrays",
    "jit": "jit(cuonline.jax.attention)",
    "xla": "jit(jax.nn.dot_product_attention)",
    "direct_grad": "cuonline.attention_vjp on NumPy arrays, forward + backward",
    "jit_grad": "jit(grad(cuonline.jax.attention))",
    "xla_grad": "jit(grad(jax.nn.dot_product_attention))",
}
TORCH_PATHS = {
    "torch": "cuonline.torch.attention forward + backward",
    "sdpa": "scaled_dot_product_attention forward + backward",
}


def best(fn, repeat):
    fn()                                             # warm-up: compiles, caches
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def inputs(n, heads):
    rng = np.random.default_rng(n)
    return tuple(rng.standard_normal((1, heads, n, 64)).astype(np.float32) for _ in range(3))


def jax_path(name, q, k, v, compile_ahead=False):
    """A callable running JAX path ``name`` on NumPy inputs ``q, k, v`` (compiled for their
    shapes ahead of time with ``compile_ahead``)."""
    import jax
    import jax.numpy as jnp

    import cuonline.jax

    if name == "direct":
        return lambda: cuonline.attention(q, k, v, causal=True)
    if name == "direct_grad":
        def direct_grad():
            out, vjp = cuonline.attention_vjp(q, k, v, causal=True)
            return vjp(np.ones_like(out))
        return direct_grad

    def ours(q, k, v):
        return cuonline.jax.attention(q, k, v, causal=True)

    def xla(q, k, v):                   # jax.nn takes (batch, length, heads, dim)
        return jax.nn.dot_product_attention(q.swapaxes(1, 2), k.swapaxes(1, 2),
                                            v.swapaxes(1, 2), is_causal=True)

    function = {"jit": ours, "xla": xla}.get(name)
    if function is None:
        base = {"jit_grad": ours, "xla_grad": xla}[name]
        function = jax.grad(lambda q, k, v: base(q, k, v).sum(), argnums=(0, 1, 2))
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    program = jax.jit(function)
    if compile_ahead:
        program = program.lower(jq, jk, jv).compile()
    return lambda: jax.block_until_ready(program(jq, jk, jv))


def torch_path(name, q, k, v):
    import torch

    import cuonline.torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
    attention = ((lambda: cuonline.torch.attention(tq, tk, tv, causal=True)) if name == "torch"
                 else (lambda: sdpa(tq, tk, tv, is_causal=True)))

    def step():
        attention().sum().backward()
        for x in (tq, tk, tv):
            x.grad = None
    return step


def path(name, q, k, v, compile_ahead=False):
    if name in TORCH_PATHS:
        return torch_path(name, q, k, v)
    return jax_path(name, q, k, v, compile_ahead)


# --------------------------------------------------------------------------------------------
# peak memory, one path per process


def _status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_peak(name, n, heads):
    """Run in a fresh process: the peak resident memory of path ``name`` above what was
    resident just before it, in bytes."""
    path(name, *inputs(64, heads))()                 # compile cuonline's NumPy kernels
    fn = path(name, *inputs(n, heads), compile_ahead=True)
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")    # VmHWM := VmRSS
    fn()
    return _status("VmHWM") - before


def peak(name, n, heads):
    # glibc's malloc serves large blocks by mmap only above a threshold that grows as blocks
    # are freed, and keeps freed heap resident: a fixed 64 KiB threshold returns every large
    # block to the system when freed and counts every new one in the resident memory
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, __file__, "--peak-of", name, str(n), str(heads)],
                          capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        print(f"  peak of {name} at N={n} failed: {tail[:160]}", flush=True)
        return None
    return int(proc.stdout.split()[-1])


def mib(x):
    return "-" if x is None else f"{x / 2**20:.1f}"


# --------------------------------------------------------------------------------------------


def rows(paths, sizes, heads, repeat, memory):
    table = []
    for n in sizes:
        q, k, v = inputs(n, heads)
        t = {name: best(path(name, q, k, v), repeat) for name in paths}
        m = {name: peak(name, n, heads) for name in paths} if memory else {}
        table.append((n, t, m))
        print(f"  N={n}: " + ", ".join(f"{p} {t[p] * 1e3:.1f} ms" + (
            f" {mib(m[p])} MiB" if memory else "") for p in paths), flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 256, 512 (a smoke run)")
    parser.add_argument("--sizes", type=int, nargs="*", help="sequence lengths N")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="times only (the memory columns run each path in a new process)")
    parser.add_argument("--peak-of", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of:
        name, n, heads = args.peak_of
        print(measure_peak(name, int(n), int(heads)))
        return
    sizes = args.sizes or ([256, 512] if args.quick else [1024, 2048, 4096, 8192, 16384])
    print(f"float32, causal, q, k, v (1, {args.heads}, N, 64), best of {args.repeat}; paths: "
          f"cuonline.jax = buffer_callback on the CPU -> cuonline's NumPy engine; "
          f"jax.nn.dot_product_attention = XLA (score matrix); torch SDPA = its CPU kernel; "
          f"peak memory above the inputs, one process per path", flush=True)
    jax_table = rows(JAX_PATHS, sizes, args.heads, args.repeat, args.memory)
    torch_table = rows(TORCH_PATHS, sizes, args.heads, args.repeat, args.memory)

    def ms(t, p):
        return f"{t[p] * 1e3:.1f}"

    print("\nForward (ms; peak MiB):\n")
    print("| N | cuonline NumPy | jit(cuonline.jax) | overhead | jax.nn.dot_product_attention | "
          "peak NumPy | peak cuonline.jax | peak jax.nn |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, t, m in jax_table:
        print(f"| {n} | {ms(t, 'direct')} | {ms(t, 'jit')} | "
              f"{(t['jit'] / t['direct'] - 1) * 100:+.1f}% | {ms(t, 'xla')} | "
              f"{mib(m.get('direct'))} | {mib(m.get('jit'))} | {mib(m.get('xla'))} |")
    print("\nForward + backward (ms; peak MiB):\n")
    print("| N | vjp NumPy | jit(grad) cuonline.jax | overhead | jit(grad) jax.nn | "
          "peak NumPy | peak cuonline.jax | peak jax.nn |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, t, m in jax_table:
        print(f"| {n} | {ms(t, 'direct_grad')} | {ms(t, 'jit_grad')} | "
              f"{(t['jit_grad'] / t['direct_grad'] - 1) * 100:+.1f}% | {ms(t, 'xla_grad')} | "
              f"{mib(m.get('direct_grad'))} | {mib(m.get('jit_grad'))} | "
              f"{mib(m.get('xla_grad'))} |")
    print("\ntorch, forward + backward (ms; peak MiB):\n")
    print("| N | cuonline.torch | SDPA | peak cuonline.torch | peak SDPA |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n, t, m in torch_table:
        print(f"| {n} | {ms(t, 'torch')} | {ms(t, 'sdpa')} | {mib(m.get('torch'))} | "
              f"{mib(m.get('sdpa'))} |")


if __name__ == "__main__":
    main()
