"""The tensor-core backward kernels (``attention_bwd_mma``) against the float64 oracle.

Emulated on the CPU (``backend="emulate"``, planned for sm_90 where 16-bit, float64 and TF32
backward calls take this family) and, marked ``gpu``, on CuPy arrays, through the public
:func:`cuonline.attention_backward`. Tolerances: the accuracy rule of ``tests/support.py``
(FlashAttention's): the error against :func:`oracle.reference_attention_backward` is at most
twice the error of the naive computation in the input's precision (TF32 at
``precision="tf32"``; :func:`oracle.naive_attention_backward`) plus a small floor. Then the
dispatch rule, bitwise determinism, zero rows, and ThreadSanitizer; the barrier mutants of
``attention_bwd_mma.cu`` run in ``tests/test_barrier_mutants.py`` (case ``bwd_mma`` in
``tests/support.py``).

Every distinct option set is one emulated compile (~30 s on 2 cores): the matrix is small.
"""

from __future__ import annotations

import numpy as np
import pytest
from mutants import barrier_mutant_sources, barrier_mutants
from support import (BFLOAT16, check_gradients, check_races, cuda_backend_params, make_case,
                     needs_emulation)

from cuonline.kernels import families, features, heuristics
from cuonline.kernels.launch import Launch
from cuonline.kernels.specs import AttentionBwdMmaSpec

BACKENDS = cuda_backend_params()
DTYPES16 = [np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])
GRADIENTS = ("dq", "dk", "dv", "dbias")

# --------------------------------------------------------------------------------------------
# running the engine


def run(backend, dout, q, k, v, options, precision="highest"):
    import cuonline
    from cuonline.engines.target import overrides
    # TF32: out and lse from the TF32 forward (the emulated tensor-core one), as a TF32
    # training step has them; the backward's P then comes from the scores the forward saw
    forward = "emulate" if precision == "tf32" else "numpy"
    with overrides(arch="sm_90"):
        out, lse = cuonline.attention(q, k, v, backend=forward, return_lse=True,
                                      precision=precision, **options)
    options = dict(options, precision=precision)
    if backend == "cupy":
        import cupy
        args = [cupy.asarray(x) for x in (dout, q, k, v, out, lse)]
        opts = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x)
                for n, x in options.items()}
    else:
        args, opts = [dout, q, k, v, out, lse], options
    with overrides(arch="sm_90"):
        got = cuonline.attention_backward(*args, backend=backend, **opts)
    if backend == "cupy":
        import dataclasses
        got = dataclasses.replace(got, **{f.name: getattr(got, f.name).get()
                                          for f in dataclasses.fields(got)
                                          if getattr(got, f.name) is not None})
    return got


def case(seed, dtype, options=(), *, lq=70, lk=45, d=16, dv=24, batch=(2,)):
    q, k, v, opts = make_case(seed, batch=batch, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype,
                              options=options)
    dout = np.random.default_rng(seed + 1).standard_normal(batch + (lq, dv)).astype(dtype)
    return dout, q, k, v, opts


# --------------------------------------------------------------------------------------------
# dispatch (pure)


def test_16bit_calls_on_sm80_and_newer_take_the_tensor_core_family():
    mma, simt = "attention_bwd_mma", "attention_bwd_simt"
    for arch in ("sm_80", "sm_86", "sm_90"):
        for dtype in ("float16", "bfloat16"):
            assert families.backward_family(dtype, 64, 64, ("bias", "window"), arch).name == mma
    assert families.backward_family("float16", 64, 64, (), "sm_75").name == simt
    # float32 keeps exact products unless precision="tf32"; float64 runs on DMMA
    assert families.backward_family("float32", 64, 64, (), "sm_90").name == simt
    assert families.backward_family("float32", 64, 64, (), "sm_90", "tf32").name == mma
    assert families.backward_family("float64", 64, 64, (), "sm_90").name == mma
    # heads whose accumulators would not fit the registers
    assert families.backward_family("float16", 256, 64, (), "sm_90").name == simt
    assert families.backward_family("float64", 128, 64, (), "sm_90").name == simt
    assert families.backward_family("float32", 128, 64, (), "sm_90", "tf32").name == simt
    # the soft cap of the whole logit is not compiled into the tensor-core family
    assert "softcap_bias" not in features.MMA_BACKWARD_FEATURES
    assert families.backward_family("float16", 64, 64, ("softcap", "softcap_bias"),
                                    "sm_90").name == simt


