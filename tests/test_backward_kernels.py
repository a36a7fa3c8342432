"""The CUDA backward kernels (``attention_bwd_simt``) against the float64 oracle.

Emulated on the CPU (``backend="emulate"``) and, marked ``gpu``, on CuPy arrays, through the
engine's per-batch entry :func:`cuonline.engines.cuda_backward.gradients`. Tolerances: the
accuracy rule of ``tests/support.py`` (FlashAttention's): the error against
:func:`oracle.reference_attention_backward` is at most a small multiple of the error of the
naive computation in the same precision (:func:`oracle.naive_attention_backward`), plus a floor.
Then determinism (bitwise), zero and NaN rows, the host's dS reductions, the planner, the
listing, and ThreadSanitizer. The barrier mutants of ``attention_bwd_simt.cu`` run in
``tests/test_barrier_mutants.py`` (its case ``bwd_simt`` in ``tests/support.py``).

Every distinct option set is one emulated compile (~20-40 s on 2 cores): the matrix is small.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from mutants import barrier_mutant_sources, barrier_mutants
import support
from support import (BFLOAT16, check_races, cuda_backend_params, make_case, needs_emulation,
                     problem_of)

from cuonline.kernels import families, features, heuristics
from cuonline.kernels.launch import Launch
from cuonline.kernels.source import read_kernel_file
from cuonline.kernels.specs import AttentionBwdSimtSpec

BACKENDS = cuda_backend_params()
DTYPES = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])
GRADIENTS = ("dq", "dk", "dv", "dbias")

# --------------------------------------------------------------------------------------------
# running the engine


def run_backward(backend, q, k, v, dout, options, *, kernel_sources=None, emulate_options=None):
    """The per-batch gradients of the CUDA engine (NumPy results) at the NumPy engine's
    forward out and lse."""
    import cuonline
    from cuonline.engines import cuda_backward
    from cuonline.engines.target import overrides
    out, lse = cuonline.attention(q, k, v, backend="numpy", return_lse=True, **options)
    p = problem_of(backend, q, k, v, **options)
    xp = p.xp
    # the SIMT family for every dtype (the tensor-core one has tests/test_backward_mma.py)
    with overrides(kernel_sources=kernel_sources, emulate_options=emulate_options,
                   family="attention_bwd_simt"):
        g = cuda_backward.gradients(p, xp.asarray(dout), xp.asarray(out), xp.asarray(lse))
    return {n: (None if x is None else (x.get() if xp is not np else np.asarray(x)))
            for n, x in g.items()}


def case(seed, dtype, options=(), *, lq=70, lk=45, d=16, dv=24, batch=(2,)):
    """q, k, v, dout and the options: 70 queries and 45 keys are 3 and 2 tiles of 32 with
    ragged tails (the default float32 tiles are 32 x 32 at these widths)."""
    q, k, v, opts = make_case(seed, batch=batch, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype,
                              options=options)
    dout = np.random.default_rng(seed + 1).standard_normal(batch + (lq, dv)).astype(dtype)
    return q, k, v, dout, opts


def check_gradients(got, q, k, v, dout, options):
    """The per-batch gradients of :func:`run_backward` by the accuracy rule (tests/support.py):
    its ``dbias``, one per batch element, is the gradient of a bias of the full batch shape."""
    if options.get("bias") is not None:
        full = np.broadcast_shapes(q.shape[:-1], dout.shape[:-1]) + (k.shape[-2],)
        options = dict(options, bias=np.broadcast_to(options["bias"], full))
    support.check_gradients(got, dout, q, k, v, options)


# --------------------------------------------------------------------------------------------
# the emulated matrix


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_matches_the_reference_with_tails_both_ways(backend, dtype):
    for lq, lk in ((70, 45), (33, 97), (1, 5)):      # Lq > Lk, Lq < Lk, a single query
        q, k, v, dout, opts = case(lq * 100 + lk, dtype, lq=lq, lk=lk)
        check_gradients(run_backward(backend, q, k, v, dout, opts), q, k, v, dout, opts)


#: One compile each: the common options first, then the soft cap of the whole logit.
OPTION_SETS = [
    ("causal",),
    ("causal", "offsets"),
    ("window", "scale"),
    ("bias", "mask", "kv_lengths", "alibi_slopes", "softcap"),
    ("softcap_bias", "window", "alibi_slopes"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTION_SETS, ids="-".join)
def test_options_float32(backend, options):
    # square (the causal diagonal through every tile), both ragged shapes, and band edges on
    # a tile edge (32-row tiles): Lk - Lq = 1 puts a causal key tile's first query at 31 mod
    # 32, Lk - Lq = 8 the window's last one at 0 mod 32
    for lq, lk in ((65, 65), (70, 45), (40, 75), (64, 65), (65, 73)):
        q, k, v, dout, opts = case(lq + 7 * lk, np.float32, options, lq=lq, lk=lk)
        check_gradients(run_backward(backend, q, k, v, dout, opts), q, k, v, dout, opts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_option_float64(backend):
    options = ("causal", "offsets", "bias", "mask", "kv_lengths", "alibi_slopes", "softcap_bias")
    q, k, v, dout, opts = case(11, np.float64, options)
    check_gradients(run_backward(backend, q, k, v, dout, opts), q, k, v, dout, opts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float16] + ([BFLOAT16] if BFLOAT16 is not None else []),
                         ids=lambda d: np.dtype(d).name)
def test_16bit_with_options(backend, dtype):
    options = ("causal", "bias", "mask", "kv_lengths", "softcap")
    q, k, v, dout, opts = case(12, dtype, options, lq=65, lk=70)
    check_gradients(run_backward(backend, q, k, v, dout, opts), q, k, v, dout, opts)


@needs_emulation
def test_two_runs_are_bitwise_identical():
    q, k, v, dout, opts = case(5, np.float32, OPTION_SETS[3])
    first = run_backward("emulate", q, k, v, dout, opts)
    second = run_backward("emulate", q, k, v, dout, opts)
    for name in GRADIENTS:
        assert first[name].tobytes() == second[name].tobytes(), name


@needs_emulation
def test_rows_that_see_no_key_get_zeros_and_padding_is_never_read():
    q, k, v, dout, opts = case(6, np.float32, OPTION_SETS[3])
    lengths = opts["kv_lengths"]                       # batch 0 sees no key at all
    assert lengths.flat[0] == 0
    # NaN padding past each batch element's length: never read, so no gradient sees it
    for b, n in enumerate(lengths):
        k[b, n:] = np.nan
        v[b, n:] = np.nan
    g = run_backward("emulate", q, k, v, dout, opts)
    for name in GRADIENTS:
        assert np.isfinite(g[name]).all(), name
    assert not g["dq"][0].any() and not g["dbias"][0].any()
    for b, n in enumerate(lengths):
        assert not g["dk"][b, n:].any() and not g["dv"][b, n:].any()
    # the fully masked row of the mask (row 0) has no gradient in any batch element
    assert not g["dq"][:, 0].any() and not g["dbias"][:, 0].any()


@needs_emulation
def test_nan_stays_in_its_rows_and_behind_the_mask():
    q, k, v, dout, opts = case(8, np.float32, ("causal",), lq=65, lk=65)
    q[0, 5, 3] = np.nan            # query 5 of batch 0 sees keys 0..5 (causal)
    k[1, 40, 0] = np.nan           # key 40 of batch 1: seen by queries 40..64 only
    g = run_backward("emulate", q, k, v, dout, opts)
    bad_dq = ~np.isfinite(g["dq"]).all(axis=-1)
    assert bad_dq[0].tolist() == [i == 5 for i in range(65)]
    assert bad_dq[1].tolist() == [i >= 40 for i in range(65)]
    # dK and dV of a key are NaN where a NaN row's weights reach it: batch 0's keys 0..5;
    # in batch 1 rows 40..64 have a NaN lse, and row 64 sees every key
    for name in ("dk", "dv"):
        bad = ~np.isfinite(g[name]).all(axis=-1)
        assert bad[0].tolist() == [j <= 5 for j in range(65)], name
        assert bad[1].all(), name


# --------------------------------------------------------------------------------------------
# the public API on the emulated engine (gradients against the oracle on every engine:
# tests/test_semantics.py, support.GRADIENT_CASES)


@needs_emulation
def test_a_shared_bias_gradient_is_the_fixed_order_sum_of_its_elements():
    # the in-place accumulation over the heads sharing a bias: bitwise the per-element
    # gradients (cuda_backward.gradients without a bias shape) added head after head, and
    # bitwise the same in two runs
    import cuonline
    from cuonline.engines import cuda_backward
    rng, q, k, v = support.gradient_case(np.float32)
    options = support.GRADIENT_CASES["head-shared-bias"](rng)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    first, second = (cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate",
                                                 **options) for _ in range(2))
    assert first.dbias.tobytes() == second.dbias.tobytes()
    each = cuda_backward.gradients(problem_of("emulate", q, k, v, **options), dout, out,
                                   lse)["dbias"]
    want = each[:, 0].copy()
    for head in range(1, each.shape[1]):
        want += each[:, head]
    assert first.dbias.shape == (2, 1, 37, 41)
    assert first.dbias[:, 0].astype(np.float32).tobytes() == want.tobytes()


@needs_emulation
@pytest.mark.parametrize("radius", [0, 1, 60], ids=lambda r: f"radius{r}")
def test_rel_k_rows_from_the_end_partials_and_the_diagonal_kernel(radius):
    # rel_k's end rows come from the dQ kernel's tile partials, the rows between from the rel_k
    # kernel (one warp per diagonal): radius 0 (one row, no rel_k launch), 1 (the two end rows
    # and one diagonal) and 60 (every distance exact, the diagonals cut by the key lengths and
    # the window), with per-element kv_lengths and a head-shared rel_k
    import cuonline
    rng, q, k, v = support.gradient_case(np.float64)
    options = dict(rel_q=rng.standard_normal((3, 37, 5)),
                   rel_k=rng.standard_normal((2, 1, 2 * radius + 1, 5)),
                   kv_lengths=np.array([41, 23])[:, None], window=(30, 4), q_offset=2)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape)
    got = cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", **options)
    support.check_gradients(got, dout, q, k, v, options)


@needs_emulation
def test_nan_in_relative_rows_nobody_sees_stays_out_of_the_other_gradient():
    # issue 22 item 2: under causal no query sees distances > 0, and with Lq > Lk queries
    # 0..2 see no key; NaN there must give the gradients of zeros there (those places
    # contribute exactly zero), not drel_q (drel_k) NaN through 0 * NaN in a matrix product
    import cuonline
    rng = np.random.default_rng(3)
    lq, lk, radius = 12, 9, 3
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (lq, lk, lk))
    rel_q, rel_k = rng.standard_normal((lq, 4)), rng.standard_normal((2 * radius + 1, 4))
    rel_q[:3] = rel_k[radius + 1:] = np.nan
    clean = dict(causal=True, rel_q=np.nan_to_num(rel_q, nan=0.0),
                 rel_k=np.nan_to_num(rel_k, nan=0.0))
    options = dict(causal=True, rel_q=rel_q, rel_k=rel_k)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape)
    got = cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", **options)
    support.check_gradients(got, dout, q, k, v, clean)
    assert not got.drel_q[:3].any() and not got.drel_k[radius + 1:].any()


@pytest.mark.parametrize("lq, lk, d, dv", [(0, 5, 4, 4), (5, 0, 4, 4), (5, 6, 0, 4),
                                           (5, 6, 4, 0), (1, 1, 1, 1)])
def test_empty_lengths_and_heads_agree_with_the_numpy_engine(lq, lk, d, dv):
    import cuonline
    rng = np.random.default_rng(lq + 10 * lk + 100 * d + 1000 * dv)
    q, k = rng.standard_normal((2, lq, d)), rng.standard_normal((2, lk, d))
    v, bias = rng.standard_normal((2, lk, dv)), rng.standard_normal((lq, lk))
    out, lse = cuonline.attention(q, k, v, return_lse=True, bias=bias)
    dout = rng.standard_normal(out.shape)
    got = cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", bias=bias)
    want = cuonline.attention_backward(dout, q, k, v, out, lse, backend="numpy", bias=bias)
    for field in ("dq", "dk", "dv", "dbias"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.shape == w.shape and np.allclose(g, w, rtol=0, atol=1e-13), field


# --------------------------------------------------------------------------------------------
# issue 22 item 6: an lse that cannot belong to the inputs (the dQ kernel sums each row's P)


def lse_case(dtype, *, lq=40, lk=45):
    """dout, q, k, v, out, lse and the options of a causal case in which every query of
    batch element 1 sees keys and none of batch element 0 does (kv_lengths 0: lse -inf)."""
    import cuonline
    q, k, v, dout, opts = case(31, dtype, ("causal",), lq=lq, lk=lk)
    opts = dict(opts, kv_lengths=np.array([0, lk]))
    out, lse = cuonline.attention(q, k, v, backend="numpy", return_lse=True, **opts)
    return dout, q, k, v, out, lse, opts


def wrong_lses(lse):
    """The issue's wrong lse values, each off on batch element 1 (whose rows see keys)."""
    neg_inf = lse.copy()
    neg_inf[1, 7] = -np.inf
    return {"+5": lse + 5, "-50": lse - 50, "-inf on a row that sees keys": neg_inf}


