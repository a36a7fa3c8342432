"""The CUDA engine against the float64 oracle: emulated on the CPU, and on a GPU where one exists.

One matrix of cases, each run through :func:`cuonline.engines.cuda.attention` under the named
seam :func:`cuonline.engines.target.overrides` (``num_sms`` picks large or small tiles,
``n_splits`` forces a key split) with NumPy arrays on ``backend="emulate"`` and, marked
``gpu``, with CuPy arrays.
Then the planner's pure functions, and deliberately broken kernels (tests/mutants.py) that the
matrix must catch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from mutants import KERNELS, MUTANTS, mutant_sources
from support import (BFLOAT16, MUTANT_MARGIN, OPTION_NAMES, ROOT, attention_error_ratio,
                     check_attention, check_races, cuda_backend_params, make_case, needs_emulation,
                     needs_gpu, run_cuda)

from cuonline._validate import validate_attention
from cuonline.kernels import families, heuristics
from cuonline.kernels.launch import Launch
from cuonline.kernels.specs import AttentionSimtSpec

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out

BACKENDS = cuda_backend_params()


# --------------------------------------------------------------------------------------------
# cases (make_case and run_cuda: tests/support.py)


def check(backend, q, k, v, options, **seams):
    options = dict(options)
    options.setdefault("return_lse", True)
    out, lse = run_cuda(backend, q, k, v, **seams, **options)
    if not options["return_lse"]:
        assert lse is None
    check_attention(q, k, v, out, lse, options)


# Large tiles (one SM: the planner keeps 8 rows per warp, no split) and small tiles (132 SMs:
# rows shrink to fill the GPU, and few-query problems split their keys).
TILINGS = [pytest.param(1, id="big-tiles"), pytest.param(132, id="small-tiles")]

LENGTHS = [(1, 1), (1, 65), (17, 63), (64, 64), (65, 129), (129, 65), (127, 17)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_sms", TILINGS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq, lk", LENGTHS)
def test_lengths_tails_and_diagonal(backend, num_sms, causal, lq, lk):
    q, k, v, opts = make_case(lq * 1000 + lk, lq=lq, lk=lk,
                              options=("causal",) if causal else ())
    check(backend, q, k, v, opts, num_sms=num_sms)


# each option alone against the oracle: tests/test_semantics.py, one body for every engine


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64]
                         + ([BFLOAT16] if BFLOAT16 is not None else []),
                         ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("options", [("causal",), OPTION_NAMES[1:]], ids=["causal", "all"])
def test_dtypes(backend, dtype, options):
    q, k, v, opts = make_case(7, batch=(3,), lq=40, lk=75, dtype=dtype, options=options)
    check(backend, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d, dv", [(1, 1), (8, 40), (100, 64), (64, 256), (256, 256)])
def test_head_dims(backend, d, dv):
    q, k, v, opts = make_case(d + dv, lq=20, lk=45, d=d, dv=dv, options=("causal",))
    check(backend, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq, lk", [(1, 300), (5, 700), (16, 513)])
@pytest.mark.parametrize("options", [(), ("causal", "kv_lengths"), OPTION_NAMES[1:]],
                         ids=["plain", "causal-lengths", "all"])
def test_split_keys_for_few_queries(backend, lq, lk, options):
    q, k, v, opts = make_case(lq + lk, batch=(3,), lq=lq, lk=lk, options=options)
    problem = validate_attention(q, k, v, backend="emulate", scale=None, causal=False,
                                 window=None, bias=None, mask=None, kv_lengths=None,
                                 alibi_slopes=None, softcap=None, return_lse=False)
    assert families.plan_attention(problem, Launch()).n_splits > 1   # the heuristics choose a split
    check(backend, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_splits", [2, 5])
def test_forced_split_with_window_and_lengths(backend, n_splits):
    q, k, v, opts = make_case(3, batch=(2, 2), lq=40, lk=200,
                              options=("window", "kv_lengths", "causal"))
    check(backend, q, k, v, opts, n_splits=n_splits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_broadcast_and_grouped_views(backend):
    rng = np.random.default_rng(11)
    # q: a transposed view (B, G, Lq, D) of a (Lq, B, G, D) array; k: reversed along keys;
    # k and v broadcast over the G query heads of each of the B key/value heads (GQA).
    q = np.moveaxis(rng.standard_normal((21, 2, 3, 16)).astype(np.float32), 0, 2)
    k = rng.standard_normal((2, 1, 50, 16)).astype(np.float32)[:, :, ::-1]
    v = rng.standard_normal((2, 1, 16, 50)).astype(np.float32).swapaxes(-1, -2)
    bias = rng.standard_normal((3, 1, 50)).astype(np.float32)  # per query head, all rows
    check(backend, q, k, v, {"bias": bias, "causal": True})


# NaN padding past kv_lengths, a NaN query row and empty problems: tests/test_semantics.py,
# one body for every engine (the ``engine`` fixture)


@needs_emulation
def test_public_api_dispatches_emulate():
    import cuonline

    q, k, v, _ = make_case(2, lq=10, lk=20)
    out, lse = cuonline.attention(q, k, v, causal=True, return_lse=True, backend="emulate")
    check_attention(q, k, v, out, lse, dict(causal=True))


# --------------------------------------------------------------------------------------------
# planner (pure functions)


def test_heuristics_respect_budgets():
    # Behaviour, not the planner's own arithmetic: the variant it picks asks for at most
    # SMEM_MAX of shared memory (what the launch requests is the spec's), no warp is left
    # without a row, and the query tile only shrinks as the output row (registers per row)
    # or the accumulator widens. Registers themselves: test_kernels_nvrtc (0 spills).
    for dtype, acc in (("float16", "float32"), ("float32", "float32"), ("float64", "float64")):
        for d in (1, 32, 64, 100, 128, 256):
            for lq in (1, 5, 16, 17, 4096):
                rows_of = {}
                for dv in (d, 256):
                    warps, rows, keys = heuristics.choose_tiles(dtype, d, dv, lq, nbatch=64)
                    assert 1 <= warps <= 4 and rows in (1, 2, 4, 8) and keys in (1, 2)
                    spec = AttentionSimtSpec(dtype=dtype, acc=acc, d=d, dv=dv, warps=warps,
                                             rows_per_warp=rows, keys_per_lane=keys)
                    assert spec.shared_bytes <= heuristics.SMEM_MAX, spec.key
                    if lq <= 16:   # no warp without a row
                        assert (warps - 1) * rows < lq
                    rows_of[dv] = rows
                assert rows_of[256] <= rows_of[d], (dtype, d, lq)
                if dtype == "float64":
                    narrow = heuristics.choose_tiles("float32", d, d, lq, nbatch=64)[1]
                    assert rows_of[d] <= narrow, (d, lq)


def test_split_heuristics():
    # one block against a million keys: split wide; a full grid: no split
    n, keys = heuristics.choose_splits(1, 10**6, 64)
    assert 128 <= n <= heuristics.MAX_SPLITS and keys % 64 == 0
    assert n * keys >= 10**6 > (n - 1) * keys
    assert heuristics.choose_splits(500, 10**6, 64) == (1, 10**6)
    assert heuristics.choose_splits(1, 200, 64) == (1, 200)


# --------------------------------------------------------------------------------------------
# mutants: deliberately broken kernels that the matrix must catch


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_edits_apply_to_the_current_kernels(name):
    # mutant_sources raises where the edit's text no longer occurs exactly once; the mutant
    # must also differ from the kernel file it edits (a no-op edit would test nothing)
    ((file, text),) = mutant_sources(name).items()
    assert text != (KERNELS / file).read_text(encoding="utf-8"), name


@pytest.mark.parametrize("name", ["no_tail_mask", "no_rescale"])
@needs_emulation
def test_mutants_fail_the_oracle_comparison(name):
    q, k, v, _ = make_case(4, lq=17, lk=129)   # 3 key tiles, a ragged last tile
    out, lse = run_cuda("emulate", q, k, v, return_lse=True,
                        kernel_sources=mutant_sources(name))
    ratio = attention_error_ratio(q, k, v, out, lse, {})
    assert ratio > MUTANT_MARGIN, (name, ratio)
    # and the real kernel passes the same case
    check("emulate", q, k, v, {})


_TSAN_SCRIPT = """
from support import make_case, run_cuda
q, k, v, _ = make_case(4, lq=20, lk=100)
out, lse = run_cuda("emulate", q, k, v, num_sms=1, return_lse=True,
                    kernel_sources={sources!r}, emulate_options=dict(tsan=True))