def test_spec_key_and_refusals():
    spec = AttentionBwdMmaSpec(dtype="float16", d=64, dv=64, warps=4, block_c=64,
                               write_ds=True, features=("bias", "window"))
    assert spec.key == "attention_bwd_mma_f16_d64_dv64_br64_bc64_ds_window_bias"
    assert spec.defines()["CUONLINE_BLOCK_C"] == 64 and spec.acc == "float32"
    for bad in (dict(dtype="int8"), dict(d=256), dict(block_c=24),
                dict(features=("softcap", "softcap_bias")), dict(split=True)):
        kwargs = {**dict(dtype="float16", d=64, dv=64, warps=4, block_c=64), **bad}
        with pytest.raises(ValueError, match="attention_bwd_mma|bad tile"):
            AttentionBwdMmaSpec(**kwargs)


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_listing_fits_the_arch(arch):
    specs = [s for s in families.listing_specs(arch) if s.family == "attention_bwd_mma"]
    assert bool(specs) == (arch != "sm_75")
    for spec in specs:
        assert spec.shared_bytes <= heuristics.mma_smem_limit(arch), spec.key


def test_plan_covers_every_tile():
    from support import problem_of
    dout, q, k, v, opts = case(0, np.float16, ("bias",), lq=70, lk=145)
    plan = heuristics.plan_bwd_mma(problem_of("emulate", q, k, v, **opts), Launch(arch="sm_90"))
    assert plan.spec.write_ds and plan.spec.block_r == 64
    assert plan.grid_dkdv == (2 * 3, 1, 1) and plan.grid_dq == (2 * 2, 1, 1)


# --------------------------------------------------------------------------------------------
# the emulated matrix


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES16, ids=lambda d: np.dtype(d).name)
def test_every_16bit_dtype_matches_the_oracle_with_tails_both_ways(backend, dtype):
    # Lq > Lk and Lq < Lk with ragged tails, a single query, and three tiles of 64 each way
    for lq, lk in ((70, 45), (33, 97), (1, 5), (150, 140)):
        dout, q, k, v, opts = case(lq * 100 + lk, dtype, lq=lq, lk=lk)
        check_gradients(run(backend, dout, q, k, v, opts), dout, q, k, v, opts)


