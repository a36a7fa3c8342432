"""cuonline inside JAX and torch on the CPU, beside their own attention: one run, a Markdown table.

* JAX: ``jit(cuonline.jax.attention)`` and ``jit(grad(...))`` beside
  ``jax.nn.dot_product_attention`` (XLA, which forms the score matrix), and the callback's
  overhead against calling cuonline on NumPy arrays directly (``cuonline.attention`` and
  ``cuonline.attention_vjp``).
* torch: ``cuonline.torch.attention`` forward + backward beside
  ``torch.nn.functional.scaled_dot_product_attention`` (its fused CPU kernel).

float32, q, k, v of shape (1, heads, N, 64); the best of ``--repeat`` runs after one warm-up.

    python benchmarks/bench_frameworks.py                 # N = 1024 .. 16384
    python benchmarks/bench_frameworks.py --quick         # N = 256, 512
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cuonline


def best(fn, repeat):
    fn()                                             # warm-up: compiles, caches
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def jax_rows(sizes, heads, repeat):
    import jax
    import jax.numpy as jnp

    import cuonline.jax

    rows = []
    for n in sizes:
        rng = np.random.default_rng(n)
        q, k, v = (rng.standard_normal((1, heads, n, 64)).astype(np.float32) for _ in range(3))
        jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
        ours = jax.jit(lambda q, k, v: cuonline.jax.attention(q, k, v, causal=True))
        ours_grad = jax.jit(jax.grad(
            lambda q, k, v: cuonline.jax.attention(q, k, v, causal=True).sum(), argnums=(0, 1, 2)))
        # jax.nn takes (batch, length, heads, dim)
        xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=True))
        xla_grad = jax.jit(jax.grad(lambda q, k, v: jax.nn.dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=True).sum(),
            argnums=(0, 1, 2)))

        def direct_grad():
            out, vjp = cuonline.attention_vjp(q, k, v, causal=True)
            return vjp(np.ones_like(out))

        t = {
            "direct": best(lambda: cuonline.attention(q, k, v, causal=True), repeat),
            "jit": best(lambda: ours(jq, jk, jv).block_until_ready(), repeat),
            "xla": best(lambda: xla(jq, jk, jv).block_until_ready(), repeat),
            "direct_grad": best(direct_grad, repeat),
            "jit_grad": best(lambda: jax.block_until_ready(ours_grad(jq, jk, jv)), repeat),
            "xla_grad": best(lambda: jax.block_until_ready(xla_grad(jq, jk, jv)), repeat),
        }
        rows.append((n, t))
        print(f"  jax N={n}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()),
              flush=True)
    return rows


def torch_rows(sizes, heads, repeat):
    import torch

    import cuonline.torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for n in sizes:
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, heads, n, 64, generator=gen, requires_grad=True)
                   for _ in range(3))

        def step(attention):
            out = attention(q, k, v)
            out.sum().backward()

        t = {"cuonline": best(lambda: step(lambda q, k, v: cuonline.torch.attention(
                 q, k, v, causal=True)), repeat),
             "sdpa": best(lambda: step(lambda q, k, v: sdpa(q, k, v, is_causal=True)), repeat)}
        rows.append((n, t))
        print(f"  torch N={n}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()),
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 256, 512 (a smoke run)")
    parser.add_argument("--sizes", type=int, nargs="*", help="sequence lengths N")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = args.sizes or ([256, 512] if args.quick else [1024, 2048, 4096, 8192, 16384])
    print(f"float32, causal, q, k, v (1, {args.heads}, N, 64), best of {args.repeat}; paths: "
          f"cuonline.jax = buffer_callback on the CPU -> cuonline's NumPy engine; "
          f"jax.nn.dot_product_attention = XLA (score matrix); torch SDPA = its CPU kernel")
    jax_table = jax_rows(sizes, args.heads, args.repeat)
    torch_table = torch_rows(sizes, args.heads, args.repeat)
    print("\n| N | cuonline NumPy (ms) | jit(cuonline.jax) (ms) | overhead | "
          "jax.nn.dot_product_attention (ms) | vjp NumPy (ms) | jit(grad) cuonline.jax (ms) | "
          "overhead | jit(grad) jax.nn (ms) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, t in jax_table:
        print(f"| {n} | {t['direct'] * 1e3:.1f} | {t['jit'] * 1e3:.1f} | "
              f"{(t['jit'] / t['direct'] - 1) * 100:+.1f}% | {t['xla'] * 1e3:.1f} | "
              f"{t['direct_grad'] * 1e3:.1f} | {t['jit_grad'] * 1e3:.1f} | "
              f"{(t['jit_grad'] / t['direct_grad'] - 1) * 100:+.1f}% | "
              f"{t['xla_grad'] * 1e3:.1f} |")
    print("\n| N | cuonline.torch fwd+bwd (ms) | SDPA fwd+bwd (ms) |")
    print("| ---: | ---: | ---: |")
    for n, t in torch_table:
        print(f"| {n} | {t['cuonline'] * 1e3:.1f} | {t['sdpa'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
