"""CPU benchmark: cuonline's NumPy engine beside torch's fused CPU kernel, in one run.

    python benchmarks/bench_cpu.py                      # the 16-case table of issue 11
    python benchmarks/bench_cpu.py --lengths 16384 --dims 64 --dtypes float32
    python benchmarks/bench_cpu.py --quick              # a tiny smoke run (CI)
    python benchmarks/bench_cpu.py --one-core           # per-core efficiency on a busy machine

For every case (N, D, dtype, causal) it times, on the same (B=1, H, N, D) arrays:

* ``cuonline``: ``cuonline.attention`` (NumPy engine, its thread pool);
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on 4-D inputs, which is what
  selects torch's fused CPU flash kernel; the column ``torch path`` prints the backend torch
  chose (``torch._fused_sdp_choice``), so a comparison against its unfused math path cannot pass
  unnoticed;
* ``naive``: ``softmax(q kᵀ) v`` with the scores materialised, where they fit --naive-limit-gib.

Throughput counts 4 * Lq * Lk * D FLOPs per head, halved when causal. The BLAS ceiling (a
2048 x 2048 matrix product per dtype, all cores, the fastest of NumPy's, cuonline's and torch's
product libraries: ``blas_ceiling``) is measured in the same run and each engine's fraction of
it printed. The preamble names the machine: CPU, load, the instruction sets numba
and BLAS use (an ``OPENBLAS_CORETYPE`` that holds OpenBLAS to older kernels shows there), the
caches and the tile shapes the engine takes from them. The summary gives the geometric mean
and the worst of cuonline / torch. Finally cuonline alone at --memory-length reports its peak
traced allocation beside the output size. Figures move with whatever else the machine does:
compare ratios of one run.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import time
import tracemalloc

import numpy as np

import cuonline


def naive(q, k, v, causal):
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(1 / math.sqrt(q.shape[-1]))
    if causal:
        s[..., np.triu(np.ones(s.shape[-2:], dtype=bool), 1)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def torch_sdpa():
    """``(run, path)``: torch's SDPA on the given NumPy arrays and the name of the backend it
    picks for them; ``(None, None)`` without torch."""
    try:
        import torch
        from torch.nn.attention import SDPBackend
    except ImportError:
        return None, None
    names = {int(getattr(SDPBackend, n)): n.lower() for n in dir(SDPBackend) if n.isupper()}

    def run(q, k, v, causal):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), is_causal=causal
            ).numpy()

    def path(q, k, v, causal):
        t = [torch.from_numpy(x) for x in (q, k, v)]
        return names.get(int(torch._fused_sdp_choice(*t, None, 0.0, causal)), "unknown")

    return run, path


def print_machine(title, ceilings, with_torch):
    """The first lines of a CPU benchmark's report, so a figure says which machine it belongs
    to: what ran (``title``), the CPU model and cores, the load average, the instruction sets
    numba compiles the tile kernels for and the kernel set BLAS chose, the caches and the tile
    shapes the engines take from them, NumPy's and torch's versions (torch's own vector
    level), and BLAS's measured ceiling per dtype (``ceilings``)."""
    from cuonline.engines import numpy as forward
    from cuonline.engines import cpu_blas
    from cuonline.engines import numpy_backward as backward
    from cuonline.engines.cpu_runtime import machine

    info = machine()
    torch = "torch not installed"
    if with_torch:
        import torch as t

        torch = f"torch {t.__version__} ({t.backends.cpu.get_cpu_capability()})"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{title}; CPU {info['cpu']}, {info['cores']} cores; load average {load}")
    print("BLAS: " + info["blas"])
    print("cuonline's products: " + cpu_blas.describe())
    cores = "one core" if CLOCK is time.process_time else "all cores"
    print(f"BLAS ceiling (2048^3 matmul, {cores}, the fastest library): "
          + ", ".join(f"{dt} {g:.1f} GFLOP/s (" + ", ".join(
              f"{name} {x:.1f}" for name, x in CEILING_SOURCES.get(dt, {}).items()) + ")"
              for dt, g in ceilings.items()))
    print(f"numpy {np.__version__}; {torch}; numba target {info['numba']}")
    caches = info["caches"]
    print("caches per core: " + ", ".join(f"{k} {v // 1024} KiB" for k, v in caches.items())
          + "; tiles (rows x keys): " + ", ".join(
              f"{dt} forward {'x'.join(map(str, forward.blocks(dt)))} backward "
              f"{'x'.join(map(str, backward.blocks(dt)))}" for dt in ceilings))
    print(f"times: the best of {'at least ' if MIN_SECONDS else ''}--repeat runs after one "
          "warm-up" + (f", and of more until a case's runs add up to {MIN_SECONDS:g} s "
                       f"(at most {MAX_REPEAT})" if MIN_SECONDS else "")
          + "; runs back to back, the garbage collector off")