#: One compile each.
OPTION_SETS = [
    ("causal", "offsets"),
    ("window", "scale", "bias", "mask", "kv_lengths", "alibi_slopes", "softcap"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTION_SETS, ids="-".join)
def test_options_float16(backend, options):
    # square (the causal diagonal through every tile), both ragged shapes, several tiles
    for lq, lk in ((65, 65), (140, 75), (40, 150), (129, 130)):
        dout, q, k, v, opts = case(lq + 7 * lk, np.float16, options, lq=lq, lk=lk)
        check_gradients(run(backend, dout, q, k, v, opts), dout, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, precision", [(np.float32, "tf32"), (np.float64, "highest")],
                         ids=["tf32", "float64"])
def test_tf32_and_float64_match_the_oracle(backend, dtype, precision):
    # DMMA (exact float64 products) and TF32 (operands rounded to 10 mantissa bits, so the
    # naive computation rounds to TF32 too); without options, then every option
    for options, (lq, lk) in (((), (70, 45)), ((), (33, 97)), ((), (150, 140)),
                              (OPTION_SETS[1], (129, 130))):
        dout, q, k, v, opts = case(lq * 100 + lk, dtype, options, lq=lq, lk=lk)
        got = run(backend, dout, q, k, v, opts, precision=precision)
        check_gradients(got, dout, q, k, v, opts, precision=precision)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_and_relative_terms_float16(backend):
    rng = np.random.default_rng(3)
    dout, q, k, v, _ = case(3, np.float16, lq=70, lk=80)
    opts = dict(bias=rng.standard_normal((1, 18, 12)).astype(np.float32), bias_block=(4, 7),
                rel_bias=rng.standard_normal((9,)), rel_q=rng.standard_normal((70, 5)),
                rel_k=rng.standard_normal((2, 11, 5)), causal=True, softcap=2.0)
    check_gradients(run(backend, dout, q, k, v, opts), dout, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bias_shared_by_the_heads_float16(backend):
    # dS added in place, one dQ launch per head: per-element kv_lengths and per-head slopes
    # follow the reordered batch
    rng = np.random.default_rng(8)
    dout, q, k, v, _ = case(8, np.float16, lq=70, lk=75, batch=(2, 3))
    opts = dict(bias=rng.standard_normal((2, 1, 70, 75)).astype(np.float32),
                kv_lengths=np.array([75, 40])[:, None], alibi_slopes=np.array([0.1, 0.2, 0.3]))
    check_gradients(run(backend, dout, q, k, v, opts), dout, q, k, v, opts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_take_the_element_wise_loader(backend):
    # q and k as views of their transposes (column stride L): no cp.async, the element-wise
    # loader fills the same shared-memory layout
    dout, q, k, v, opts = case(9, np.float16, ("causal",), lq=70, lk=75, d=16, dv=16)
    q, k = (np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2) for x in (q, k))
    from cuonline.kernels import arguments
    from support import problem_of
    assert not arguments.cp_async_aligned(problem_of("emulate", q, k, v, **opts))
    check_gradients(run(backend, dout, q, k, v, opts), dout, q, k, v, opts)


@needs_emulation
def test_a_block_too_large_for_the_arch_falls_back_to_the_simt_family():
    # float64 with Dr = 64 needs 153 KiB on the tensor cores, beyond sm_86's 99 KiB
    import cuonline
    from cuonline.engines.target import overrides
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((n, 8)) for n in (5, 6, 6))
    opts = dict(rel_q=rng.standard_normal((5, 64)), rel_k=rng.standard_normal((3, 64)))
    with pytest.raises(ValueError, match="sm_86"):
        heuristics.choose_bwd_mma_tiles("float64", 8, 8, "sm_86", dr=64)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    with overrides(arch="sm_86"):
        got = cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", **opts)
    check_gradients(got, dout, q, k, v, opts)


@needs_emulation
def test_two_runs_are_bitwise_identical():
    dout, q, k, v, opts = case(5, np.float16, OPTION_SETS[1], lq=100, lk=90)
    first = run("emulate", dout, q, k, v, opts)
    second = run("emulate", dout, q, k, v, opts)
    for name in GRADIENTS:
        assert getattr(first, name).tobytes() == getattr(second, name).tobytes(), name


@needs_emulation
def test_rows_that_see_no_key_get_zeros():
    dout, q, k, v, opts = case(6, np.float16, OPTION_SETS[1], lq=70, lk=45)
    got = run("emulate", dout, q, k, v, opts)
    assert opts["kv_lengths"].flat[0] == 0           # batch 0 sees no key at all
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(getattr(got, name)).all(), name
    assert not got.dq[0].any() and not got.dk[0].any() and not got.dv[0].any()
    assert not got.dq[:, 0].any()                    # the mask's fully masked row 0


@needs_emulation
def test_a_nan_input_runs_on_the_simt_family_and_stays_in_its_rows():
    # the mmas would carry 0 * NaN into every key of the tile: the engine keeps such calls on
    # the SIMT family, so the NaN of query 5 reaches only the keys query 5 sees (causal)
    dout, q, k, v, opts = case(8, np.float16, ("causal",), lq=40, lk=40)
    q[0, 5, 3] = np.nan
    got = run("emulate", dout, q, k, v, opts)
    assert (~np.isfinite(got.dq[0]).all(axis=-1)).tolist() == [i == 5 for i in range(40)]
    assert (~np.isfinite(got.dk[0]).all(axis=-1)).tolist() == [j <= 5 for j in range(40)]
    assert np.isfinite(got.dq[1]).all()


@needs_emulation
def test_a_nan_in_keys_shared_by_the_heads_is_found_and_stays_in_its_rows():
    # k and v broadcast over the 2 heads (a zero stride): the finiteness check scans each of
    # their elements once, finds the NaN of key 7, and the call stays on the SIMT family, so
    # only the queries that see key 7 (causal: i >= 7) get a non-finite dq
    dout, q, k, v, opts = case(9, np.float16, ("causal",), lq=40, lk=40)
    k, v = k[:1], v[:1]
    k[0, 7, 2] = np.nan
    got = run("emulate", dout, q, k, v, opts)
    assert got.dk.shape == k.shape
    for head in range(2):
        assert (~np.isfinite(got.dq[head]).all(axis=-1)).tolist() == [i >= 7 for i in range(40)]


@needs_emulation
@pytest.mark.parametrize("mutant", [None, "bwd_mma_no_row_sum"], ids=["real", "no_row_sum"])
def test_an_lse_that_does_not_belong_to_the_inputs_is_refused(mutant):
    # issue 22 item 6 on the tensor-core family: every query of batch element 1 sees keys
    # (causal, Lk > Lq), none of batch element 0 (kv_lengths 0: lse -inf).
    # Without the dQ kernel's sum of P (the mutant) the right lse is refused too, which also
    # shows that this family ran.
    import cuonline
    from mutants import mutant_sources

    from cuonline.engines.target import overrides
    dout, q, k, v, opts = case(31, np.float16, ("causal",), lq=40, lk=45)
    opts = dict(opts, kv_lengths=np.array([0, 45]))
    out, lse = cuonline.attention(q, k, v, return_lse=True, **opts)
    neg_inf = lse.copy()
    neg_inf[1, 7] = -np.inf
    sources = mutant_sources(mutant) if mutant else None

    def backward(lse):
        with overrides(arch="sm_90", kernel_sources=sources):
            return cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate",
                                               **opts)

    if mutant:
        with pytest.raises(ValueError, match="`lse`"):
            backward(lse)
        return
    assert np.isfinite(backward(lse).dq).all()
    for wrong in (lse + 5, lse - 50, neg_inf):
        with pytest.raises(ValueError, match=r"`lse` must be the one attention returned.*"
                                             r"row \(1, "):
            backward(wrong)