def simt_gradients(dout, q, k, v, out, lse, opts, sources=None):
    from cuonline.engines import cuda_backward
    from cuonline.engines.target import overrides
    with overrides(family="attention_bwd_simt", kernel_sources=sources):
        return cuda_backward.gradients(problem_of("emulate", q, k, v, **opts), dout, out, lse)


@needs_emulation
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_an_lse_that_does_not_belong_to_the_inputs_is_refused(dtype):
    dout, q, k, v, out, lse, opts = lse_case(dtype)
    assert (lse[0] == -np.inf).all() and np.isfinite(lse[1]).all()
    g = simt_gradients(dout, q, k, v, out, lse, opts)
    assert not g["dq"][0].any() and np.isfinite(g["dq"]).all()
    for name, wrong in wrong_lses(lse).items():
        with pytest.raises(ValueError, match=r"`lse` must be the one attention returned.*"
                                             r"row \(1, "):
            simt_gradients(dout, q, k, v, out, wrong, opts)


@needs_emulation
@pytest.mark.parametrize("mutant", ["bwd_simt_no_row_sum", "bwd_weight_zero_under_neg_inf_lse"])
def test_the_lse_check_catches_a_kernel_without_its_row_sums(mutant):
    from mutants import mutant_sources
    dout, q, k, v, out, lse, opts = lse_case(np.float32, lq=20, lk=24)
    wrong = wrong_lses(lse)["-inf on a row that sees keys"]
    sources = mutant_sources(mutant)
    with pytest.raises(ValueError, match="`lse`"):     # the real kernel refuses it
        simt_gradients(dout, q, k, v, out, wrong, opts)
    if mutant == "bwd_simt_no_row_sum":                 # refuses the right lse too
        with pytest.raises(ValueError, match="`lse`"):
            simt_gradients(dout, q, k, v, out, lse, opts, sources)
    else:                                               # takes the wrong one
        simt_gradients(dout, q, k, v, out, wrong, opts, sources)


