"""Helpers shared by the test modules (``conftest.py`` keeps only fixtures and hooks).

Three parts: what this machine can run (dtypes, the accuracy rule, the engines, one skip marker
per missing tool); ThreadSanitizer subprocesses; and the attention cases and runners that several
test modules, and the TSan subprocesses they start, have in common. A subprocess imports this
module (``tests/`` is on its ``sys.path``), never a test module.
"""

from __future__ import annotations

import functools
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from oracle import (naive_attention, naive_attention_backward, naive_attention_stats,
                    reference_attention, reference_attention_backward, reference_attention_stats)

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------
# dtypes and the accuracy rule: the one rule for every comparison of an engine's attention,
# gradients or statistics with the float64 oracle (check_attention, check_gradients,
# check_stats, assert_accurate); a check that two engines agree is a check of each
# against the oracle by this rule

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:   # optional: bfloat16 cases are skipped without it
    BFLOAT16 = None

DTYPES = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])

# One accuracy rule for every engine, forward and backward (FlashAttention's; stated in
# docs/semantics.md, "Dtypes and accuracy"): a result's error against the float64 oracle is at
# most ACCURACY_FACTOR times the error of the naive computation in the same precision
# (oracle.naive_attention, oracle.naive_attention_backward), plus ACCURACY_FLOOR of the
# result's magnitude (at least 1). The floor decides for float64, whose naive computation is
# the oracle up to ~1e-16, and absorbs what float32 kernels inherit from a float32 forward
# (its out and lse: errors of 2-4x the naive one, measured).
ACCURACY_FACTOR = 2.0
ACCURACY_FLOOR = {
    np.dtype(np.float64): 1e-13,
    np.dtype(np.float32): 1e-6,
    "tf32": 1e-6,
    np.dtype(np.float16): 1e-5,
}
if BFLOAT16 is not None:
    ACCURACY_FLOOR[BFLOAT16] = 1e-4

# A deliberately broken kernel (tests/mutants.py) must miss the accuracy rule by this factor at
# least, so that its failure is the edit's and not a rounding that happens to exceed the rule.
MUTANT_MARGIN = 100.0


def peak_traced_bytes(fn, warm_up=()):
    """``(peak, result)``: the peak of memory traced by tracemalloc (NumPy reports to it) while
    ``fn()`` runs, beyond what was traced before. ``warm_up`` calls run first, untraced: the
    first call of a process compiles the NumPy engine's tile kernel (numba), a one-time cost
    that is not a call's working memory."""
    import tracemalloc

    for call in warm_up:
        call()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


def precision_of(dtype, precision="highest"):
    """The precision a computation in ``dtype`` runs at: ``"tf32"`` for float32 products at
    ``precision="tf32"``, else the dtype (the key of ACCURACY_FLOOR and the oracle's
    ``rounding``)."""
    dtype = np.dtype(dtype)
    return "tf32" if precision == "tf32" and dtype == np.float32 else dtype


