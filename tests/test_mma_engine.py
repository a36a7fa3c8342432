"""The tensor-core attention family (kernels_cu/attention_fwd_mma.cu) against the float64 oracle.

Emulated on the CPU (tensor_core.cuh's C++ bodies follow the PTX fragment layouts lane by lane)
and, marked ``gpu``, on CuPy arrays. Every case goes through the CUDA engine's seam
(:func:`cuonline.engines.cuda.attention`) and first asserts that the planner really picked the
tensor-core family. Then the dispatch and tile heuristics (pure functions), the PTX that NVRTC
makes of each element type, and deliberately broken copies of the kernel (tests/mutants.py) that
the matrix must catch.

Cost: the emulated run of a case takes milliseconds; each distinct variant costs one g++
compile (~3 s, cached on disk), so the cases below share variants where they can (most use
D = 32, Dv = 24 and Lq = 49, i.e. four warps).
"""

from __future__ import annotations

import numpy as np
import pytest
from mutants import mutant_sources
from oracle import reference_attention
from support import (BFLOAT16, OPTION_NAMES, check_attention, check_races, cuda_backend_params,
                     make_case, needs_emulation, needs_nvrtc, problem_of, run_mma)

from cuonline.kernels import families, heuristics, source
from cuonline.kernels.launch import Launch
from cuonline.toolchain import nvrtc
from cuonline.kernels.specs import MMA_INSTRUCTIONS, AttentionMmaSpec

pytestmark = pytest.mark.slow   # the fast tier (-m 'not slow') leaves it out


BACKENDS = cuda_backend_params()

# dtype ids -> (dtype, precision)
DTYPES = {"f16": (np.float16, "highest"), "tf32": (np.float32, "tf32"),
          "f64": (np.float64, "highest")}
if BFLOAT16 is not None:
    DTYPES["bf16"] = (BFLOAT16, "highest")

def tf32_bound(q, k, v, scale, lk_eff):
    """(out bound per row, lse bound per row) for precision="tf32", elementwise in the row.

    Scores: each q and k element is rounded to tf32 (10 explicit mantissa bits, nearest:
    relative error <= 2^-11) and the products are summed in float32, so
    |s~ - s| <= eps_s = scale (2^-10 + 2^-22 + D 2^-24) max_j sum_d |q_d k_jd|.
    Softmax: perturbing every score by at most eps_s moves the weights by at most
    sum_j |p~_j - p_j| <= exp(2 eps_s) - 1 and lse by at most eps_s.
    P·V: P and V rounded to tf32 again and summed in float32 over Lk keys:
    (2^-10 + 2^-22 + Lk 2^-24) sum_j p_j |v_j|. Hence
    |out~ - out| <= (exp(2 eps_s) - 1 + 2^-10 + 2^-22 + Lk 2^-24) max_j |v_j|.
    (Plus float32 rounding of the output and of lse, a few 2^-24 relative.)
    """
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    d = q64.shape[-1]
    absdot = np.einsum("...id,...jd->...ij", np.abs(q64), np.abs(k64)).max(axis=-1)
    eps_s = abs(scale) * (2.0**-10 + 2.0**-22 + d * 2.0**-24) * absdot     # (..., lq)
    vmax = np.abs(v64).max(axis=(-2, -1))[..., None]
    out_bound = (np.expm1(2 * eps_s) + 2.0**-10 + 2.0**-22 + lk_eff * 2.0**-24) * vmax
    return out_bound + 1e-6 * vmax, eps_s + 1e-6


def check(backend, q, k, v, options, *, precision="highest", **seams):
    options = dict(options)
    options.setdefault("return_lse", True)
    out, lse = run_mma(backend, q, k, v, precision=precision, **seams, **options)
    if precision == "tf32":
        ref_options = {n: x for n, x in options.items() if n != "return_lse"}
        ref_out, ref_lse = reference_attention(q, k, v, **ref_options)
        # softcap: |d cap tanh(x / cap) / dx| <= 1, bias and ALiBi add exactly, masks only
        # remove keys: the bound on the raw scores carries over.
        scale = options.get("scale") or 1.0 / np.sqrt(q.shape[-1])
        out_b, lse_b = tf32_bound(q, k, v, scale, k.shape[-2])
        finite = np.isfinite(ref_lse)
        assert np.all(np.abs(out - ref_out) <= out_b[..., None]), "tf32 out bound"
        lse_b = np.broadcast_to(lse_b, ref_lse.shape)
        assert np.all(np.abs(lse[finite] - ref_lse[finite]) <= lse_b[finite]), "tf32 lse bound"
        check_attention(q, k, v, out, lse, options, precision="tf32")
        return
    check_attention(q, k, v, out, lse, options)