# --------------------------------------------------------------------------------------------
# the reductions of dS


@pytest.mark.parametrize("rows", [2**31, 2**40], ids=["2**31", "2**40"])
def test_a_bias_block_larger_than_the_sequence_is_one_block(rows):
    # issue 22 item 7: dS was padded to a multiple of the block (384 GiB for 2**31 rows, a
    # MemoryError; 192 TiB for 2**40); the forward and the NumPy backward clip the block
    import cuonline
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (9, 11, 11))
    bias = rng.standard_normal((1, 4))           # one block row, blocks of 3 keys
    options = dict(bias=bias, bias_block=(rows, 3))
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape)
    got = cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", **options)
    want = cuonline.attention_backward(dout, q, k, v, out, lse, backend="numpy", **options)
    assert got.dbias.shape == bias.shape
    for field in ("dq", "dk", "dv", "dbias"):
        assert np.allclose(getattr(got, field), getattr(want, field), rtol=0, atol=1e-13), field


@pytest.mark.parametrize("block_r", [4, 16, 64])
def test_query_tiles_sharing_a_block_bias_slot_share_no_block_row(block_r):
    # the dQ kernel's query tile t adds its block sums into slot t % slots, with no atomics:
    # two tiles of one slot must never meet the same block row
    from cuonline.engines.cuda_backward import block_bias_slots
    for lq in (1, 5, 64, 100, 257):
        tiles = -(-lq // block_r)
        for rows in {1, 2, 3, 5, 7, 16, 17, 63, 64, 65, 130, lq}:
            rows = min(rows, lq)
            slots = block_bias_slots(rows, block_r, tiles)
            owner = {}
            for t in range(tiles):
                last = min((t + 1) * block_r, lq) - 1
                for block_row in range(t * block_r // rows, last // rows + 1):
                    key = (t % slots, block_row)
                    assert owner.setdefault(key, t) == t, (lq, rows, slots, key)


@pytest.mark.parametrize("arch", ["sm_70", "sm_75", "sm_80", "sm_90"])
def test_tiles_fit_the_arch_and_the_listing_has_every_dtype(arch):
    specs = [s for s in families.listing_specs(arch) if s.family == "attention_bwd_simt"]
    assert {s.dtype for s in specs} == {"float16", "bfloat16", "float32", "float64"}
    for spec in specs:
        assert spec.shared_bytes <= heuristics.bwd_smem_limit(arch), spec.key
        assert spec.write_ds == ("bias" in spec.features and "bias_block" not in spec.features)
    # float64 D = 256 needs sm_80's opt-in shared memory; below, the planner refuses it
    big = [s for s in specs if s.dtype == "float64" and s.d == 256]
    assert bool(big) == (arch in ("sm_80", "sm_90"))
    if arch in ("sm_70", "sm_75"):
        with pytest.raises(ValueError, match="backend='numpy'"):
            heuristics.choose_bwd_tiles("float64", 256, 256, arch)


def test_spec_key_defines_and_refusals():
    spec = AttentionBwdSimtSpec(dtype="float32", acc="float32", d=64, dv=64, warps=4,
                                rows_per_warp=4, items_per_lane=1, write_ds=True,
                                features=("bias", "window"))
    assert spec.key == "attention_bwd_simt_f32_d64_dv64_br16_bc32_w4_ds_window_bias"
    defines = spec.defines()
    assert defines["CUONLINE_WRITE_DS"] == 1 and defines["CUONLINE_HAS_WINDOW"] == 1
    assert defines["CUONLINE_RETURN_LSE"] == 0 and defines["CUONLINE_SPLIT"] == 0
    for bad in (dict(features=("return_lse",)), dict(split=True), dict(features=("rel_qk",)),
                dict(dr=8), dict(features=("softcap_bias",))):
        with pytest.raises(ValueError, match="attention_bwd_simt"):
            AttentionBwdSimtSpec(dtype="float32", acc="float32", d=64, dv=64, warps=4,
                                 rows_per_warp=4, items_per_lane=1, **bad)


def test_plan_covers_every_key_and_query_tile():
    q, k, v, dout, opts = case(0, np.float32, ("bias",), lq=70, lk=45)
    plan = heuristics.plan_bwd_simt(problem_of("emulate", q, k, v, **opts), Launch())
    spec = plan.spec
    assert spec.write_ds and spec.features == ("bias",)
    assert plan.grid_dkdv == (2 * -(-45 // spec.block_r), 1, 1)
    assert plan.grid_dq == (2 * -(-70 // spec.block_r), 1, 1)
    assert "return_lse" not in features.backward_of_problem(
        problem_of("emulate", q, k, v, return_lse=True))


# --------------------------------------------------------------------------------------------
# races

# 40 queries and keys: two tiles of each, so each loop's barriers are crossed; plain, then
# with the rel_q / rel_k staging (dS written, dC reduced), then with a block bias and rel_bias
# (dS reduced in shared memory)
_TSAN_SCRIPT = """
import numpy as np
from oracle import reference_attention
from support import make_case, problem_of
from cuonline.engines import cuda_backward
from cuonline.engines.target import overrides
rng = np.random.default_rng(5)
q, k, v, _ = make_case(4, lq=40, lk=40)
dout = rng.standard_normal((2, 40, 24)).astype(np.float32)
terms = dict(rel_q=rng.standard_normal((40, 4)), rel_k=rng.standard_normal((9, 4)),
             bias=rng.standard_normal((40, 40)))
reduced = dict(bias=rng.standard_normal((14, 8)), bias_block=(3, 5),
               rel_bias=rng.standard_normal(9))
for options in ({{}}, terms, reduced):
    out, lse = reference_attention(q, k, v, **options)       # the lse is checked
    with overrides(kernel_sources={sources!r}, emulate_options=dict(mode="threads", tsan=True)):
        g = cuda_backward.gradients(problem_of("emulate", q, k, v, **options), dout, out, lse)
print("DONE", g["dq"].shape)
"""

#: The dK/dV kernel's barrier that keeps a query tile alive until every warp accumulated it.
_MUTANT = next(n for n in sorted(barrier_mutants()) if n.startswith("attention_bwd_simt.cu:"))


@needs_emulation   # runs the emulated kernels under TSan: slow, not in the fast tier
@pytest.mark.parametrize("name", [None, _MUTANT], ids=["correct", "barrier_removed"])
def test_thread_sanitizer(name):
    sources = barrier_mutant_sources(name) if name else None
    check_races(_TSAN_SCRIPT.format(sources=sources), expect_race=name is not None)


@pytest.mark.parametrize("family", [families.ATTENTION_BWD_SIMT, families.ATTENTION_BWD_MMA],
                         ids=lambda f: f.name)
def test_the_backward_families_use_no_atomics(family):
    # README and docs/kernels.md say the gradients are deterministic because no kernel adds
    # with atomics (whose order varies run to run): every file a backward family compiles
    import re

    from cuonline.kernels.source import read_kernel_file
    for name in (*family.headers, family.source):
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", read_kernel_file(name), flags=re.S)
        assert not re.search(r"\batomic\w*\s*\(|\bred\.\w*", code), name


# --------------------------------------------------------------------------------------------
# the gradients reduced in the kernels: no (Lq, Lk) workspace unless it is the gradient


def _emulated_and_numpy_gradients(dtype, family, lq, lk, **options):
    import cuonline
    from cuonline.engines.target import overrides
    rng = np.random.default_rng(lq * 1000 + lk)
    q, k = (rng.standard_normal((2, n, 8)).astype(dtype) for n in (lq, lk))
    v = rng.standard_normal((2, lk, 8)).astype(dtype)
    out, lse = cuonline.attention(q, k, v, return_lse=True, backend="numpy", **options)
    dout = rng.standard_normal(out.shape).astype(dtype)
    with overrides(family=family):
        got = cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", **options)
    want = cuonline.attention_backward(dout, q, k, v, out, lse, backend="numpy", **options)
    return got, want


@needs_emulation
@pytest.mark.parametrize("dtype, family", [(np.float64, None), (np.float32, "attention_bwd_simt")],
                         ids=["float64-mma", "float32-simt"])
def test_block_bias_and_relative_gradients_reduced_in_the_kernel(dtype, family):
    # block rows that straddle query tiles (3, 40), span several (100), tile them exactly
    # (16), with the relative terms and a head-shared bias (one reduction over the heads)
    rng = np.random.default_rng(3)
    lq, lk = 70, 45
    tol = 1e-10 if dtype == np.float64 else 2e-4
    for rows, cols in ((3, 5), (40, 1), (100, 7), (16, 45)):
        coarse = rng.standard_normal((1, -(-lq // rows), -(-lk // cols))).astype(dtype)
        options = dict(bias=coarse, bias_block=(rows, cols), causal=True,
                       rel_bias=rng.standard_normal(9).astype(dtype),
                       rel_q=rng.standard_normal((2, lq, 3)).astype(dtype),
                       rel_k=rng.standard_normal((5, 3)).astype(dtype))
        got, want = _emulated_and_numpy_gradients(dtype, family, lq, lk, **options)
        for name in ("dbias", "drel_bias", "drel_q", "drel_k", "dq"):
            g, w = getattr(got, name), getattr(want, name)
            assert g.shape == w.shape, name
            assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max()), (rows, cols, name)


def _stubbed_backward_peak(**options):
    """Peak bytes tracemalloc sees in one emulated attention_backward whose kernels are
    replaced by a launch that only reports row sums of 1: the engine's own workspaces."""
    import tracemalloc

    import cuonline
    from cuonline.engines import target as target_module
    from cuonline.kernels import arguments

    class Module:
        def get_function(self, name):
            def launch(grid, block, args, shared_mem=0):
                args[arguments.ATTENTION_BWD_SIGNATURE.index("row_sums")][...] = 1
            return launch

    lq = lk = 512
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((2, n, 8)).astype(np.float32)
                     for n in (lq, lk, lk, lq))
    out, lse = np.zeros_like(q), np.zeros((2, lq), dtype=np.float32)
    original = target_module.Target.module
    target_module.Target.module = lambda self, spec: Module()
    try:
        tracemalloc.start()
        cuonline.attention_backward(dout, q, k, v, out, lse, backend="emulate", **options)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        target_module.Target.module = original
    return peak, 2 * lq * lk * 4          # and the bytes of one (nbatch, Lq, Lk) array


@pytest.mark.parametrize("term", ["rel_bias", "rel_qk", "bias_block"])
def test_reduced_gradients_allocate_no_array_of_places(term):
    rng = np.random.default_rng(1)
    options = {"rel_bias": dict(rel_bias=rng.standard_normal(1023).astype(np.float32)),
               "rel_qk": dict(rel_q=rng.standard_normal((2, 512, 4)).astype(np.float32),
                              rel_k=rng.standard_normal((1023, 4)).astype(np.float32)),
               "bias_block": dict(bias=rng.standard_normal((1, 128, 128)).astype(np.float32),
                                  bias_block=(4, 4))}[term]
    peak, places = _stubbed_backward_peak(**options)
    assert peak < places, f"{term}: peak {peak} bytes, one (nbatch, Lq, Lk) array {places}"


@needs_emulation
def test_reduced_gradients_are_bitwise_identical_across_runs():
    rng = np.random.default_rng(9)
    options = dict(bias=rng.standard_normal((1, 24, 9)), bias_block=(3, 5), causal=True,
                   rel_bias=rng.standard_normal(11), rel_q=rng.standard_normal((2, 70, 3)),
                   rel_k=rng.standard_normal((5, 3)))
    first, _ = _emulated_and_numpy_gradients(np.float32, "attention_bwd_simt", 70, 45, **options)
    second, _ = _emulated_and_numpy_gradients(np.float32, "attention_bwd_simt", 70, 45, **options)
    for name in ("dq", "dbias", "drel_bias", "drel_q", "drel_k"):
        assert getattr(first, name).tobytes() == getattr(second, name).tobytes(), name
