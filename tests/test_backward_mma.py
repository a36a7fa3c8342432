"""The tensor-core backward kernels (``attention_bwd_mma``) against the float64 oracle.

Emulated on the CPU (``backend="emulate"``, planned for sm_90 where 16-bit, float64 and TF32
backward calls take this family) and, marked ``gpu``, on CuPy arrays, through the public
:func:`cuonline.attention_backward`. Tolerances as ``tests/test_backward_kernels.py``
(FlashAttention's rule): the error against :func:`oracle.reference_attention_backward` is at
most twice the error of a naive computation in the input's precision (every intermediate
rounded to it, products accumulated in float32) plus a small floor. Then the dispatch rule,
bitwise determinism, zero rows, and ThreadSanitizer; the barrier mutants of
``attention_bwd_mma.cu`` run in ``tests/test_barrier_mutants.py`` (case ``bwd_mma`` in
``tests/support.py``).

Every distinct option set is one emulated compile (~30 s on 2 cores): the matrix is small.
"""

from __future__ import annotations

import numpy as np
import pytest
from mutants import barrier_mutant_sources, barrier_mutants
from oracle import reference_attention_backward
from support import BFLOAT16, check_races, cuda_backend_params, make_case, needs_emulation

from cuonline.kernels import families, features, heuristics
from cuonline.kernels.specs import AttentionBwdMmaSpec

BACKENDS = cuda_backend_params()
DTYPES16 = [np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])
GRADIENTS = ("dq", "dk", "dv", "dbias")

# --------------------------------------------------------------------------------------------
# the naive same-precision computation the tolerances are measured against


def _dense_terms(lq, lk, batch, *, scale, causal, window, bias, bias_block, mask, kv_lengths,
                 alibi_slopes, rel_bias, rel_q, rel_k, q_offset, k_offset):
    """Float64 dense pieces of the logit: the content's relative part ``rel`` (added before
    the cap), the additive part after it, and the visibility, from the documented order."""
    q_offset = lk - lq if q_offset is None else q_offset
    delta = np.arange(lk)[None, :] - np.arange(lq)[:, None] + (int(k_offset) - int(q_offset))
    rel = np.zeros(batch + (lq, lk))
    if rel_q is not None:
        radius = (rel_k.shape[-2] - 1) // 2
        table = np.asarray(rel_k, dtype=np.float64)[..., np.clip(delta, -radius, radius) + radius,
                                                    :]            # (..., lq, lk, Dr)
        rel = rel + np.einsum("...id,...ijd->...ij", np.asarray(rel_q, dtype=np.float64), table)
    add = np.zeros(batch + (lq, lk))
    if bias is not None:
        b = np.asarray(bias, dtype=np.float64)
        if bias_block is not None:
            r, c = (bias_block, bias_block) if np.isscalar(bias_block) else bias_block
            b = np.repeat(np.repeat(b, r, axis=-2), c, axis=-1)[..., :lq, :lk]
        add = add + b
    if rel_bias is not None:
        radius = (rel_bias.shape[-1] - 1) // 2
        add = add + np.asarray(rel_bias, dtype=np.float64)[..., None, :][
            ..., np.clip(delta, -radius, radius) + radius]
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64), batch)
        add = add - slopes[..., None, None] * np.abs(delta)
    visible = np.ones(batch + (lq, lk), dtype=bool)
    if causal:
        visible &= delta <= 0
    if window is not None:
        left, right = window
        visible &= (delta >= -left if left is not None else True)
        visible &= (delta <= right if right is not None else True)
    if mask is not None:
        visible &= np.asarray(mask)
    if kv_lengths is not None:
        lengths = np.broadcast_to(np.asarray(kv_lengths), batch)
        visible &= np.arange(lk) < lengths[..., None, None]
    return rel, add, visible


