"""The CUDA kernels' block bias, relative bias and relative query/key terms (issue 12).

Both forward families (the SIMT kernel and the tensor-core kernel, forced through
``overrides(family=...)``) run emulated on the CPU and, marked ``gpu``, on CuPy, against the
float64 oracle (tests/oracle.py builds each term densely from its definition): each term alone
and combined with causal, window, ALiBi, soft caps, kv_lengths, mask and positions, on shapes
with query and key tails, several tiles of each and the causal diagonal crossing a key tile;
float32/float64 and 16-bit. Then chunkings merged with ``merge``; mutants of the new code that
the cases must catch; ThreadSanitizer; the planner's shared-memory accounting and the listing
that the NVRTC test (tests/test_kernels_nvrtc.py) compiles.
"""

from __future__ import annotations

import numpy as np
import pytest
from support import (BFLOAT16, MUTANT_MARGIN, attention_error_ratio, check_attention, check_races,
                     needs_emulation, needs_gpu, problem_of)

import cuonline
from cuonline.engines.target import overrides
from cuonline.kernels import families, heuristics, source
from cuonline.kernels.launch import Launch
from cuonline.kernels.specs import AttentionMmaSpec, AttentionSimtSpec

SIMT, MMA = "attention_fwd_simt", "attention_fwd_mma"

# (backend, forced family, dtype). SIMT float32 at D = 32 plans 8-row query tiles (2 rows per
# warp) and 64-key tiles; the tensor-core float16 kernel 32-row tiles (2 warps) of 64 keys.
PLACES = [
    pytest.param(("emulate", SIMT, np.float32), id="emulate-simt", marks=needs_emulation),
    pytest.param(("emulate", MMA, np.float16), id="emulate-mma", marks=needs_emulation),
    pytest.param(("cupy", SIMT, np.float32), id="cupy-simt", marks=[pytest.mark.gpu, needs_gpu]),
    pytest.param(("cupy", MMA, np.float16), id="cupy-mma", marks=[pytest.mark.gpu, needs_gpu]),
]
EMULATED = [p for p in PLACES if p.id.startswith("emulate")]
ARRAYS = ("bias", "mask", "kv_lengths", "alibi_slopes", "rel_bias", "rel_q", "rel_k")

# 23 queries (3 SIMT tiles, a tail), 70 keys (2 key tiles, a tail of 6); the default diagonal
# (Lk - Lq = 47) crosses the key tile boundary at 64.
LQ, LK, D, DV, DR = 23, 70, 32, 24, 8


def run(place, q, k, v, dtype=None, **options):
    """``attention`` at ``place`` on NumPy inputs; ``(out, lse)`` as NumPy arrays."""
    backend, family, _ = place
    xp = np
    if backend == "cupy":
        import cupy as xp  # noqa: PLC0415
    options = {n: (xp.asarray(x) if n in ARRAYS and x is not None else x)
               for n, x in options.items()}
    with overrides(family=family):
        out, lse = cuonline.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v),
                                      backend=backend, return_lse=True, **options)
    if xp is not np:
        out, lse = out.get(), lse.get()
    return out, lse


def inputs(seed, dtype, *, batch=(2,), lq=LQ, lk=LK):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(batch + (n, e)).astype(dtype)
               for n, e in ((lq, D), (lk, D), (lk, DV)))
    return rng, q, k, v