# what best_seconds reads: wall time, or with --one-core this process's CPU time
CLOCK = time.perf_counter
_one_core_limits = None


def use_one_core():
    """--one-core: every engine on one thread (cuonline ``workers=1``, BLAS and torch held to
    one thread) and times read as this process's CPU time, which other processes' load
    inflates far less than wall time: the per-core efficiency, comparable on a busy machine.
    Returns the ``workers`` to pass to cuonline."""
    global CLOCK, _one_core_limits
    from threadpoolctl import threadpool_limits

    _one_core_limits = threadpool_limits(limits=1)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    CLOCK = time.process_time
    return 1


# bench_cpu and bench_backward time a short call again until its runs add up to
# --min-seconds (at most MAX_REPEAT runs): the best of 3 runs of a 10 ms call moved by 20-40%
# between tables on 2-core machines, with whatever ran just before (the other library's
# threads) in it. Other scripts keep exactly their --repeat (MIN_SECONDS 0).
DEFAULT_MIN_SECONDS = 0.5
MIN_SECONDS = 0.0
MAX_REPEAT = 100


def best_seconds(fn, repeat, min_seconds=None):
    """Best time (wall, or CPU with --one-core) of at least ``repeat`` runs after one warm-up,
    and of more until they total ``min_seconds`` (default :data:`MIN_SECONDS`; at most
    :data:`MAX_REPEAT` runs).

    The runs follow each other with the garbage collector off, as ``timeit`` times them (one
    collection before the first): a collection before each run (what this function did until
    2026-12-04) took 165 ms with torch loaded, and the run after it started with cold caches
    and sleeping threads: cuonline at N 128, H 64 took 3.1 ms after one and 1.8 ms without."""
    min_seconds = MIN_SECONDS if min_seconds is None else min_seconds
    gc.collect()
    fn()
    best, total, runs = float("inf"), 0.0, 0
    collecting = gc.isenabled()
    gc.disable()
    try:
        while runs < repeat or (total < min_seconds and runs < MAX_REPEAT):
            start = CLOCK()
            fn()
            took = CLOCK() - start
            best, total, runs = min(best, took), total + took, runs + 1
    finally:
        if collecting:
            gc.enable()
    return best


# dtype -> {library: GFLOP/s} of the last blas_ceiling, for the preamble
CEILING_SOURCES: dict = {}