print("DONE", out.shape)
"""


@pytest.mark.parametrize("name", [None, "no_sync"], ids=["correct", "no_sync"])
def test_thread_sanitizer(name):
    sources = mutant_sources(name) if name else None
    check_races(_TSAN_SCRIPT.format(sources=sources), expect_race=name is not None)


# --------------------------------------------------------------------------------------------
# CuPy's on-disk cache: a second process must load the module, not recompile it

_CACHE_SCRIPT = """
import sys, numpy as np, cupy
sys.path[:0] = [{root!r}]
import cuonline
rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal((2, 33, 64)).astype(np.float32)) for _ in range(3))
out = cuonline.attention(q, k, v, causal=True, backend="cupy")
cupy.cuda.Device().synchronize()
print("DONE", float(abs(out).sum()))
"""


@pytest.mark.gpu
@needs_gpu
def test_second_process_loads_from_cupy_disk_cache(tmp_path):
    env = dict(os.environ, CUPY_CACHE_DIR=str(tmp_path))
    script = _CACHE_SCRIPT.format(root=str(ROOT))

    def run():
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-3000:]
        return {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}

    first = run()
    assert first, "CuPy wrote nothing to its disk cache"
    assert run() == first, "the second process recompiled instead of loading the cache"


# --------------------------------------------------------------------------------------------
# per-call host work (issue 18 item 5)


@needs_emulation
def test_the_module_is_looked_up_before_its_text_is_built(monkeypatch):
    # the ~100 KB text of a variant is built once per module, not on every call
    from cuonline.engines import target as target_module
    from cuonline.kernels import source
    built = []
    build = source.build_source
    monkeypatch.setattr(source, "build_source",
                        lambda spec, **kw: built.append(spec.key) or build(spec, **kw))
    spec = families.listing_specs("sm_90")[0]
    sources = {"common.cuh": (KERNELS / "common.cuh").read_text() + "\n// a variant\n"}
    with target_module.overrides(kernel_sources=sources):
        first = target_module.current("emulate").module(spec)
        again = target_module.current("emulate").module(spec)
    assert first is again and built == [spec.key]
    with target_module.overrides(kernel_sources=dict(sources, **{"common.cuh": "// other\n"
                                                                 + sources["common.cuh"]})):
        assert target_module.current("emulate").module(spec) is not first   # another text
    assert len(built) == 2


@pytest.mark.parametrize("strides", [(0, 0), (64, 16), (48, 16), (8, 2), (0, 24), (-64, 16)])
def test_cp_async_alignment_reads_the_batch_strides(strides):
    # the rule on the batch strides (no offset table) agrees with every batch offset's
    from cuonline.kernels import arguments
    base = np.zeros(4096, dtype=np.float16)[256:]      # 512-byte aligned from the start
    assert base.ctypes.data % 16 == 0
    batch = (3, 2)
    view = np.lib.stride_tricks.as_strided(
        base, shape=batch + (2, 8), strides=tuple(2 * s for s in strides) + (32, 2))
    offsets = (np.arange(3)[:, None] * strides[0] + np.arange(2)[None, :] * strides[1])
    want = bool(np.all(offsets % 8 == 0))             # 8 float16 elements: 16 bytes
    assert arguments.view_cp_async_aligned(view, batch) == want