def option_values(rng, names, lq=LQ, lk=LK, table_dtype=np.float32):
    """Options for ``names``; the relative tables are short enough that distances clamp on
    both sides, and broadcast differently (per batch element, or shared)."""
    opts = {}
    for name in names:
        if name == "bias_block":
            # (4, 5) blocks: the bias is (ceil(23 / 4), ceil(70 / 5)) = (6, 14), per batch
            opts["bias_block"] = (4, 5)
            opts["bias"] = rng.standard_normal((2, -(-lq // 4), -(-lk // 5))).astype(np.float32)
        elif name == "rel_bias":
            opts["rel_bias"] = rng.standard_normal((2, 31)).astype(table_dtype)    # +-15
        elif name == "rel_qk":
            opts["rel_q"] = rng.standard_normal((lq, DR)).astype(table_dtype) * 0.5
            opts["rel_k"] = rng.standard_normal((2, 41, DR)).astype(table_dtype)   # +-20
        elif name == "offsets":
            opts.update(q_offset=5, k_offset=-9)
        elif name == "causal":
            opts["causal"] = True
        elif name == "window":
            opts["window"] = (30, 9)
        elif name == "alibi":
            opts["alibi_slopes"] = rng.uniform(0.05, 0.2, size=(2,))
        elif name == "mask":
            m = rng.random((lq, lk)) < 0.8
            m[1] = False                                # a row that sees nothing
            opts["mask"] = m
        elif name == "kv_lengths":
            opts["kv_lengths"] = np.array([lk - 9, 0])
        elif name == "softcap":
            opts["softcap"] = 2.5
        elif name == "softcap_bias":
            opts.update(softcap=2.5, softcap_bias=True)
        else:
            raise ValueError(name)
    return opts


def check(place, q, k, v, options):
    out, lse = run(place, q, k, v, **options)
    check_attention(q, k, v, out, lse, options)


# --------------------------------------------------------------------------------------------
# each term alone and with the others


COMBOS = [
    ("bias_block",),
    ("rel_bias",),
    ("rel_qk",),
    ("bias_block", "causal", "mask", "kv_lengths"),
    ("rel_bias", "causal", "alibi", "offsets"),
    ("rel_qk", "window", "softcap"),                 # rel_q . rel_k inside the capped score
    ("rel_qk", "rel_bias", "softcap_bias", "offsets"),
    ("bias_block", "rel_bias", "rel_qk", "causal", "window", "alibi", "mask", "kv_lengths",
     "softcap", "offsets"),
    ("bias_block", "rel_bias", "rel_qk", "causal", "alibi", "mask", "softcap_bias"),
]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("names", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_terms_against_the_oracle(place, names):
    rng, q, k, v = inputs(len(names) * 17 + len(names[0]), place[2])
    check(place, q, k, v, option_values(rng, names))


@pytest.mark.parametrize("place", PLACES)
def test_block_shapes_of_one_variant(place):
    # one compiled variant, several blocks: square, a block taller than the queries (one
    # coarse row), one column per key (c = 1, the row run linear again), wider than a tile
    rng, q, k, v = inputs(3, place[2])
    for block in (3, (100, 1), (1, 70), (2, 33)):
        r, c = (block, block) if np.ndim(block) == 0 else block
        bias = rng.standard_normal((-(-LQ // r), -(-LK // c))).astype(np.float32)
        check(place, q, k, v, dict(bias=bias, bias_block=block, causal=True))


@pytest.mark.parametrize("place", PLACES)
def test_strided_and_reversed_relative_tables(place):
    # views the kernels read through the offset table's strides (rel_q, rel_k) or that the
    # argument builder copies to a unit column stride (rel_bias, reversed here)
    rng, q, k, v = inputs(4, place[2])
    rel_bias = rng.standard_normal((2, 61)).astype(np.float32)[:, ::-2]       # (2, 31)
    rel_q = np.asfortranarray(rng.standard_normal((2, LQ, DR)).astype(np.float32))
    rel_k = rng.standard_normal((41, 2 * DR)).astype(np.float32)[::-1, ::2]  # (41, DR)
    check(place, q, k, v, dict(rel_bias=rel_bias, rel_q=rel_q, rel_k=rel_k, causal=True))


def _dtype_params():
    params = [pytest.param((SIMT, np.float64), id="simt-f64"),
              pytest.param((MMA, np.float64), id="mma-f64")]
    if BFLOAT16 is not None:
        params.append(pytest.param((MMA, BFLOAT16), id="mma-bf16"))
    return params


@needs_emulation
@pytest.mark.parametrize("family_dtype", _dtype_params())
def test_every_term_in_the_other_dtypes(family_dtype):
    family, dtype = family_dtype
    place = ("emulate", family, dtype)
    rng, q, k, v = inputs(5, dtype)
    table = np.float64 if dtype == np.float64 else np.float32
    names = ("bias_block", "rel_bias", "rel_qk", "causal", "alibi", "mask", "softcap")
    check(place, q, k, v, option_values(rng, names, table_dtype=table))


@pytest.mark.parametrize("place", EMULATED)
def test_split_keys_with_the_relative_terms(place):
    # decoding-like: 3 queries, 300 keys in 2 splits, each staging its own rel_k bands
    rng, q, k, v = inputs(8, place[2], lq=3, lk=300)
    opts = dict(rel_bias=rng.standard_normal((2, 401)).astype(np.float32),
                rel_q=rng.standard_normal((3, DR)).astype(np.float32),
                rel_k=rng.standard_normal((2, 257, DR)).astype(np.float32), causal=True)
    with overrides(n_splits=2, num_sms=1):
        check(place, q, k, v, opts)
    assert "split" in _planned_key(place, q, k, v, opts, n_splits=2)


def _planned_key(place, q, k, v, opts, **plan):
    p = problem_of("emulate", q, k, v, **opts)
    return families.plan_attention(p, Launch(family=place[1], **plan)).spec.key


# --------------------------------------------------------------------------------------------
# chunks: each with its own offsets and its slice of rel_q, merged, give the unchunked call


def _cuts(rng, n, pieces, least=1):
    while True:
        inner = np.sort(rng.choice(np.arange(1, n), size=pieces - 1, replace=False))
        edges = [0, *map(int, inner), n]
        if min(b - a for a, b in zip(edges[:-1], edges[1:])) >= least:
            return list(zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("place", EMULATED)
def test_chunkings_with_both_relative_terms_merge_to_the_unchunked_call(place):
    lq, lk = 40, 53
    rng, q, k, v = inputs(11, place[2], lq=lq, lk=lk)
    opts = dict(causal=True, rel_bias=rng.standard_normal((2, 21)).astype(np.float32),
                rel_k=rng.standard_normal((2, 31, DR)).astype(np.float32))
    rel_q = rng.standard_normal((2, lq, DR)).astype(np.float32)
    whole_out, whole_lse = run(place, q, k, v, rel_q=rel_q, **opts)
    check_attention(q, k, v, whole_out, whole_lse, dict(rel_q=rel_q, **opts))
    outs, lses = [], []
    for i0, i1 in _cuts(rng, lq, 2, least=17):
        states = [run(place, q[:, i0:i1], k[:, j0:j1], v[:, j0:j1], rel_q=rel_q[:, i0:i1],
                      q_offset=lk - lq + i0, k_offset=j0, **opts)
                  for j0, j1 in _cuts(rng, lk, 2)]
        out, lse = cuonline.merge(*states)
        outs.append(out)
        lses.append(lse)
    # the merged chunks are as accurate as the whole call (same fully masked rows included)
    out, lse = np.concatenate(outs, axis=1), np.concatenate(lses, axis=1)
    check_attention(q, k, v, out, lse, dict(rel_q=rel_q, **opts))


# --------------------------------------------------------------------------------------------
# mutants of the new code: each must fail the oracle, so the cases above can see it

MUTANTS = {
    # the block bias along a tensor-core row run as if linear in the column (c = 1)
    "block_bias_linear_run": (MMA, "attention_score.cuh",
                              "kHasBiasBlock ? (long long)(int(j) / bias_cols_) : dj", "dj"),
    # the block bias read at (i, j / c): rows not coarsened
    "block_bias_fine_rows": (SIMT, "attention_score.cuh",
                             "offset(operand::kBias, int(i) / bias_rows_, int(j) / bias_cols_)",
                             "offset(operand::kBias, i, int(j) / bias_cols_)"),
    # delta from the other side: key - query turned around
    "relative_delta_reversed": (SIMT, "attention_score.cuh",
                                "return clamp_delta(j - i - diag_, radius) + radius;",
                                "return clamp_delta(i - j + diag_, radius) + radius;"),
    # the band staged one row short: the tile's first query and last key go unstaged
    "rel_k_band_short": (MMA, "attention_score.cuh",
                         "count = rel_row(i_first, j_first + n - 1, rk_) - lo + 1;",
                         "count = rel_row(i_first, j_first + n - 1, rk_) - lo;"),
    # rel_q . rel_k added after the content cap instead of inside it
    "rel_qk_after_the_cap": (SIMT, "attention_score.cuh",
                             "if constexpr (kHasRelQk) x += kCapScore ? rel * inv_cap_ : rel;\n"
                             "        if constexpr (kCapScore) x = cap_ * tanh_(x);",
                             "if constexpr (kCapScore) x = cap_ * tanh_(x);\n"
                             "        if constexpr (kHasRelQk) x += rel;"),
}
MUTANT_TERMS = {
    "block_bias_linear_run": ("bias_block",),
    "block_bias_fine_rows": ("bias_block",),
    "relative_delta_reversed": ("rel_bias",),
    "rel_k_band_short": ("rel_qk",),
    "rel_qk_after_the_cap": ("rel_qk", "softcap"),
}


@needs_emulation
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutants_of_the_terms_fail_the_oracle(name):
    family, file, find, replace = MUTANTS[name]
    text = source.read_kernel_file(file)
    assert text.count(find) == 1, f"mutant {name}: the edited text occurs {text.count(find)} times"
    place = ("emulate", family, np.float32 if family == SIMT else np.float16)
    rng, q, k, v = inputs(21, place[2])
    opts = option_values(rng, MUTANT_TERMS[name])
    with overrides(kernel_sources={file: text.replace(find, replace)}):
        out, _ = run(place, q, k, v, **opts)
    ratio = attention_error_ratio(q, k, v, out, None, opts)
    assert ratio > MUTANT_MARGIN, (name, ratio)                    # NaN counts as caught


# --------------------------------------------------------------------------------------------
# ThreadSanitizer: the staging of rel_q rows and rel_k bands races with nothing


@needs_emulation   # runs the emulated kernels under TSan: slow, not in the fast tier
def test_relative_terms_are_race_free_under_tsan():
    check_races("""
        import numpy as np
        import cuonline
        from cuonline.engines.target import overrides
        rng = np.random.default_rng(0)
        for family, dtype in (("attention_fwd_simt", np.float32),
                              ("attention_fwd_mma", np.float16)):
            q, k, v = (rng.standard_normal((1, n, 32)).astype(dtype) for n in (40, 150, 150))
            opts = dict(rel_q=rng.standard_normal((40, 8)).astype(np.float32),
                        rel_k=rng.standard_normal((61, 8)).astype(np.float32),
                        rel_bias=rng.standard_normal((9,)).astype(np.float32), causal=True,
                        bias=rng.standard_normal((10, 30)).astype(np.float32),
                        bias_block=(4, 5))
            with overrides(family=family, num_sms=1,
                           emulate_options=dict(mode="threads", tsan=True)):
                cuonline.attention(q, k, v, backend="emulate", **opts)
        print("DONE")
    """, expect_race=False)


# --------------------------------------------------------------------------------------------
# the variants: rows of the feature table, Dr in the key, shared memory in the planners


def test_the_new_terms_are_listed_for_both_families_on_every_arch():
    new = ("bias_block", "rel_bias", "rel_qk")
    for arch in ("sm_90", "sm_80", "sm_75", "sm_70"):
        specs = [s for s in families.listing_specs(arch)
                 if s.family in (SIMT, MMA)]
        for name in new:
            listed = {s.family for s in specs if s.has(name)}
            assert listed == ({SIMT, MMA} if heuristics.mma_supported(arch) else {SIMT}), (
                arch, name)
        for s in specs:
            assert (s.dr > 0) == s.has("rel_qk") and (f"_dr{s.dr}_" in s.key) == (s.dr > 0)
            if s.has("bias_block"):
                assert s.has("bias")


def test_dr_is_compiled_in_and_refused_without_rel_qk():
    spec = AttentionSimtSpec(dtype="float32", acc="float32", d=64, dv=64, warps=4,
                             rows_per_warp=2, keys_per_lane=1, features=("rel_qk",), dr=48)
    assert spec.defines()["CUONLINE_DR"] == 48 and spec.defines()["CUONLINE_HAS_REL_QK"] == 1
    assert "_dr48_" in spec.key
    for features, dr in ((("rel_qk",), 0), ((), 16)):
        with pytest.raises(ValueError, match="dr of attention_fwd_simt"):
            AttentionSimtSpec(dtype="float32", acc="float32", d=64, dv=64, warps=4,
                              rows_per_warp=2, keys_per_lane=1, features=features, dr=dr)


def test_shared_memory_of_the_relative_staging():
    # rel_q rows (block_m, dr + 1) and the rel_k band (block_m + block_n - 1, dr + 1), Acc
    plain = AttentionMmaSpec(dtype="float16", d=64, dv=64, warps=4, block_n=32, stages=2,
                             m_tiles=2)
    rel = AttentionMmaSpec(dtype="float16", d=64, dv=64, warps=4, block_n=32, stages=2,
                           m_tiles=2, features=("rel_qk",), dr=64)
    assert rel.shared_bytes - plain.shared_bytes == (128 + 128 + 31) * 65 * 4
    # the SIMT planner shrinks the tile to fit two blocks per SM where it can, else opts into
    # the arch's whole limit (float64 D = 256: one row per warp is 92 KiB), or says why not
    for arch, dr in (("sm_90", 16), ("sm_90", 64), ("sm_70", 64), ("sm_75", 8)):
        warps, rows, keys = heuristics.choose_tiles("float64", 128, 128, 4096, 32, arch=arch,
                                                    dr=dr)
        spec = AttentionSimtSpec(dtype="float64", acc="float64", d=128, dv=128, warps=warps,
                                 rows_per_warp=rows, keys_per_lane=keys,
                                 features=("rel_qk",), dr=dr)
        assert spec.shared_bytes <= heuristics.simt_smem_limit(arch), (arch, dr)
    warps, rows, keys = heuristics.choose_tiles("float64", 256, 256, 4096, 32, arch="sm_90",
                                                dr=64)
    spec = AttentionSimtSpec(dtype="float64", acc="float64", d=256, dv=256, warps=warps,
                             rows_per_warp=rows, keys_per_lane=keys, features=("rel_qk",),
                             dr=64)
    assert heuristics.simt_smem_limit("sm_90") < spec.shared_bytes
    assert spec.shared_bytes <= heuristics.simt_smem_opt_in_limit("sm_90")
    with pytest.raises(ValueError, match="Dr = 64 needs .* more than sm_75's 65536"):
        heuristics.choose_tiles("float64", 256, 256, 4096, 32, arch="sm_75", dr=64)
    # the tensor-core planner drops query rows when the staging outgrows the arch
    for arch in ("sm_80", "sm_86", "sm_90"):
        tiles = heuristics.choose_mma_tiles("float64", 64, 64, 4096, arch, dr=128)
        spec = AttentionMmaSpec(dtype="float64", d=64, dv=64, **tiles._asdict(),
                                features=("rel_qk",), dr=128)
        assert spec.shared_bytes <= heuristics.mma_smem_limit(arch), (arch, tiles)
        # 4 warps of 16 rows need 195 KiB at one stage: sm_90 keeps them (211 KiB at two)
        assert (tiles.warps == 4) == (arch == "sm_90"), (arch, tiles)
    with pytest.raises(ValueError, match="Dr = 256 needs .* more than sm_86's"):
        heuristics.choose_mma_tiles("float64", 64, 64, 4096, "sm_86", dr=256)


def test_a_call_plans_the_variant_of_its_terms():
    rng, q, k, v = inputs(1, np.float16)
    opts = option_values(rng, ("bias_block", "rel_bias", "rel_qk"))
    key = _planned_key(("emulate", MMA, np.float16), q, k, v, opts)
    assert key.startswith("attention_fwd_mma_f16_d32_dv24_dr8_")
    assert key.endswith("_bias_bias_block_rel_bias_rel_qk")
    # Dr = 0: the dot is exactly 0, no variant of its own
    opts.update(rel_q=np.zeros((LQ, 0), np.float32), rel_k=np.zeros((3, 0), np.float32))
    key = _planned_key(("emulate", SIMT, np.float16), q, k, v, opts)
    assert "rel_qk" not in key and "_dr" not in key