def blas_ceiling(dtype, repeat, n=2048):
    """GFLOP/s of an n x n x n matrix product in ``dtype``: the best of NumPy's ``@`` (all of
    its BLAS's threads), the library cuonline's engines multiply with
    (``cuonline.engines.cpu_blas``, row blocks on as many threads as cuonline's tasks) and
    torch's ``matmul`` where torch is installed (its own threads): the machine's ceiling is
    the fastest product any of them reaches, not only NumPy's. Each one is kept in
    ``CEILING_SOURCES`` for the preamble."""
    from concurrent.futures import ThreadPoolExecutor

    from cuonline.engines import cpu_blas, cpu_runtime

    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    out = np.empty((n, n), dtype=dtype)
    threads = 1 if CLOCK is time.process_time else cpu_runtime.workers()
    rows = [(r, min(r + -(-n // threads), n)) for r in range(0, n, -(-n // threads))]

    def ours():
        with cpu_runtime.single_threaded_blas(), ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda r: cpu_blas.product(a[r[0]:r[1]], b, out[r[0]:r[1]]), rows))

    sources = {"numpy": lambda: a @ b, "cuonline": ours}
    try:
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        sources["torch"] = lambda: torch.matmul(ta, tb)
    except ImportError:
        pass
    CEILING_SOURCES[dtype] = {name: 2 * n**3 / best_seconds(fn, repeat) / 1e9
                              for name, fn in sources.items()}
    return max(CEILING_SOURCES[dtype].values())


def case_arguments(parser):
    """The case grid the CPU benchmarks share: ``--lengths``, ``--dims``, ``--dtypes`` and
    ``--heads`` (inputs of shape (1, heads, N, D)), with the defaults of the tables in
    docs/performance.md, and ``--spread`` (:func:`case_inputs`)."""
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--spread", type=float, default=1.0,
                        help="standard deviation of q and k (default 1): at 6 and N 1024, "
                             "most of a row's weights are below the smallest normal float32, "
                             "as in a model whose attention is sharp")


def case_inputs(rng, args, n, d, dtype, count):
    """``count`` arrays of shape (1, heads, n, d) drawn from the standard normal distribution,
    the first two (q and k) times ``--spread``."""
    arrays = [rng.standard_normal((1, args.heads, n, d)).astype(dtype) for _ in range(count)]
    for x in arrays[:2]:
        x *= np.dtype(dtype).type(args.spread)
    return arrays


def case_title(args):
    """The grid's line of a report's title: ``B=1 H=8``, and the spread where it is not 1."""
    return f"B=1 H={args.heads}" + (f", q and k of spread {args.spread:g}"
                                    if args.spread != 1 else "")


# The ceiling measured again after the cases may differ from the first by this fraction
# before a run's figures count as taken on a machine whose speed held.
CEILING_DRIFT = 0.15


def check_ceilings(ceilings, repeat):
    """Measure the BLAS ceilings again and print them beside the first ones (``ceilings``):
    on a shared machine a neighbour's load can halve a core's speed for a minute, and a table
    taken then says so here rather than passing for the machine's figures."""
    again = {dt: blas_ceiling(dt, repeat) for dt in ceilings}
    drift = max(abs(again[dt] / ceilings[dt] - 1) for dt in ceilings)
    verdict = ("steady" if drift <= CEILING_DRIFT else
               f"moved by {drift:.0%}: the machine's speed changed during this run, "
               "do not quote its figures")
    print("BLAS ceiling again after the cases: " + ", ".join(
        f"{dt} {again[dt]:.1f} GFLOP/s (first {ceilings[dt]:.1f})" for dt in ceilings)
        + f"; {verdict}")
    return drift <= CEILING_DRIFT


def use_min_seconds(seconds):
    """What :func:`best_seconds` takes for ``min_seconds`` from now on."""
    global MIN_SECONDS
    MIN_SECONDS = seconds


def min_seconds_argument(parser):
    parser.add_argument("--min-seconds", type=float, default=DEFAULT_MIN_SECONDS,
                        help="time a short call again until its runs add up to this many "
                             f"seconds (at most {MAX_REPEAT} runs); 0: exactly --repeat runs")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_arguments(parser)
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--repeat", type=int, default=3)
    min_seconds_argument(parser)
    parser.add_argument("--naive-limit-gib", type=float, default=1.0)
    parser.add_argument("--memory-length", type=int, default=32768)
    parser.add_argument("--few-queries", action="store_true",
                        help="also: a few queries against long keys (Lq 1 and 16, Lk to 10**6)")
    parser.add_argument("--softmax", action="store_true",
                        help="also: the softmax family beside scipy.special")
    parser.add_argument("--plot", metavar="SVG",
                        help="also: GFLOP/s against N (D 64, float32) for each engine, as SVG")
    parser.add_argument("--one-core", action="store_true",
                        help="everything on one thread, timed as CPU time (see use_one_core)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one repeat: checks that the script runs")
    args = parser.parse_args(argv)
    workers = use_one_core() if args.one_core else None
    if args.quick:
        args.lengths, args.dims, args.heads, args.repeat = [256], [64], 2, 1
        args.memory_length = 1024
        args.few_lengths, args.softmax_shape, args.plot_lengths = [4096], (64, 512), [256, 512]
    else:
        args.few_lengths, args.softmax_shape = [100_000, 1_000_000], (4096, 4096)
        args.plot_lengths = [512, 1024, 2048, 4096, 8192, 16384]
    use_min_seconds(0 if args.quick else args.min_seconds)

    torch_run, torch_path = torch_sdpa()
    causal_cases = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    ceilings = {dt: blas_ceiling(dt, args.repeat) for dt in args.dtypes}
    print_machine(case_title(args) + (", one core, CPU time" if args.one_core else ""),
                  ceilings, torch_run is not None)
    header = (f"| {'N':>5} | {'D':>3} | {'dtype':<7} | causal | cuonline | torch | torch path      "
              f"| naive | cuonline/torch | cuonline/BLAS |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")

    rng = np.random.default_rng(0)
    ratios = []
    for n, d, dt, causal in itertools.product(args.lengths, args.dims, args.dtypes,
                                              causal_cases):
        q, k, v = case_inputs(rng, args, n, d, dt, 3)
        gflop = 4 * args.heads * n * n * d / (2 if causal else 1) / 1e9
        ours = gflop / best_seconds(
            lambda: cuonline.attention(q, k, v, causal=causal, workers=workers), args.repeat)
        theirs, path = float("nan"), "-"
        if torch_run is not None:
            path = torch_path(q, k, v, causal)
            theirs = gflop / best_seconds(lambda: torch_run(q, k, v, causal), args.repeat)
            ratios.append(ours / theirs)
        naive_gib = args.heads * n * n * np.dtype(dt).itemsize / 2**30
        slow = ("-" if naive_gib > args.naive_limit_gib else
                f"{gflop / best_seconds(lambda: naive(q, k, v, causal), args.repeat):.1f}")
        print(f"| {n:>5} | {d:>3} | {dt:<7} | {'yes' if causal else 'no':<6} | {ours:>8.1f} "
              f"| {theirs:>5.1f} | {path:<15} | {slow:>5} | {ours / theirs:>14.2f} "
              f"| {ours / ceilings[dt]:>13.2f} |")
    if ratios:
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"cuonline / torch over {len(ratios)} cases: geometric mean {geomean:.2f}, "
              f"worst {min(ratios):.2f}")
    check_ceilings(ceilings, args.repeat)

    if args.few_queries:
        few_queries(args, torch_run, torch_path, rng)
    if args.softmax:
        softmax_family(args, rng)
    if args.plot:
        plot(args, torch_run, rng)

    n, d = args.memory_length, 64
    q, k, v = (rng.standard_normal((args.heads, n, d), dtype=np.float32) for _ in range(3))
    tracemalloc.start()
    start = time.perf_counter()
    cuonline.attention(q, k, v)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    output = args.heads * n * d * 4
    print(f"memory: N={n} H={args.heads} D={d} float32: cuonline peak traced allocation "
          f"{peak / 2**20:.1f} MiB (output {output / 2**20:.1f} MiB; naive scores would need "
          f"{args.heads * n * n * 4 / 2**30:.1f} GiB); {seconds:.1f} s")