def to_tf32(x):
    """``x`` rounded to TF32 (10 mantissa bits, nearest with ties away from zero: cvt.rna),
    as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(
        np.float64)


def naive_backward(dout, q, k, v, dtype, *, scale=None, softcap=None, **options):
    """``{dq, dk, dv, dbias}`` (dbias dense, per batch element) with every intermediate
    rounded to ``dtype`` (``"tf32"``: to TF32) and matrix products accumulated in float32 (as
    a 16-bit or TF32 GEMM)."""
    def rnd(x):
        return to_tf32(x) if dtype == "tf32" else x.astype(dtype).astype(np.float64)

    def product(spec, a, b):
        return np.einsum(spec, rnd(a).astype(np.float32), rnd(b).astype(np.float32)).astype(
            np.float64)

    q, k, v, dout = (np.asarray(x).astype(np.float64) for x in (q, k, v, dout))
    lq, d = q.shape[-2:]
    lk = k.shape[-2]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], dout.shape[:-2])
    scale = 1.0 / np.sqrt(max(d, 1)) if scale is None else scale
    terms = {n: options.get(n) for n in ("causal", "window", "bias", "bias_block", "mask",
                                         "kv_lengths", "alibi_slopes", "rel_bias", "rel_q",
                                         "rel_k", "q_offset")}
    rel, add, visible = _dense_terms(lq, lk, batch, scale=scale, k_offset=options.get(
        "k_offset", 0), **{n: (False if n == "causal" and x is None else x)
                           for n, x in terms.items()})
    content = rnd(scale * product("...id,...jd->...ij", q, k) + rel)
    d_content = np.ones_like(content)
    if softcap is not None:
        t = np.tanh(content / softcap)
        content, d_content = softcap * t, 1 - t * t
    z = np.where(visible, content + add, -np.inf)
    m = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    e = np.where(visible, np.exp(z - np.where(np.isfinite(m), m, 0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    p = rnd(np.where(total > 0, e / np.where(total > 0, total, 1), 0.0))

    def bc(a, rows):
        return np.broadcast_to(a, batch + (rows, a.shape[-1]))

    do, vb, kb, qb = bc(dout, lq), bc(v, lk), bc(k, lk), bc(q, lq)
    dv = product("...ij,...id->...jd", p, do)
    dp = rnd(product("...id,...jd->...ij", do, vb))
    ds = rnd(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))
    g = rnd(ds * d_content * scale)
    return {"dq": rnd(product("...ij,...jd->...id", g, kb)),
            "dk": rnd(product("...ij,...id->...jd", g, qb)), "dv": rnd(dv), "dbias": ds}


#: FlashAttention's factor, and floors relative to the gradient's magnitude (as
#: tests/test_backward_kernels.py).
FACTOR = 2.0
FLOOR = {np.dtype(np.float16): 1e-5, "tf32": 1e-6, np.dtype(np.float64): 1e-13}
if BFLOAT16 is not None:
    FLOOR[BFLOAT16] = 1e-4


def _sum_to(x, shape):
    """Sum ``x`` over the leading dimensions a broadcast input of ``shape`` gained."""
    x = np.asarray(x)
    while x.ndim > len(shape):
        x = x.sum(axis=0)
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def check_gradients(got, dout, q, k, v, options, precision="highest"):
    dtype = "tf32" if precision == "tf32" else np.dtype(q.dtype)
    exact = reference_attention_backward(dout, q, k, v, **options)
    # float64: the naive computation is the reference itself, the floor alone decides
    naive = exact if dtype == np.float64 else naive_backward(dout, q, k, v, dtype, **options)
    naive = dict(naive)
    if options.get("bias") is not None and options.get("bias_block") is None:
        naive["dbias"] = _sum_to(naive["dbias"], np.shape(options["bias"]))
    else:
        naive["dbias"] = None
    for name in ("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k"):
        g = getattr(got, name)
        if exact[name] is None:
            assert g is None, name
            continue
        assert g.shape == exact[name].shape, name
        # a gradient returned in another dtype than q's (a float32 bias beside float64 q)
        # is rounded to it once more
        returned = float(np.finfo(g.dtype).eps) if g.dtype != q.dtype else 0.0
        g = np.asarray(g, dtype=np.float64)
        err = float(np.max(np.abs(g - exact[name]), initial=0.0))
        magnitude = max(1.0, float(np.max(np.abs(exact[name]), initial=0.0)))
        if naive.get(name) is not None:
            naive_err = float(np.max(np.abs(naive[name] - exact[name]), initial=0.0))
            limit = FACTOR * naive_err + (FLOOR[dtype] + returned) * magnitude
        else:
            # the coarse and relative terms' gradients: sums of the checked dS over many
            # places, in float32 on the host; held to the input precision's rounding
            eps = 2.0**-10 if dtype == "tf32" else float(np.finfo(dtype).eps)
            limit = (4 * eps + returned) * magnitude
        assert err <= limit, f"{name}: error {err:.3g} > {limit:.3g}"


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
    plan = heuristics.plan_bwd_mma(problem_of("emulate", q, k, v, **opts), arch="sm_90")
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
    want = reference_attention_backward(dout, q, k, v, **opts)
    for name in ("dq", "dk", "dv", "drel_q", "drel_k"):
        assert np.abs(getattr(got, name) - want[name]).max() <= 1e-12, name


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


@pytest.mark.parametrize("name", [None, _MUTANT], ids=["correct", "barrier_removed"])
def test_thread_sanitizer(name):
    sources = barrier_mutant_sources(name) if name else None
    check_races(_TSAN_SCRIPT.format(sources=sources), expect_race=name is not None)
