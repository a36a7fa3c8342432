"""CPU benchmark of packed variable-length batches: packed, padded and a loop, forward and backward.

    python benchmarks/bench_varlen.py                     # issue 20: 256 sequences, 20 heads,
                                                          # D 64, float32
    python benchmarks/bench_varlen.py --sequences 2000 --heads 1
    python benchmarks/bench_varlen.py --quick             # a tiny smoke run (CI)

The lengths are a fixed seeded draw shaped like the ESM-2 training data (UniRef): log-normal
with median 286 and mean 325 before clipping to [30, 1024] (the default 256: mean 325, median
284, longest 1024). Self-attention (the queries are the keys) on three layouts of the same
sequences:

* ``packed``: ``cuonline.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)`` on
  ``(H, sum L_b, D)``, work ``sum L_b^2``;
* ``padded``: ``(B, H, L_max, D)`` with ``kv_lengths`` (keys past each length never read) and
  a query mask (``mask`` of shape ``(B, 1, L_max, 1)``: a padded query sees no key, so its
  output is 0 and it adds nothing to the gradients; it is still computed), work
  ``B * L_max * mean L``;
* ``loop``: one call per sequence on ``(H, L_b, D)``.

After the machine's preamble (:func:`bench_cpu.print_machine`), for each it prints the best
wall time (forward; backward with the forward's results held) and
the peak traced allocation during the call (NumPy's memory, tracemalloc) beside the size of
the layout's q, k, v, and how far its outputs are from the packed call's; then packed's
speed-up over padded and over the best of the others. Figures move with whatever else the
machine does: compare ratios of one run.
"""

from __future__ import annotations

import argparse
import tracemalloc

import numpy as np
from bench_cpu import best_seconds, blas_ceiling, print_machine

import cuonline


def lengths(n, seed=0):
    """``n`` UniRef-like lengths: log-normal (median 286, mean 325), clipped to [30, 1024]."""
    rng = np.random.default_rng(seed)
    sigma = np.sqrt(2 * np.log(325 / 286))
    return np.clip(np.round(rng.lognormal(np.log(286), sigma, n)), 30, 1024).astype(np.int64)


def layouts(lens, heads, d, dtype):
    """The three layouts' arguments: name -> list of (q, k, v, keywords) calls."""
    rng = np.random.default_rng(0)
    cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    x = rng.standard_normal((heads, int(cu[-1]), d)).astype(dtype)
    packed = [(x, x, x, {"cu_seqlens_q": cu, "cu_seqlens_k": cu})]
    longest = int(lens.max())
    padded_x = np.zeros((len(lens), heads, longest, d), dtype)
    for b, part in enumerate(cuonline.unpack(x, cu)):
        padded_x[b, :, :lens[b]] = part
    query_mask = (np.arange(longest) < lens[:, None])[:, None, :, None]      # (B, 1, L, 1)
    padded = [(padded_x, padded_x, padded_x,
               {"kv_lengths": lens[:, None], "mask": query_mask})]
    loop = [(s, s, s, {}) for s in cuonline.unpack(x, cu)]
    return {"packed": packed, "padded": padded, "loop": loop}


def run(calls, backward):
    """Run the layout's calls (forward, or backward on held forward results)."""
    if not backward:
        return lambda: [cuonline.attention(q, k, v, **kw) for q, k, v, kw in calls]
    held = []
    for q, k, v, kw in calls:
        out, lse = cuonline.attention(q, k, v, return_lse=True, **kw)
        held.append((np.ones_like(out), q, k, v, out, lse, kw))
    return lambda: [cuonline.attention_backward(g, q, k, v, o, s, **kw)
                    for g, q, k, v, o, s, kw in held]


def sequences_of(name, results, lens):
    """The forward results of layout ``name`` as one (H, L_b, Dv) array per sequence."""
    if name == "packed":
        return cuonline.unpack(results[0], np.concatenate(([0], np.cumsum(lens))))
    if name == "padded":
        return [results[0][b, :, :n] for b, n in enumerate(lens)]
    return results


def peak_bytes(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--layouts", default="packed,padded,loop")
    parser.add_argument("--quick", action="store_true", help="12 sequences, 2 heads, D 16")
    args = parser.parse_args()
    if args.quick:
        args.sequences, args.heads, args.d, args.repeat = 12, 2, 16, 1
    lens = lengths(args.sequences)
    dtype = np.dtype(args.dtype)
    print_machine(f"bench_varlen {args.sequences} sequences, H={args.heads}, D={args.d}",
                  {dtype.name: blas_ceiling(dtype.name, 1 if args.quick else 3)},
                  with_torch=False)
    work = {"packed": int((lens ** 2).sum()), "loop": int((lens ** 2).sum()),
            "padded": int(len(lens) * lens.max() * lens.mean())}
    print(f"{args.sequences} sequences (lengths: mean {lens.mean():.0f}, median "
          f"{np.median(lens):.0f}, max {lens.max()}), {args.heads} heads, D {args.d}, "
          f"{args.dtype}; padded/packed work {work['padded'] / work['packed']:.2f}x")
    print("| layout | forward s | backward s | forward peak MiB | backward peak MiB "
          "| q, k, v MiB | max abs diff vs packed |")
    print("|---|---|---|---|---|---|---|")
    all_layouts = layouts(lens, args.heads, args.d, dtype)
    seconds = {}
    reference = sequences_of("packed", run(all_layouts["packed"], False)(), lens)
    for name in args.layouts.split(","):
        calls = all_layouts[name]
        diff = max(float(np.abs(a - b).max(initial=0.0)) for a, b in
                   zip(sequences_of(name, run(calls, False)(), lens), reference))
        inputs = 3 * sum(q.nbytes for q, *_ in calls)     # q, k and v as separate arrays
        forward = best_seconds(run(calls, False), args.repeat)
        backward_fn = run(calls, True)
        backward = best_seconds(backward_fn, args.repeat)
        seconds[name] = (forward, backward)
        peaks = [peak_bytes(run(calls, False)), peak_bytes(backward_fn)]
        print(f"| {name} | {forward:.3f} | {backward:.3f} | {peaks[0] / 2**20:.0f} "
              f"| {peaks[1] / 2**20:.0f} | {inputs / 2**20:.0f} | {diff:.1e} |", flush=True)

    if "packed" in seconds and len(seconds) > 1:
        for n, part in enumerate(("forward", "backward")):
            others = {k: t[n] for k, t in seconds.items() if k != "packed"}
            best = min(others, key=others.get)
            padded = (f"{others['padded'] / seconds['packed'][n]:.2f}x padded, "
                      if "padded" in others else "")
            print(f"packed {part}: {padded}{others[best] / seconds['packed'][n]:.2f}x the "
                  f"best of the others ({best})")


if __name__ == "__main__":
    main()