def few_queries(args, torch_run, torch_path, rng):
    """A few queries scored against a long sequence: the engine splits the keys across cores."""
    print("few queries, long keys (B=1 H=1 D=64 float32):")
    print(f"| {'Lq':>3} | {'Lk':>8} | cuonline | torch | torch path      | cuonline/torch |")
    print("|-----|----------|----------|-------|-----------------|----------------|")
    for lk, lq in itertools.product(args.few_lengths, [1, 16]):
        q = rng.standard_normal((1, 1, lq, 64), dtype=np.float32)
        k, v = (rng.standard_normal((1, 1, lk, 64), dtype=np.float32) for _ in range(2))
        gflop = 4 * lq * lk * 64 / 1e9
        ours = gflop / best_seconds(lambda: cuonline.attention(q, k, v), args.repeat)
        theirs, path = float("nan"), "-"
        if torch_run is not None:
            path = torch_path(q, k, v, False)
            theirs = gflop / best_seconds(lambda: torch_run(q, k, v, False), args.repeat)
        print(f"| {lq:>3} | {lk:>8} | {ours:>8.2f} | {theirs:>5.2f} | {path:<15} "
              f"| {ours / theirs:>14.2f} |")


def softmax_family(args, rng):
    """cuonline's softmax, log_softmax and logsumexp beside scipy.special's, last axis."""
    import scipy.special

    print(f"softmax family, shape {args.softmax_shape}, last axis (G elements/s):")
    print("| function    | dtype   | cuonline | scipy | cuonline/scipy |")
    print("|-------------|---------|----------|-------|----------------|")
    for name, dt in itertools.product(["softmax", "log_softmax", "logsumexp"], args.dtypes):
        x = rng.standard_normal(args.softmax_shape).astype(dt)
        ours = x.size / best_seconds(lambda: getattr(cuonline, name)(x), args.repeat) / 1e9
        ref = getattr(scipy.special, name)
        theirs = x.size / best_seconds(lambda: ref(x, axis=-1), args.repeat) / 1e9
        print(f"| {name:<11} | {dt:<7} | {ours:>8.2f} | {theirs:>5.2f} | {ours / theirs:>14.2f} |")


