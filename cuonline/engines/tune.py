"""``python -m cuonline tune``: time the tile candidates on the current CuPy device.

For each dtype, each D bucket and each family that serves them
(:func:`cuonline.kernels.tuning.targets` on this GPU's arch), every candidate
(:func:`cuonline.kernels.tuning.candidates`) runs through :func:`cuonline.engines.cuda.attention`
with its tiles forced (:func:`cuonline.engines.target.overrides`), is timed with CUDA events
(warm-up, median of a few runs) and checked against the built-in tiles' output; the fastest
that agrees and does not spill wins. :func:`cuonline.engines.tuning_files.store` writes the
document this returns.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from .._validate import validate_attention
from ..kernels import arguments, families, heuristics, tuning
from . import cuda, target, tuning_files

__all__ = ["measure"]


class DeviceRunner:
    """What measuring needs from a device, for one family on one GPU: inputs, a run with
    forced tiles, the compiled kernel's registers and local memory, a timer. (Tests pass a
    stand-in with the same methods to :func:`measure_one`.)"""

    def __init__(self, family, arch, num_sms):
        self.family, self.arch, self.num_sms = family, arch, num_sms

    def _forced(self, table):
        return target.overrides(family=self.family, arch=self.arch, num_sms=self.num_sms,
                                tuned=table)

    def problems(self, dtype, d, shape, precision):
        """One validated problem per causal case, on q, k, v ``(nbatch, n, d)`` from N(0, 1)
        (drawn on the host: bfloat16 goes through ml_dtypes)."""
        import cupy  # noqa: PLC0415

        if dtype == "bfloat16":
            import ml_dtypes  # noqa: PLC0415

            dt = np.dtype(ml_dtypes.bfloat16)
        else:
            dt = np.dtype(dtype)
        rng = np.random.default_rng(0)
        q, k, v = (cupy.asarray(rng.standard_normal((shape["nbatch"], shape["n"], d),
                                                    dtype=np.float32).astype(dt))
                   for _ in range(3))
        return [validate_attention(q, k, v, causal=causal, backend="cupy", precision=precision)
                for causal in shape["causal"]]

    def run(self, problem, table):
        with self._forced(table):
            return cuda.attention(problem)[0]

    def usage(self, problem, table):
        """``(registers, local memory bytes)`` per thread of the forward kernel the engine
        compiled for ``problem`` with ``table`` (CuPy reads them from the loaded module)."""
        with self._forced(table):
            where = target.current("cupy")
        plan = families.plan_attention(
            problem, where.launch(cp_async=arguments.cp_async_aligned(problem)))
        kernel = where.module(plan.spec).get_function(families.of(plan.spec).entries[0])
        return int(kernel.num_regs), int(kernel.local_size_bytes)

    @staticmethod
    def time_ms(fn, repeats):
        """Median milliseconds of ``fn()`` between two CUDA events, after two warm-up calls
        (the first compiles)."""
        import cupy  # noqa: PLC0415

        for _ in range(2):
            fn()
        cupy.cuda.get_current_stream().synchronize()
        times = []
        for _ in range(repeats):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end))
        return statistics.median(times)


def measure(dtypes=("float16", "bfloat16", "float32", "float64"), dims=(64, 128), *,
            quick=False, progress=None) -> dict:
    """Time every candidate on the current CuPy device; return the document
    :func:`cuonline.engines.tuning_files.store` writes.

    q, k, v of shape ``(16, N, D)`` with N = 4096 (``quick``: 2048, non-causal only, the
    built-in's neighbours only), causal off and on; a candidate's time is the median of a few
    runs between CUDA events, summed over the causal cases. A candidate whose output differs
    from the built-in tiles' by more than :data:`~cuonline.kernels.tuning.AGREEMENT`, whose
    kernel uses local memory (spills), or that fails to compile or launch, is recorded with its
    error and skipped. ``progress`` (a callable taking a line) reports each measurement.
    """
    import cupy  # noqa: PLC0415

    say = progress or (lambda line: None)
    shape = tuning.QUICK_SHAPE if quick else tuning.SHAPE
    gpu, arch = tuning_files.device_identity()
    device = cupy.cuda.Device()
    num_sms = int(device.attributes["MultiProcessorCount"])
    smem_limit = int(device.attributes.get("MaxSharedMemoryPerBlockOptin", 0)) or None
    entries = []
    for dtype in dtypes:
        for bucket in sorted({heuristics.d_bucket(d) for d in dims}):
            for family, precision in tuning.targets(dtype, bucket, arch):
                entry = measure_one(DeviceRunner(family, arch, num_sms), family, precision,
                                    dtype, bucket, arch, smem_limit, shape, quick, say)
                if entry is not None:
                    entries.append(entry)
    return {"format": tuning.FORMAT, "cuonline": tuning_files.cuonline_version(), "gpu": gpu,
            "arch": arch, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "entries": entries}


def measure_one(runner, family, precision, dtype, bucket, arch, smem_limit, shape, quick, say):
    """Measure the candidates of one (family, precision, dtype, bucket) with ``runner`` (a
    :class:`DeviceRunner`); return the document entry, or None when none ran."""
    label = f"{family}/{'tf32' if precision == 'tf32' else dtype}/d{bucket}"
    tiles_list = tuning.candidates(arch, dtype, bucket, family, quick=quick,
                                   smem_limit=smem_limit)
    try:
        problems = runner.problems(dtype, bucket, shape, precision)
    except Exception as exc:  # noqa: BLE001 - e.g. bfloat16 without ml_dtypes: skip the key
        say(f"{label}: skipped ({type(exc).__name__}: {exc})")
        return None
    tolerance = tuning.AGREEMENT["tf32" if precision == "tf32" else dtype]
    reference, results = None, []
    for tiles in tiles_list:
        table = {(family, dtype, bucket): tiles}
        row = {"tiles": list(tiles), "key": tuning.spec_of(family, dtype, bucket, tiles).key,
               "ms": None, "registers": None, "error": None}
        try:
            run = [lambda p=p: runner.run(p, table) for p in problems]
            out = run[0]()
            if reference is None:
                reference = out         # the built-in tiles' output (listed first)
            diff = float(abs(out.astype("float64") - reference.astype("float64")).max())
            if not diff <= tolerance:
                raise ValueError(f"output differs from the built-in tiles' by {diff:.3g} "
                                 f"(allowed {tolerance:g})")
            usage = [runner.usage(p, table) for p in problems]
            row["registers"] = max(regs for regs, _ in usage)
            local = max(nbytes for _, nbytes in usage)
            if local:
                # spills (or a stack frame) go to local memory: not a configuration to keep
                raise ValueError(f"uses {local} bytes of local memory per thread (spills)")
            row["ms"] = round(sum(runner.time_ms(fn, shape["repeats"]) for fn in run), 4)
        except Exception as exc:  # noqa: BLE001 - compile, launch or agreement: record, skip
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        results.append(row)
        say(f"{label} {row['key']}: " + (f"{row['ms']:.3f} ms" if row["error"] is None
                                        else f"failed ({row['error']})"))
    timed = [r for r in results if r["error"] is None]
    if not timed:
        return None
    best = min(timed, key=lambda r: r["ms"])
    return {"family": family, "dtype": dtype, "d": bucket, "precision": precision,
            "tiles": best["tiles"], "builtin": list(tiles_list[0]),
            "shape": {"n": shape["n"], "nbatch": shape["nbatch"],
                      "causal": list(shape["causal"]), "repeats": shape["repeats"]},
            "results": results}