def accumulation_of(dtype):
    """The dtype of ``lse`` and of the accumulations: float64 for float64, else float32."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def accuracy(got, exact, naive, precision):
    """``(err, limit)`` of the accuracy rule: ``err = max |got - exact|`` over the entries where
    ``exact`` is finite (inf where ``got`` does not repeat its non-finite entries, or is NaN
    where it is finite), ``limit = ACCURACY_FACTOR * max |naive - exact| +
    ACCURACY_FLOOR[precision] * max(1, max |exact|)``. A result returned in a narrower dtype
    than the computation's (a float32 bias gradient beside float64 q) is rounded once more:
    its epsilon joins the floor."""
    return _accuracy(got, exact, naive, precision)[:2]


def _accuracy(got, exact, naive, precision, inherited=0.0):
    got, exact = np.asarray(got), np.asarray(exact)
    assert got.shape == exact.shape, f"shape {got.shape} != {exact.shape}"
    finite = np.isfinite(exact)
    got64, exact64 = got[finite].astype(np.float64), exact[finite]
    naive_err = float(np.max(np.abs(np.asarray(naive)[finite] - exact64), initial=0.0))
    magnitude = max(1.0, float(np.max(np.abs(exact64), initial=0.0)))
    floor = ACCURACY_FLOOR[precision] + inherited
    computed = np.dtype(np.float32 if isinstance(precision, str) else precision)
    if got.dtype != computed and got.dtype.itemsize < accumulation_of(computed).itemsize:
        floor += float(np.finfo(got.dtype).eps)
    limit = ACCURACY_FACTOR * naive_err + floor * magnitude
    if not np.array_equal(got[~finite].astype(np.float64), exact[~finite], equal_nan=True):
        return float("inf"), limit, naive_err
    diff = np.abs(got64 - exact64)
    err = float("inf") if np.isnan(diff).any() else float(np.max(diff, initial=0.0))
    return err, limit, naive_err


def assert_accurate(name, got, exact, naive, precision, inherited=0.0):
    """Assert the accuracy rule (:func:`accuracy`) for the result ``name``; ``(err, limit)``.
    ``inherited`` joins the floor: the relative error a gradient takes from the stored ``lse``
    (:func:`lse_rounding`)."""
    got, exact = np.asarray(got), np.asarray(exact)
    assert got.shape == exact.shape, f"{name}: shape {got.shape} != {exact.shape}"
    finite = np.isfinite(exact)
    assert np.array_equal(got[~finite].astype(np.float64), exact[~finite], equal_nan=True), (
        f"{name}: non-finite entries differ")
    err, limit, naive_err = _accuracy(got, exact, naive, precision, inherited)
    assert err <= limit, f"{name}: error {err:.3g} > {limit:.3g} (naive {naive_err:.3g})"
    return err, limit


def _attention_results(q, k, v, out, lse, options, precision):
    """``(name, got, exact, naive, precision)`` of ``out`` and ``lse`` (when not None) of
    ``attention(q, k, v, **options)``: ``out`` against the naive computation in q's precision,
    ``lse`` against the naive one in the accumulation dtype (the scores a 16-bit engine sums
    in float32)."""
    options = {n: x for n, x in options.items() if n != "return_lse"}
    ref_out, ref_lse = reference_attention(q, k, v, **options)
    rounding = precision_of(q.dtype, precision)
    naive_out, naive_lse = naive_attention(q, k, v, rounding=rounding, **options)
    yield "out", out, ref_out, naive_out, rounding
    if lse is not None:
        acc = accumulation_of(q.dtype)
        lse_rounding = rounding if isinstance(rounding, str) or rounding == acc else acc
        if lse_rounding != rounding:
            _, naive_lse = naive_attention(q, k, v, rounding=lse_rounding, **options)
        yield "lse", lse, ref_lse, naive_lse, lse_rounding


def attention_error_ratio(q, k, v, out, lse, options, precision="highest"):
    """The largest ``err / limit`` of the accuracy rule over ``out`` and ``lse`` (None: out
    only) of ``attention(q, k, v, **options)``: at most 1 for an accurate result, inf for a
    NaN or misplaced non-finite entry. A mutant must exceed :data:`MUTANT_MARGIN`."""
    ratios = [err / limit for err, limit in (accuracy(*r[1:]) for r in _attention_results(
        q, k, v, out, lse, options, precision))]
    return max(ratios)


def check_attention(q, k, v, out, lse, options, precision="highest"):
    """``out`` (in q's dtype) and ``lse`` (None when not returned; in the accumulation dtype)
    of ``attention(q, k, v, **options)`` against the oracle, by the accuracy rule: ``out``
    against the naive computation in q's precision, ``lse`` against the naive one in the
    accumulation dtype (the scores a 16-bit engine sums in float32); fully masked rows exact."""
    assert out.dtype == q.dtype, (out.dtype, q.dtype)
    if lse is not None:
        assert lse.dtype == accumulation_of(q.dtype), (lse.dtype, accumulation_of(q.dtype))
    for result in _attention_results(q, k, v, out, lse, options, precision):
        assert_accurate(*result)


#: The gradients :func:`check_gradients` compares, in attention_backward's field order.
GRADIENT_NAMES = ("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k")


def check_gradients(got, dout, q, k, v, options, precision="highest"):
    """The gradients ``got`` (a mapping, or attention_backward's result; a name missing or None
    where the oracle has None) against the oracle, each by the accuracy rule against the
    naive computation in q's precision (``"tf32"`` at ``precision="tf32"``)."""
    rounding = precision_of(q.dtype, precision)
    exact = reference_attention_backward(dout, q, k, v, **options)
    naive = naive_attention_backward(dout, q, k, v, rounding=rounding, **options)
    inherited = lse_rounding(reference_attention(q, k, v, **options)[1], q.dtype)
    for name in GRADIENT_NAMES:
        g = got.get(name) if isinstance(got, dict) else getattr(got, name, None)
        if exact[name] is None:
            assert g is None, name
            continue
        assert g is not None, name
        assert_accurate(name, g, exact[name], naive[name], rounding, inherited)


def lse_rounding(lse, dtype):
    """The relative error every gradient inherits from an ``lse`` stored in the accumulation
    dtype of ``dtype``: one unit in the last place of the largest finite ``|lse|``, relative.

    A backward pass reads the forward's ``lse`` and recomputes ``P = exp(s - lse)``: an ``lse``
    off by ``delta`` scales a row's every ``P``, and with it ``dV``, ``dS``, ``dQ``, ``dK``
    and the terms' gradients, by ``exp(-delta)``, a relative error of ``|delta|``. Stored in
    float32, even a correctly rounded ``lse`` of 10 is off by up to 5e-7, a forward's by about
    twice that, beside the rule's float32 floor of 1e-6; the naive computation has no ``lse``
    to round (measured on an AVX2 machine, dK at 6.7x the naive error, 1.1x the limit without
    this term, and at 2.8x with a correctly rounded forward)."""
    lse = np.asarray(lse, dtype=np.float64)
    finite = lse[np.isfinite(lse)]
    top = float(np.max(np.abs(finite), initial=0.0))
    return float(np.finfo(accumulation_of(dtype)).eps) * top


#: The fields of attention_stats, and those of them that are key indices.
STATS_FIELDS = ("lse", "entropy", "max_weight", "argmax", "received", "top_indices",
                "top_weights", "weights")
STATS_INDICES = ("argmax", "top_indices")


def check_stats(got, q, k, *, indices=True, **options):
    """The statistics ``got`` (a mapping, or attention_stats' result) of ``attention_stats(q,
    k, **options)`` against the oracle: the values by the accuracy rule against the naive
    computation in the accumulation dtype (float32, float64 for float64), the key indices
    exactly unless ``indices`` is False (near-ties a float32 accumulation may order otherwise)."""
    acc = accumulation_of(q.dtype)
    exact = reference_attention_stats(q, k, **options)
    naive = naive_attention_stats(q, k, rounding=acc, **options)
    for name in STATS_FIELDS:
        g = got.get(name) if isinstance(got, dict) else getattr(got, name, None)
        if g is None:
            continue
        if name in STATS_INDICES:
            assert g.dtype == np.int64, name
            if indices:
                np.testing.assert_array_equal(g, exact[name], err_msg=name)
            continue
        assert g.dtype == acc, (name, g.dtype, acc)
        assert_accurate(name, g, exact[name], naive[name], acc)


# --------------------------------------------------------------------------------------------
# what this machine can run, and one marker for each thing that may be missing


@functools.lru_cache(maxsize=None)
def emulation_available() -> str | None:
    """None when the emulation backend can run here, else the reason it cannot."""
    try:
        import cuonline.engines.cuda  # noqa: F401 - the engine that drives the emulation
        from cuonline.testing import emulate
    except ImportError as exc:
        return f"the emulation backend is not importable: {exc}"
    return emulate.compiler_problem()


@functools.lru_cache(maxsize=None)
def gpu_available() -> str | None:
    """None when a CUDA GPU and CuPy are usable, else the reason they are not."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - any failure means "no GPU here"
        return f"no usable CUDA GPU: {type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=None)
def nvrtc_available() -> str | None:
    """None when NVRTC and the CUDA headers are installed (no GPU needed), else why not."""
    from cuonline.toolchain import nvrtc
    if nvrtc.nvrtc_available():
        return None
    return ('NVRTC not installed (pip install cupy-cuda13x "nvidia-cuda-nvrtc==13.*" '
            '"nvidia-cuda-runtime==13.*")')


needs_emulation = pytest.mark.skipif(emulation_available() is not None,
                                     reason=f"emulation unavailable: {emulation_available()}")
needs_gpu = pytest.mark.skipif(gpu_available() is not None, reason=str(gpu_available()))
needs_nvrtc = pytest.mark.skipif(nvrtc_available() is not None, reason=str(nvrtc_available()))


def fast_tier(values, keep):
    """``values`` as pytest params of which only those in ``keep`` run in the fast tier
    (``-m "not slow"``); the others are marked slow, so the full suite still runs them all.
    For parametrizations whose cases differ in what a slower tier already covers."""
    missing = set(keep) - set(values)
    if missing:
        raise ValueError(f"fast_tier: {sorted(missing)} not among the values {list(values)}")
    return [v if v in keep else pytest.param(v, marks=pytest.mark.slow) for v in values]


def cuda_backend_params():
    """pytest params for the CUDA engine's two module kinds: emulate (CPU) and cupy (GPU)."""
    return [pytest.param("emulate", id="emulate", marks=needs_emulation),
            pytest.param("cupy", id="cupy", marks=[pytest.mark.gpu, needs_gpu])]


def engine_params():
    """pytest params for every engine: numpy always, emulate and cupy where they can run."""
    return [pytest.param("numpy", id="numpy")] + cuda_backend_params()


class Engine:
    """Runs attention on one engine with NumPy data in and out, whatever the engine's arrays."""

    def __init__(self, name):
        self.name = name
        self.xp = np
        if name == "cupy":
            import cupy
            self.xp = cupy

    def put(self, x):
        return None if x is None else self.xp.asarray(x)

    def get(self, x):
        return x.get() if hasattr(x, "get") and self.xp is not np else np.asarray(x)

    def options(self, options):
        """``options`` with each array option of the options table (``cuonline._options``)
        given as a NumPy array moved to this engine's array library, and its backend."""
        from cuonline import _options
        arrays = _options.array_options()
        moved = {n: self.put(x) if n in arrays and isinstance(x, np.ndarray) else x
                 for n, x in options.items()}
        return dict(moved, backend="auto" if self.name == "numpy" else self.name)

    def attention(self, q, k, v, **options):
        import cuonline
        result = cuonline.attention(self.put(q), self.put(k), self.put(v),
                                    **self.options(options))
        if options.get("return_lse"):
            return self.get(result[0]), self.get(result[1])
        return self.get(result)

    def attention_backward(self, dout, q, k, v, out, lse, **options):
        """attention_backward on this engine: the gradients by field name (``"dq"``, ...),
        as NumPy arrays, None where the input was not given."""
        import cuonline
        got = cuonline.attention_backward(*(self.put(x) for x in (dout, q, k, v, out, lse)),
                                          **self.options(options))
        return {name: None if getattr(got, name) is None else self.get(getattr(got, name))
                for name in GRADIENT_NAMES}


# --------------------------------------------------------------------------------------------
# ThreadSanitizer


def check_races(code: str, *, expect_race: bool) -> None:
    """Run Python ``code`` under ThreadSanitizer (see :func:`run_under_tsan`); the code must
    print ``DONE`` at its end, and TSan must report a data race exactly when ``expect_race``."""
    proc, raced = run_under_tsan(code)
    assert "DONE" in proc.stdout, proc.stderr[-3000:]
    assert raced == expect_race, proc.stderr[-3000:]
    if not expect_race:
        assert proc.returncode == 0, proc.stderr[-3000:]


def run_under_tsan(code: str) -> tuple[subprocess.CompletedProcess, bool]:
    """Run Python ``code`` in a subprocess with ThreadSanitizer loaded.

    The code sees the repository root and ``tests/`` on ``sys.path`` (so it can ``import
    support``) and may compile emulated modules with ``emulate_options=dict(tsan=True)``. Skips
    the calling test where the emulation or libtsan is missing. Returns the finished process
    and whether TSan reported a data race.
    """
    reason = emulation_available()
    if reason is not None:
        pytest.skip(reason)
    from cuonline.testing import emulate

    try:
        env = emulate.tsan_environment()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    prelude = (f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
               "from cuonline.testing import emulate\nassert emulate.running_under_tsan()\n")
    proc = subprocess.run([emulate.tsan_python(), "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))
    raced = "WARNING: ThreadSanitizer: data race" in proc.stderr
    return proc, raced


# --------------------------------------------------------------------------------------------
# attention cases and the CUDA engine's runners (tests/test_cuda_engine.py, test_mma_engine.py
# and their TSan subprocesses)


def gradient_case(dtype):
    """``(rng, q, k, v)`` of the gradient cases: 3 query heads share one key head, lengths
    that are no tile multiple (37 queries, 41 keys)."""
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 3, 37, 16)).astype(dtype)
    k = rng.standard_normal((2, 1, 41, 16)).astype(dtype)
    v = rng.standard_normal((2, 1, 41, 8)).astype(dtype)
    return rng, q, k, v


#: Options of :func:`gradient_case` whose gradients every engine is held to (name -> a
#: function of the case's generator), each gradient summed to its input's shape as passed.
GRADIENT_CASES = {
    "gqa-causal": lambda rng: dict(causal=True),
    "shared-bias": lambda rng: dict(bias=rng.standard_normal((37, 41)).astype(np.float32),
                                    kv_lengths=np.array([41, 30])[:, None]),
    # a bias per batch element shared by its heads (the CUDA engine adds dS in place, one dQ
    # launch per head), with per-element kv_lengths and per-head slopes reordered with the batch
    "head-shared-bias": lambda rng: dict(bias=rng.standard_normal((2, 1, 37, 41)),
                                         kv_lengths=np.array([41, 23])[:, None],
                                         alibi_slopes=np.array([0.1, 0.2, 0.3])),
    "block-bias": lambda rng: dict(bias=rng.standard_normal((1, 10, 6)), bias_block=(4, 7)),
    "rel-bias": lambda rng: dict(rel_bias=rng.standard_normal((3, 9)), window=(20, 3),
                                 alibi_slopes=np.array([0.1, 0.2, 0.3])),
    # rel_q per query head, rel_k shared by them (and by the heads' key head)
    "rel-qk": lambda rng: dict(rel_q=rng.standard_normal((3, 37, 5)),
                               rel_k=rng.standard_normal((2, 1, 9, 5)), causal=True),
    # the cap of the content score, which rel_q·rel_k is part of; then every term at once
    "rel-qk-capped": lambda rng: dict(rel_q=rng.standard_normal((37, 5)),
                                      rel_k=rng.standard_normal((7, 5)), softcap=2.0),
    "every-term": lambda rng: dict(rel_q=rng.standard_normal((37, 5)),
                                   rel_k=rng.standard_normal((7, 5)), softcap=2.0,
                                   softcap_bias=True, bias=rng.standard_normal((37, 41)),
                                   rel_bias=rng.standard_normal((5,)), q_offset=3, k_offset=-2),
}

OPTION_NAMES = ("scale", "causal", "window", "bias", "mask", "kv_lengths", "alibi_slopes",
                "softcap", "softcap_bias", "offsets", "return_lse")

def make_case(seed, *, batch=(2,), lq=17, lk=33, d=16, dv=24, dtype=np.float32, kv_batch=None,
              options=()):
    """Inputs for one case: ``(q, k, v, options_dict)``; options named in ``options`` are set.

    ``kv_batch`` gives k/v their own (broadcastable) leading shape, e.g. grouped queries.
    """
    rng = np.random.default_rng(seed)
    kv_batch = batch if kv_batch is None else kv_batch
    q = rng.standard_normal(batch + (lq, d)).astype(dtype)
    k = rng.standard_normal(kv_batch + (lk, d)).astype(dtype)
    v = rng.standard_normal(kv_batch + (lk, dv)).astype(dtype)
    full = np.broadcast_shapes(batch, kv_batch)
    opts = {}
    for name in options:
        if name == "causal":
            opts["causal"] = True
        elif name == "window":
            opts["window"] = (9, 4)
        elif name == "scale":
            opts["scale"] = 0.7
        elif name == "bias":
            # (Lq, Lk) broadcast over the batch: read with zero batch strides, never expanded.
            opts["bias"] = rng.standard_normal((lq, lk)).astype(np.float32)
        elif name == "mask":
            m = rng.random((1, lq, lk)) < 0.8
            m[0, 0, :] = False                      # one fully masked row
            opts["mask"] = m
        elif name == "kv_lengths":
            lengths = rng.integers(0, lk + 1, size=full)
            lengths.flat[0] = 0                     # one batch element sees no key at all
            lengths.flat[-1] = lk
            opts["kv_lengths"] = lengths
        elif name == "alibi_slopes":
            opts["alibi_slopes"] = rng.uniform(0.05, 0.5, size=full[-1:])
        elif name == "softcap":
            opts["softcap"] = 1.5
        elif name == "softcap_bias":
            # the cap of the whole logit: needs the cap, and a bias to be after
            opts["softcap_bias"] = True
            opts.setdefault("softcap", 1.5)
            if "bias" not in opts:
                opts["bias"] = rng.standard_normal((lq, lk)).astype(np.float32)
        elif name == "offsets":
            # query i at 7 + i, key j at j - 4: the diagonal at 11, not Lk - Lq
            opts["q_offset"], opts["k_offset"] = 7, -4
        elif name == "return_lse":
            opts["return_lse"] = True
        else:
            raise ValueError(name)
    return q, k, v, opts


def problem_of(backend, q, k, v, precision="highest", **options):
    """The validated Problem of NumPy inputs (moved to the GPU for ``"cupy"``)."""
    xp = np
    if backend == "cupy":
        import cupy as xp  # noqa: PLC0415
    kwargs = {n: (xp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    from cuonline._validate import validate_attention
    return validate_attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), backend=backend,
                              precision=precision, **kwargs)


def run_cuda(backend, q, k, v, *, num_sms=None, n_splits=None, kernel_sources=None,
             emulate_options=None, **options):
    """Run the CUDA engine on NumPy inputs (moved to the GPU for "cupy"); NumPy results."""
    from cuonline.engines import cuda
    from cuonline.engines.target import overrides
    problem = problem_of(backend, q, k, v, **options)
    with overrides(num_sms=num_sms, n_splits=n_splits, kernel_sources=kernel_sources,
                   emulate_options=emulate_options):
        out, lse = cuda.attention(problem)
    if backend == "cupy":
        out, lse = out.get(), (None if lse is None else lse.get())
    return out, lse


def run_mma(backend, q, k, v, *, precision="highest", n_splits=None, num_sms=None,
            kernel_sources=None, emulate_options=None, expect_cp_async=None, tuned=None,
            expect_key=None, **options):
    """Run the engine on the tensor-core family; NumPy results. ``tuned`` forces tiles (the
    engine's seam); ``expect_*`` check the planned variant."""
    from cuonline.engines import cuda
    from cuonline.engines.target import overrides
    from cuonline.kernels import arguments, families, heuristics
    from cuonline.kernels.launch import Launch
    from cuonline.kernels.specs import AttentionMmaSpec
    p = problem_of(backend, q, k, v, precision, **options)
    plan = families.plan_attention(p, Launch(n_splits=n_splits,
                                             num_sms=num_sms or heuristics.DEFAULT_NUM_SMS,
                                             cp_async=arguments.cp_async_aligned(p),
                                             tuned=tuned))
    assert isinstance(plan.spec, AttentionMmaSpec), plan.spec.key       # the dispatcher picked it
    if expect_cp_async is not None:
        assert plan.spec.cp_async == expect_cp_async, plan.spec.key
    if expect_key is not None:
        assert expect_key in plan.spec.key, plan.spec.key
    with overrides(n_splits=n_splits, num_sms=num_sms, tuned=tuned or {},
                   kernel_sources=kernel_sources, emulate_options=emulate_options):
        out, lse = cuda.attention(p)
    if backend == "cupy":
        out, lse = out.get(), (None if lse is None else lse.get())
    return out, lse


# --------------------------------------------------------------------------------------------
# the barrier mutants' cases (tests/test_barrier_mutants.py and its TSan subprocess)

#: The cases that run a file's code: the families that paste it.
BARRIER_CASES_OF = {
    "attention_fwd_simt.cu": ("simt",),
    "attention_fwd_mma.cu": ("mma",),
    "tensor_core.cuh": ("mma",),
    "attention_score.cuh": ("simt", "mma"),
    "attention_combine.cuh": ("simt_split", "mma_split"),
    "common.cuh": ("simt", "mma", "softmax"),
    "softmax.cu": ("softmax",),
    "attention_bwd_simt.cu": ("bwd_simt",),
    "attention_bwd_mma.cu": ("bwd_mma",),
    "attention_stats.cu": ("stats",),
}

#: (dtype, family, lq, lk, n_splits): 200 keys are 4 tiles of 64 (mma f16 D = 32: two stages,
#: so stage 0 is refilled at tile 2 and read again at tile 3) and a ragged tail; 40 rows are
#: 5 SIMT blocks of 4 warps, 80 rows 3 warps of two query tiles; split: 2 key splits.
BARRIER_ATTENTION_CASES = {
    "simt": (np.float32, "attention_fwd_simt", 40, 200, None),
    "mma": (np.float16, "attention_fwd_mma", 80, 200, None),
    "simt_split": (np.float32, "attention_fwd_simt", 40, 300, 2),
    "mma_split": (np.float16, "attention_fwd_mma", 80, 300, 2),
    # the backward: 100 queries and 75 keys are 4 and 3 ragged tiles of 32 (float32 D = 32,
    # Dv = 24), so each kernel's key or query loop crosses its barriers several times
    "bwd_simt": (np.float32, "attention_bwd_simt", 100, 75, None),
    # the tensor-core backward (float16 on the emulation's sm_90): 150 queries and 140 keys
    # are 3 ragged tiles of 64 each way, so each kernel's loop refills its streamed tile
    "bwd_mma": (np.float16, "attention_bwd_mma", 150, 140, None),
    # the statistics (one SM: 32 queries per block): 100 queries and 200 keys are 4 query
    # tiles x 4 key tiles of 64 in pass 1 and 7 key blocks x 2 query tiles in the received pass
    "stats": (np.float32, "attention_stats", 100, 200, None),
}
#: Every barrier case: the attention ones and the softmax one.
BARRIER_CASES = sorted(BARRIER_ATTENTION_CASES) + ["softmax"]
#: An error this far above the dtype's rounding is a broken kernel.
_BROKEN = {np.float32: 1e-3, np.float16: 3e-2}


def barrier_threshold(case) -> float:
    """The error above which ``case``'s kernel counts as broken."""
    return 1e-6 if case == "softmax" else _BROKEN[BARRIER_ATTENTION_CASES[case][0]]


def run_barrier_case(case, sources=None, tsan=False) -> float:
    """Run ``case`` on the kernels (with ``sources`` replacing files); return its max error
    (inf for a non-finite output, or a kernel the emulation stops: a deadlock, a trap)."""
    from cuonline.testing.emulate import EmulationError
    try:
        return _run_barrier_case(case, sources, tsan)
    except EmulationError:
        return float("inf")


def _run_barrier_case(case, sources, tsan):
    import cuonline
    from cuonline.engines import cuda
    from cuonline.engines.target import overrides
    options = dict(mode="threads", tsan=True) if tsan else None
    rng = np.random.default_rng(7)
    if case == "softmax":
        x = rng.standard_normal((3, 3000)).astype(np.float32)  # 4 warps per row, one block
        with overrides(max_blocks=1, kernel_sources=sources, emulate_options=options):
            out = cuonline.softmax(x, axis=1, backend="emulate")
        if not np.isfinite(out).all():
            return float("inf")
        e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
        return float(np.abs(out - e / e.sum(axis=1, keepdims=True)).max())
    dtype, family, lq, lk, n_splits = BARRIER_ATTENTION_CASES[case]
    q = rng.standard_normal((2, lq, 32)).astype(dtype)
    k = rng.standard_normal((2, lk, 32)).astype(dtype)
    v = rng.standard_normal((2, lk, 24)).astype(dtype)
    if family in ("attention_bwd_simt", "attention_bwd_mma"):
        return _run_backward_barrier_case(q, k, v, rng, sources, options)
    if family == "attention_stats":
        return _run_stats_barrier_case(q, k, sources, options)
    p = problem_of("emulate", q, k, v, return_lse=True)
    with overrides(num_sms=1, n_splits=n_splits, family=family, tuned={},
                   kernel_sources=sources, emulate_options=options):
        out, _ = cuda.attention(p)
    if not np.isfinite(out).all():
        return float("inf")
    ref, _ = reference_attention(q, k, v)
    return float(np.abs(out.astype(np.float64) - ref).max())


def _run_backward_barrier_case(q, k, v, rng, sources, options):
    """The backward's barrier case: max error of dq, dk, dv against the float64 oracle."""
    from cuonline.engines import cuda_backward
    from cuonline.engines.target import overrides
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(q.dtype)
    # the terms whose gradients the dQ kernels reduce in shared memory (behind a barrier of
    # their own): a block bias whose 3-row blocks straddle the query tiles, rel_bias, rel_q/k
    lq, lk = q.shape[-2], k.shape[-2]
    terms = dict(bias=rng.standard_normal((-(-lq // 3), -(-lk // 5))), bias_block=(3, 5),
                 rel_bias=rng.standard_normal(9), rel_q=rng.standard_normal((2, lq, 4)),
                 rel_k=rng.standard_normal((7, 4)))
    acc = np.result_type(q.dtype, np.float32)
    terms = {n: x.astype(acc) if isinstance(x, np.ndarray) else x for n, x in terms.items()}
    out, lse = reference_attention(q, k, v, **terms)
    # lse in float32 at least: a float16 lse would move every weight by ~1e-3
    lse = lse.astype(acc)
    try:
        with overrides(kernel_sources=sources, emulate_options=options):
            got = cuda_backward.gradients(problem_of("emulate", q, k, v, **terms), dout,
                                          out.astype(q.dtype), lse)
    except ValueError as exc:   # wrong sums of P: the kernel's check of lse caught the mutant
        if "`lse`" not in str(exc):
            raise
        return float("inf")
    want = reference_attention_backward(dout, q, k, v, **terms)
    names = ("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k")
    # per batch element (gradients): the shared terms' gradients summed over the batch; the
    # reduced gradients are sums over many places: their error relative to their size
    got = {n: got[n].sum(axis=0) if got[n].ndim > want[n].ndim else got[n] for n in names}
    errors = [float(np.abs(got[n] - want[n]).max() / max(1.0, float(np.abs(want[n]).max())))
              for n in names]
    return max(errors) if all(np.isfinite(got[n]).all() for n in names) else float("inf")


def _run_stats_barrier_case(q, k, sources, options):
    """The statistics' barrier case: max error of every statistic against the float64 oracle
    (inf for a NaN or a wrong index)."""
    import cuonline
    from cuonline.engines.target import overrides
    rows = [0, 37, 99]
    with overrides(num_sms=1, kernel_sources=sources, emulate_options=options):
        st = cuonline.attention_stats(q, k, backend="emulate", received=True, top_k=4,
                                      rows=rows)
    want = reference_attention_stats(q.astype(np.float64), k.astype(np.float64), top_k=4,
                                     rows=rows)
    if not (np.array_equal(st.argmax, want["argmax"])
            and np.array_equal(st.top_indices, want["top_indices"])):
        return float("inf")
    names = ("lse", "entropy", "max_weight", "received", "top_weights", "weights")
    if not all(np.isfinite(getattr(st, n)).all() for n in names):
        return float("inf")
    return max(float(np.abs(getattr(st, n) - want[n]).max()) for n in names)


# --------------------------------------------------------------------------------------------
# packed variable-length batches: the cases every engine's varlen tests share


def boundaries(lengths):
    """The ``cu_seqlens`` of sequences of these lengths: int64, 0 first, the total last."""
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)


def packed_case(seed, dtype, lengths_q, lengths_k, *, heads=2, d=6, dv=4):
    """``(rng, q, k, v, cu_seqlens_q, cu_seqlens_k)``: packed q ``(heads, total_q, d)``, k and
    v shared by the heads (a broadcast batch axis), sequences of the given lengths."""
    rng = np.random.default_rng(seed)
    cq, ck = boundaries(lengths_q), boundaries(lengths_k)
    q = rng.standard_normal((heads, cq[-1], d)).astype(dtype)
    k = rng.standard_normal((1, ck[-1], d)).astype(dtype)
    v = rng.standard_normal((1, ck[-1], dv)).astype(dtype)
    return rng, q, k, v, cq, ck


def packed_option_cases(rng, total_q, heads=2, dr=3):
    """Each per-sequence option of a packed batch, alone or with what gives it meaning."""
    return {
        "plain": {},
        "causal": {"causal": True},
        "window": {"window": (3, 1)},
        "alibi": {"alibi_slopes": np.array([0.25, 0.5]), "causal": True},
        "softcap": {"softcap": 1.5, "scale": 2.0},
        "softcap_bias": {"softcap": 1.5, "softcap_bias": True, "alibi_slopes": np.array([0.3]),
                         "rel_bias": rng.standard_normal(41)},
        "rel_bias": {"rel_bias": rng.standard_normal((heads, 9)), "window": (None, 2)},
        # rel_k of radius 10: clamped beyond
        "rel_qk": {"rel_q": rng.standard_normal((heads, total_q, dr)),
                   "rel_k": rng.standard_normal((1, 21, dr))},
        "q_offset": {"q_offset": 2, "causal": True},
        "k_offset": {"q_offset": 0, "k_offset": 3, "window": (4, 0),
                     "alibi_slopes": np.array(0.2)},
    }