def test_the_finiteness_scan_reads_each_element_of_a_broadcast_view_once():
    from cuonline.engines import cuda_backward
    x = np.arange(6.0).reshape(2, 3)
    view = np.broadcast_to(x[:, None], (2, 4, 3))        # 4 copies along a zero stride
    assert cuda_backward._distinct(view).shape == (2, 1, 3)
    assert cuda_backward._distinct(x).shape == (2, 3)


# --------------------------------------------------------------------------------------------
# races: 150 queries and 140 keys are three tiles of 64 each way, so each loop's barriers are
# crossed several times; plain, then with the rel_q / rel_k staging (and dS, dC written)

_TSAN_SCRIPT = """
import numpy as np
from oracle import reference_attention
from support import make_case, problem_of
from cuonline.engines import cuda_backward
from cuonline.engines.target import overrides
rng = np.random.default_rng(5)
q, k, v, _ = make_case(4, lq=150, lk=140, dtype=np.float16)
dout = rng.standard_normal((2, 150, 24)).astype(np.float16)
terms = dict(rel_q=rng.standard_normal((150, 4)), rel_k=rng.standard_normal((9, 4)),
             bias=rng.standard_normal((150, 140)))
for options in ({{}}, terms):
    out, lse = reference_attention(q, k, v, **options)       # the lse is checked
    with overrides(arch="sm_90", kernel_sources={sources!r},
                   emulate_options=dict(mode="threads", tsan=True)):
        g = cuda_backward.gradients(problem_of("emulate", q, k, v, **options), dout, out, lse)
print("DONE", g["dq"].shape)
"""

#: The dK/dV kernel's barrier that keeps a query tile alive until every warp accumulated it.
_MUTANT = next(n for n in sorted(barrier_mutants()) if n.startswith("attention_bwd_mma.cu:"))


@needs_emulation   # runs the emulated kernels under TSan: slow, not in the fast tier
@pytest.mark.parametrize("name", [None, _MUTANT], ids=["correct", "barrier_removed"])
def test_thread_sanitizer(name):
    sources = barrier_mutant_sources(name) if name else None
    check_races(_TSAN_SCRIPT.format(sources=sources), expect_race=name is not None)