def plot(args, torch_run, rng):
    """Write an SVG line plot of GFLOP/s against N (D = 64, float32, not causal)."""
    engines = {"cuonline": lambda q, k, v: cuonline.attention(q, k, v)}
    if torch_run is not None:
        engines["torch (fused)"] = lambda q, k, v: torch_run(q, k, v, False)
    engines["naive NumPy"] = lambda q, k, v: naive(q, k, v, False)
    series = {name: [] for name in engines}
    for n in args.plot_lengths:
        q, k, v = (rng.standard_normal((1, args.heads, n, 64), dtype=np.float32)
                   for _ in range(3))
        gflop = 4 * args.heads * n * n * 64 / 1e9
        for name, fn in engines.items():
            if name == "naive NumPy" and args.heads * n * n * 4 / 2**30 > args.naive_limit_gib:
                continue
            series[name].append((n, gflop / best_seconds(lambda: fn(q, k, v), args.repeat)))
    with open(args.plot, "w", encoding="utf-8") as f:
        f.write(svg_lines(series, f"H={args.heads}, D=64, float32, not causal",
                          "sequence length N (log scale)", "GFLOP/s"))
    print(f"plot: {args.plot}: " + "; ".join(
        f"{name} " + ", ".join(f"{n}:{g:.0f}" for n, g in pts) for name, pts in series.items()))


def svg_lines(series, title, xlabel, ylabel, width=640, height=400):
    """A small dependency-free SVG line chart: log2 x axis, linear y axis from 0."""
    colors = ["#1f77b4", "#d62728", "#7f7f7f", "#2ca02c"]
    left, right, top, bottom = 60, 150, 30, 50
    xs = [n for pts in series.values() for n, _ in pts]
    y_max = max(g for pts in series.values() for _, g in pts) * 1.1
    x0, x1 = math.log2(min(xs)), math.log2(max(xs))

    def px(n):
        return left + (math.log2(n) - x0) / max(x1 - x0, 1e-9) * (width - left - right)

    def py(g):
        return height - bottom - g / y_max * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{py(0)}" x2="{width - right}" y2="{py(0)}" stroke="black"/>',
           f'<line x1="{left}" y1="{py(0)}" x2="{left}" y2="{top}" stroke="black"/>',
           f'<text x="{(left + width - right) / 2}" y="{height - 12}" '
           f'text-anchor="middle">{xlabel}</text>',
           f'<text x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 14 {(top + height - bottom) / 2})">{ylabel}</text>']
    for n in sorted(set(xs)):
        out.append(f'<text x="{px(n):.1f}" y="{py(0) + 16}" text-anchor="middle">{n}</text>')
    step = 10 ** math.floor(math.log10(y_max / 2)) * (5 if y_max / 10 ** math.floor(
        math.log10(y_max / 2)) > 10 else 1)
    for i in range(int(y_max / step) + 1):
        g = i * step
        out.append(f'<text x="{left - 6}" y="{py(g) + 4:.1f}" text-anchor="end">{g:g}</text>')
        out.append(f'<line x1="{left}" y1="{py(g):.1f}" x2="{width - right}" y2="{py(g):.1f}" '
                   f'stroke="#ddd"/>')
    for (name, pts), color in zip(series.items(), colors):
        if not pts:
            continue
        path = " ".join(f"{px(n):.1f},{py(g):.1f}" for n, g in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for n, g in pts:
            out.append(f'<circle cx="{px(n):.1f}" cy="{py(g):.1f}" r="3" fill="{color}"/>')
        y = top + 20 * (1 + list(series).index(name))
        out.append(f'<line x1="{width - right + 10}" y1="{y - 4}" x2="{width - right + 30}" '
                   f'y2="{y - 4}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - right + 35}" y="{y}">{name}</text>')
    out.append("</svg>\n")
    return "\n".join(out)


if __name__ == "__main__":
    main()