# --------------------------------------------------------------------------------------------
# the emulated (and GPU) matrix

LENGTHS = [(1, 1), (1, 65), (17, 63), (63, 17), (65, 129), (129, 65)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq, lk", LENGTHS)
def test_lengths_tails_and_diagonal(backend, causal, lq, lk):
    # D = 32, Dv = 24: several 64-key tiles, ragged last tiles, 1-4 warps, the causal diagonal
    q, k, v, opts = make_case(lq * 1000 + lk, lq=lq, lk=lk, d=32, dv=24, dtype=np.float16,
                              options=("causal",) if causal else ())
    check(backend, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("lq, lk", [(49, 70), (70, 33)])
def test_each_option_alone(backend, name, lq, lk):
    q, k, v, opts = make_case(OPTION_NAMES.index(name) * 1000 + lq, batch=(3,), lq=lq, lk=lk,
                              d=32, dv=24, dtype=np.float16, options=(name,))
    check(backend, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("options", [(), OPTION_NAMES[1:]], ids=["plain", "all"])
def test_dtypes(backend, dtype, options):
    dt, precision = DTYPES[dtype]
    q, k, v, opts = make_case(7, batch=(3,), lq=49, lk=75, d=32, dv=24, dtype=dt,
                              options=options)
    check(backend, q, k, v, opts, precision=precision)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, d, dv", [
    ("f16", 64, 64), ("f16", 96, 96), ("f16", 128, 48), ("bf16", 64, 128),
    ("tf32", 96, 40), ("f64", 64, 96), ("f64", 20, 8),
])
def test_head_dims(backend, dtype, d, dv):
    if dtype not in DTYPES:
        pytest.skip("bfloat16 needs ml_dtypes")
    dt, precision = DTYPES[dtype]
    q, k, v, opts = make_case(d + dv, lq=20, lk=45, d=d, dv=dv, dtype=dt, options=("causal",))
    check(backend, q, k, v, opts, precision=precision)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["f16", "tf32", "f64"])
@pytest.mark.parametrize("lq, lk", [(1, 300), (16, 513)])
def test_split_keys_for_few_queries(backend, dtype, lq, lk):
    dt, precision = DTYPES[dtype]
    q, k, v, opts = make_case(lq + lk, batch=(3,), lq=lq, lk=lk, d=32, dv=24, dtype=dt,
                              options=("causal", "kv_lengths", "return_lse"))
    p = problem_of("emulate", q, k, v, precision, **opts)
    assert families.plan_attention(p, Launch()).n_splits > 1      # the heuristics choose a split
    check(backend, q, k, v, opts, precision=precision)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["f16", "tf32", "f64"])
@pytest.mark.parametrize("m_tiles", [1, 2])
def test_query_tiles_per_warp(backend, dtype, m_tiles):
    # Forced tiles: 3 warps of m_tiles query tiles (70 rows: the last warp partly empty with
    # one tile per warp, ragged with two), 32-key tiles, the causal diagonal and a mask.
    dt, precision = DTYPES[dtype]
    q, k, v, opts = make_case(70 + m_tiles, batch=(2,), lq=70, lk=90, d=32, dv=24, dtype=dt,
                              options=("causal", "mask"))
    tuned = {("attention_fwd_mma", np.dtype(dt).name, 32): (4, 32, 2, m_tiles)}
    key = "_mt2_" if m_tiles == 2 else "_bm64_bn32_"
    check(backend, q, k, v, opts, precision=precision, tuned=tuned, expect_key=key)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_splits", [2, 5])
def test_forced_split_with_window_and_lengths(backend, n_splits):
    q, k, v, opts = make_case(3, batch=(2, 2), lq=40, lk=200, d=32, dv=24, dtype=np.float16,
                              options=("window", "kv_lengths", "causal"))
    check(backend, q, k, v, opts, n_splits=n_splits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["f16", "f64"])
def test_strided_views_take_the_plain_loader(backend, dtype):
    dt, _ = DTYPES[dtype]
    rng = np.random.default_rng(11)
    # q: a transposed view (B, G, Lq, D) of a (Lq, B, G, D) array; k: reversed along keys;
    # v: a transposed (column stride != 1) view; k and v broadcast over the G query heads.
    q = np.moveaxis(rng.standard_normal((21, 2, 3, 16)).astype(dt), 0, 2)
    k = rng.standard_normal((2, 1, 50, 16)).astype(dt)[:, :, ::-1]
    v = rng.standard_normal((2, 1, 16, 50)).astype(dt).swapaxes(-1, -2)
    bias = rng.standard_normal((3, 1, 50)).astype(np.float32)
    check(backend, q, k, v, {"bias": bias, "causal": True}, expect_cp_async=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_misaligned_rows_take_the_plain_loader(backend):
    # D = 36 halves: 72-byte rows, not whole 16-byte chunks
    q, k, v, opts = make_case(12, lq=49, lk=40, d=36, dv=24, dtype=np.float16)
    check(backend, q, k, v, opts, expect_cp_async=False)
    # an aligned contiguous problem takes cp.async
    q, k, v, opts = make_case(12, lq=49, lk=40, d=32, dv=24, dtype=np.float16)
    check(backend, q, k, v, opts, expect_cp_async=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_padding_is_never_read(backend):
    q, k, v, opts = make_case(5, batch=(2,), lq=49, lk=80, d=32, dv=24, dtype=np.float16,
                              options=("kv_lengths",))
    opts["kv_lengths"] = np.array([13, 80])
    k[0, 13:] = np.nan
    v[0, 13:] = np.nan
    out, lse = run_mma(backend, q, k, v, return_lse=True, **opts)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    check_attention(q, np.nan_to_num(k), np.nan_to_num(v), out, lse, opts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_and_fully_masked_rows(backend):
    q, k, v, opts = make_case(9, batch=(2,), lq=49, lk=70, d=32, dv=24, dtype=np.float16,
                              options=("mask",))
    q *= np.float16(8)            # scores ~ 8 * 8 * sqrt(32) / sqrt(32): exp would overflow f32
    opts["mask"][0, 5, :] = False
    check(backend, q, k, v, opts)


@needs_emulation
def test_tf32_is_really_tf32():
    """precision="tf32" errors sit at the tf32 level (well above float32's), under the bound."""
    q, k, v, _ = make_case(7, batch=(3,), lq=49, lk=75, d=32, dv=24, dtype=np.float32)
    out, _ = run_mma("emulate", q, k, v, precision="tf32", return_lse=True)
    ref, _ = reference_attention(q, k, v)
    assert np.abs(out - ref).max() > 1e-5          # not exact float32
    check("emulate", q, k, v, {}, precision="tf32")


def round_tf32(x):
    """float32 -> the nearest tf32 value (ties away from zero, as cvt.rna), finite inputs."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def tf32_rounded_reference(q, k, v):
    """Attention over one key tile as precision="tf32" computes it: q, k, v and the weights P
    rounded to nearest tf32, the sums and the normaliser l (of the unrounded weights) exact."""
    q, k, v = (round_tf32(x).astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (round_tf32(p.astype(np.float32)).astype(np.float64) @ v) / p.sum(-1, keepdims=True)


@needs_emulation
@pytest.mark.parametrize("tiles", ["rounded", "truncated"])
def test_tf32_rounds_to_nearest(tiles):
    """Operands are rounded (cvt.rna), not truncated as the tensor core would on its own: with
    one key tile the output matches the rounded-input reference to float32 accumulation error,
    far below the tf32 rounding error that a kernel feeding raw K and V tiles shows."""
    q, k, v, _ = make_case(11, batch=(2,), lq=40, lk=32, d=64, dv=64, dtype=np.float32)
    sources = None
    if tiles == "truncated":
        text = source.read_kernel_file("mma_fragments.cuh")
        flag = "    static constexpr bool kRoundTiles = true;\n"
        assert text.count(flag) == 1
        sources = {"mma_fragments.cuh": text.replace(flag, flag.replace("true", "false"))}
    out, _ = run_mma("emulate", q, k, v, precision="tf32", kernel_sources=sources)
    err = np.abs(out - tf32_rounded_reference(q, k, v)).max()
    assert (err < 2e-6) == (tiles == "rounded"), err


# --------------------------------------------------------------------------------------------
# dispatch and heuristics (pure functions)


def test_dispatch_picks_the_family():
    cases = [("float16", 64, 64, "highest", True), ("bfloat16", 256, 256, "highest", True),
             ("float64", 128, 128, "highest", True), ("float64", 64, 256, "highest", False),
             ("float32", 64, 64, "highest", False), ("float32", 64, 64, "tf32", True),
             ("float32", 256, 200, "tf32", True), ("float16", 300, 64, "highest", False)]
    for dtype, d, dv, precision, expected in cases:
        assert heuristics.uses_mma(dtype, d, dv, precision) is expected, (dtype, d, dv)


def test_mma_tiles_fit_the_budgets():
    for (arch, dtype, bucket), builtin in heuristics.MMA_TILES.items():
        for width in {bucket, bucket // 2 + 1}:
            for lq in (1, 16, 17, 33, 64, 65, 4096):
                tiles = heuristics.choose_mma_tiles(dtype, width, width, lq, arch)
                spec = AttentionMmaSpec(dtype=dtype, d=width, dv=width, **tiles._asdict())
                assert spec.shared_bytes <= heuristics.SMEM_OPT_IN_LIMIT[arch], spec.key
                rows = 16 * tiles.m_tiles
                assert (tiles.warps - 1) * rows < lq       # no warp without a row
                assert tiles.m_tiles == (1 if lq <= 16 * builtin.warps else builtin.m_tiles)
                assert tiles.warps <= builtin.warps
                # one exception: sm_80, one warp, 16-bit at D = 128 takes 32 keys (a 4-byte
                # spill at 64, see choose_mma_tiles)
                decode_128 = (arch == "sm_80" and tiles.warps == 1 and bucket == 128
                              and dtype in ("float16", "bfloat16"))
                assert tiles.block_n == (32 if decode_128 else builtin.block_n), spec.key
                assert tiles.stages == builtin.stages, spec.key
    # the exception itself, pinned: one-warp f16 at D = 128 on sm_80 takes 32-key tiles
    assert heuristics.choose_mma_tiles("float16", 128, 128, 1, "sm_80").block_n == 32
    assert heuristics.choose_mma_tiles("float16", 128, 128, 1, "sm_90").block_n == 64


def test_plan_keys_are_readable():
    q, k, v, _ = make_case(1, lq=4096 // 64, lk=64, d=64, dv=64, dtype=np.float16)
    p = problem_of("emulate", q, k, v, causal=True)
    plan = families.plan_attention(p, Launch())
    # 64 queries: four warps of one 16-row query tile (two per warp from 65 queries on)
    assert plan.spec.key == "attention_fwd_mma_f16_d64_dv64_bm64_bn32_s2_window"
    assert plan.block == (128, 1, 1) and plan.shared_bytes == plan.spec.shared_bytes
    q, k, v, _ = make_case(1, lq=65, lk=64, d=64, dv=64, dtype=np.float16)
    plan = families.plan_attention(problem_of("emulate", q, k, v), Launch())
    assert plan.spec.key == "attention_fwd_mma_f16_d64_dv64_bm96_mt2_bn32_s2"   # 3 x 32 rows
    assert plan.block == (96, 1, 1)
    forced = families.plan_attention(p, Launch(family="attention_fwd_simt"))
    assert forced.spec.family == "attention_fwd_simt"


def test_source_pastes_the_family_headers():
    spec = AttentionMmaSpec(dtype="float16", d=64, dv=64, warps=4, block_n=64, stages=2)
    text = source.build_source(spec)
    order = [text.index(m) for m in ("struct SoftmaxState", "namespace tc {",
                                     "cuonline_attention_combine(", "cuonline_attention_mma(")]
    assert order == sorted(order)


# --------------------------------------------------------------------------------------------
# the PTX: each element type issues its tensor-core instruction

PTX_EXPECTED = {
    "float16": ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                "cp.async.cg.shared.global", "cp.async.wait_group"],
    "bfloat16": ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                 "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                 "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                 "cp.async.cg.shared.global", "cp.async.wait_group"],
    "float32": ["mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32",
                "cp.async.cg.shared.global"],
    "float64": ["mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64",
                "cp.async.cg.shared.global"],
}


@needs_nvrtc
@pytest.mark.parametrize("dtype", sorted(PTX_EXPECTED))
def test_ptx_holds_the_tensor_core_instructions(dtype):
    spec = AttentionMmaSpec(dtype=dtype, d=64, dv=64, warps=4, block_n=32, stages=2)
    ptx, _ = nvrtc.compile_ptx(source.build_source(spec), "sm_80", name=f"{spec.key}.cu")
    assert spec.instruction == MMA_INSTRUCTIONS[dtype][0]
    for instruction in PTX_EXPECTED[dtype]:
        assert instruction in ptx, f"{instruction} not in the PTX of {spec.key}"
    others = {i for dt, (i, _) in MMA_INSTRUCTIONS.items() if dt != dtype}
    assert not any(i in ptx for i in others)
    # the element-wise loader issues no cp.async
    plain = AttentionMmaSpec(dtype=dtype, d=64, dv=64, warps=4, block_n=32, stages=2, cp_async=False)
    ptx, _ = nvrtc.compile_ptx(source.build_source(plain), "sm_80", name=f"{plain.key}.cu")
    assert "cp.async.cg" not in ptx and spec.instruction in ptx


# --------------------------------------------------------------------------------------------
# mutants: deliberately broken kernels that the matrix must catch

MMA_MUTANTS = {
    # name: dtype id of the case that runs it (49 query rows: 4 warps of one 16-row tile each)
    "mma_k_frag_swapped": "f16",
    "mma_tf32_pv_order": "tf32",
    "mma_no_cp_async_wait": "f16",
    "mma_no_stage_sync": "tf32",  # a race: the emulation runs warps out of step
    "mma_m_tiles_share_p": "f16",  # run with 100 rows: 4 warps of two query tiles
    "no_rescale": "f64",       # common.cuh's SoftmaxState, shared with the SIMT family
}


@needs_emulation
@pytest.mark.parametrize("name", sorted(MMA_MUTANTS))
def test_mutants_fail_the_oracle_comparison(name):
    dt, precision = DTYPES[MMA_MUTANTS[name]]
    lq = 100 if name == "mma_m_tiles_share_p" else 49
    q, k, v, _ = make_case(4, lq=lq, lk=129, d=32, dv=24, dtype=dt)  # 3 key tiles, ragged
    sources = mutant_sources(name)
    out, _ = run_mma("emulate", q, k, v, precision=precision, return_lse=True,
                     kernel_sources=sources)
    ref_out, _ = reference_attention(q, k, v)
    err = np.nanmax(np.abs(out - ref_out), initial=0.0)
    threshold = {"f16": 0.04, "tf32": 0.01, "f64": 1e-6}[MMA_MUTANTS[name]]
    broken = (not np.isfinite(out).all()) or err > threshold
    assert broken, (name, err)
    # and the real kernel passes the same case
    check("emulate", q, k, v, {}, precision=precision)


_TSAN_SCRIPT = """
import numpy as np
from support import make_case, run_mma
# 4 key tiles; 80 rows: three warps of two query tiles
q, k, v, _ = make_case(1, lq=80, lk=200, d=32, dv=24, dtype=np.float16)
out, lse = run_mma("emulate", q, k, v, num_sms=1, return_lse=True,
                   kernel_sources={sources!r}, emulate_options=dict(tsan=True))
print("DONE", out.shape)
"""


@pytest.mark.parametrize("name", [None, "mma_no_stage_sync"], ids=["correct", "no_stage_sync"])
def test_thread_sanitizer(name):
    sources = mutant_sources(name) if name else None
    check_races(_TSAN_SCRIPT.format(sources=sources), expect_race=name is not None)
