"""Packed variable-length batches (``cu_seqlens_q``, ``cu_seqlens_k``) on the CUDA engine.

The forward and the backward of both families, emulated on the CPU (the same kernel text a GPU
runs): each sequence of the packed results against the float64 oracle on that sequence alone,
by the one accuracy rule (tests/support.py), with empty sequences on either side, one-token
sequences, lengths around the tile sizes and every per-sequence option; the block tables
(cuonline/kernels/varlen.py) and the plans without a GPU; mutants of the table lookup that the
comparison catches; ThreadSanitizer on packed launches. NumPy engine: tests/test_varlen.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from mutants import mutant_sources
from oracle import (naive_attention_backward, reference_varlen_attention,
                    reference_varlen_attention_backward)
from support import (assert_accurate, boundaries, check_attention, check_races, lse_rounding,
                     needs_emulation, packed_case, packed_option_cases, precision_of)

import cuonline
from cuonline._validate import validate_attention
from cuonline.engines.target import overrides
from cuonline.kernels import families, heuristics, varlen
from cuonline.kernels.launch import Launch

SIMT, MMA = "attention_fwd_simt", "attention_fwd_mma"
BWD_SIMT, BWD_MMA = "attention_bwd_simt", "attention_bwd_mma"

# per sequence: an empty query side and an empty key side, one-token sequences, Lq != Lk both
# ways, and lengths around the tiles the planner picks for these small shapes (SIMT: 8-32
# query rows, 32-64 keys; tensor cores: 16-64 rows, 16-64 keys)
LENGTHS_Q = [5, 0, 17, 1, 3, 33, 40, 1, 16]
LENGTHS_K = [5, 4, 17, 1, 0, 65, 31, 2, 16]


def case(seed, dtype, *, heads=2, d=16, dv=8, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    return packed_case(seed, dtype, lengths_q, lengths_k, heads=heads, d=d, dv=dv)


def option_cases(rng, total_q):
    return packed_option_cases(rng, total_q, dr=4)


def run(family, q, k, v, cq, ck, *, kernel_sources=None, **options):
    with overrides(family=family, kernel_sources=kernel_sources):
        return cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, backend="emulate",
                                  return_lse=True, **options)


def check_packed(q, k, v, cq, ck, out, lse, options, precision="highest"):
    """Each sequence of a packed result by the accuracy rule against the oracle on that
    sequence alone (rel_q cut to its rows); a sequence without keys is exactly 0 and -inf."""
    assert out.shape == q.shape[:-2] + (q.shape[-2], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1]
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if sq.start == sq.stop:
            continue
        if sk.start == sk.stop:
            assert (out[..., sq, :] == 0).all() and np.isneginf(lse[..., sq]).all(), b
            continue
        here = dict(options)
        if options.get("rel_q") is not None:
            here["rel_q"] = options["rel_q"][..., sq, :]
        check_attention(q[..., sq, :], k[..., sk, :], v[..., sk, :], out[..., sq, :],
                        lse[..., sq], here, precision)


# --------------------------------------------------------------------------------------------
# the table and the plan (pure, no kernel)


def test_the_table_has_every_query_tile_of_every_sequence_once_heaviest_first():
    cq, ck = boundaries(LENGTHS_Q), boundaries(LENGTHS_K)
    diagonals = [lk - lq for lq, lk in zip(LENGTHS_Q, LENGTHS_K)]
    for window in ((None, None), (None, 0), (3, 1)):
        table = varlen.tile_table(cq, ck, diagonals, window, 16)
        pairs = sorted(map(tuple, table.tiles.tolist()))
        assert pairs == [(s, t) for s, lq in enumerate(LENGTHS_Q) for t in range(-(-lq // 16))]
        assert table.tiles.dtype == np.int32 and table.seqs.dtype == np.int64
        np.testing.assert_array_equal(table.seqs[:, 0], cq[:-1])
        np.testing.assert_array_equal(table.seqs[:, 1:3], np.stack([LENGTHS_Q, LENGTHS_K], 1))
        np.testing.assert_array_equal(table.seqs[:, 3], diagonals)
        np.testing.assert_array_equal(table.seqs[:, 4], ck[:-1])
    # no window: the 33- and 40-query sequences (65 and 31 keys) first, their full tiles
    # before their tails; a one-token sequence last
    table = varlen.tile_table(cq, ck, diagonals, (None, None), 16)
    assert [tuple(t) for t in table.tiles[:3].tolist()] == [(5, 0), (5, 1), (6, 0)]
    assert tuple(table.tiles[-1].tolist()) == (3, 0)


def test_the_plan_launches_the_table_without_a_key_split():
    rng, q, k, v, cq, ck = case(0, np.float32, heads=3)
    p = validate_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True,
                           backend="emulate")
    for family in (SIMT, MMA):
        plan = families.plan_attention(p, Launch(family=family, n_splits=8))   # a split is refused
        assert plan.n_splits == 1 and not plan.spec.split
        assert plan.spec.features == ("window", "varlen")
        assert plan.spec.key.endswith("_window_varlen")
        assert plan.grid == (3 * len(plan.varlen), 1, 1)
        assert len(plan.varlen) == sum(-(-n // plan.spec.block_m) for n in LENGTHS_Q)
    with pytest.raises(ValueError, match="varlen.*never split"):
        type(plan.spec)(**{**plan.spec.as_dict(), "split": True})


def test_the_backward_plan_has_a_block_per_key_tile_and_per_query_tile_of_each_sequence():
    rng, q, k, v, cq, ck = case(0, np.float16, heads=3)
    p = validate_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, window=(3, 1),
                           backend="emulate")
    for plan in (heuristics.plan_bwd_simt(p, Launch()),
                 heuristics.plan_bwd_mma(p, Launch(arch="sm_90"))):
        table, key_tiles = plan.varlen
        r = plan.spec.block_r
        assert plan.spec.features == ("window", "varlen")
        assert plan.grid_dq == (3 * len(table), 1, 1)
        assert plan.grid_dkdv == (3 * key_tiles.shape[0], 1, 1)
        # every key tile of every sequence with keys (the one without queries too: its blocks
        # write its keys' zero gradients), once
        assert sorted(map(tuple, key_tiles.tolist())) == [
            (s, t) for s, lk in enumerate(LENGTHS_K) for t in range(-(-lk // r))]


def varlen_gradients(family, q, k, v, cq, ck, dout, *, kernel_sources=None, **options):
    """The forward on the NumPy engine, the backward on the emulated ``family``."""
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True,
                                  **options)
    with overrides(family=family, kernel_sources=kernel_sources):
        return cuonline.attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=cq,
                                           cu_seqlens_k=ck, backend="emulate", **options)


def check_packed_gradients(g, dout, q, k, v, cq, ck, options, precision="highest"):
    """The gradients of a packed batch by the accuracy rule: against the oracle run one
    sequence at a time, with the naive computation in q's precision likewise (each sequence's
    rows of dq, dk, dv and drel_q; the shared tables' gradients, rel_bias's and rel_k's, are
    sums over the sequences)."""
    rounding = precision_of(q.dtype, precision)
    exact = reference_varlen_attention_backward(dout, q, k, v, cq, ck, **options)
    naive = {name: np.zeros_like(x) for name, x in exact.items()}
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if sq.start == sq.stop:
            continue
        here = dict(options)
        if options.get("rel_q") is not None:
            here["rel_q"] = options["rel_q"][..., sq, :]
        n = naive_attention_backward(dout[..., sq, :], q[..., sq, :], k[..., sk, :],
                                     v[..., sk, :], rounding=rounding, **here)
        for name, rows in (("dq", sq), ("dk", sk), ("dv", sk), ("drel_q", sq)):
            if name in naive:
                naive[name][..., rows, :] = n[name]
        for name in ("drel_bias", "drel_k"):
            if name in naive:
                naive[name] += n[name]
    inherited = lse_rounding(reference_varlen_attention(q, k, v, cq, ck, **options)[1], q.dtype)
    for name, value in exact.items():
        got = getattr(g, name)
        assert got.shape == value.shape, (name, got.shape, value.shape)
        assert_accurate(name, got, value, naive[name], rounding, inherited)


# --------------------------------------------------------------------------------------------
# the emulated kernels against the oracle


@needs_emulation
@pytest.mark.parametrize("name", list(option_cases(np.random.default_rng(0), 1)))
def test_simt_forward_matches_the_oracle_per_sequence(name):
    rng, q, k, v, cq, ck = case(1, np.float64)
    options = option_cases(rng, q.shape[-2])[name]
    out, lse = run(SIMT, q, k, v, cq, ck, **options)
    check_packed(q, k, v, cq, ck, out, lse, options)


@needs_emulation
@pytest.mark.parametrize("name", ["causal", "softcap_bias", "rel_qk"])
def test_simt_forward_float32(name):
    rng, q, k, v, cq, ck = case(2, np.float32)
    options = option_cases(rng, q.shape[-2])[name]
    out, lse = run(SIMT, q, k, v, cq, ck, **options)
    check_packed(q, k, v, cq, ck, out, lse, options)


@needs_emulation
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("name", ["plain", "causal", "alibi", "rel_bias", "rel_qk", "k_offset"])
def test_tensor_core_forward_matches_the_oracle_per_sequence(name, dtype):
    rng, q, k, v, cq, ck = case(3, dtype)
    options = option_cases(rng, q.shape[-2])[name]
    out, lse = run(MMA, q, k, v, cq, ck, **options)
    check_packed(q, k, v, cq, ck, out, lse, options)


@needs_emulation
def test_several_tiles_per_sequence_and_non_finite_values_outside_a_sequence():
    # sequences of several query and key tiles on both families; the keys of the sequence
    # without queries hold NaN and inf (no block of another sequence reads them)
    lengths_q, lengths_k = [70, 0, 45], [50, 9, 100]
    rng, q, k, v, cq, ck = case(4, np.float32, heads=1, lengths_q=lengths_q,
                                lengths_k=lengths_k)
    k[..., ck[1]:ck[2], :] = np.nan
    v[..., ck[1]:ck[2], :] = np.inf
    for family, dtype in ((SIMT, np.float32), (MMA, np.float16)):
        x = [a.astype(dtype) for a in (q, k, v)]
        out, lse = run(family, *x, cq, ck, causal=True)
        check_packed(*x, cq, ck, out, lse, {"causal": True})


@needs_emulation
def test_the_packed_result_is_the_numpy_engines():
    rng, q, k, v, cq, ck = case(5, np.float64)
    options = option_cases(rng, q.shape[-2])["alibi"]
    out, lse = run(SIMT, q, k, v, cq, ck, **options)
    ref_out, ref_lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                          return_lse=True, **options)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-13)
    oracle_out, _ = reference_varlen_attention(q, k, v, cq, ck, **options)
    np.testing.assert_allclose(out, oracle_out, rtol=1e-12, atol=1e-13)


@needs_emulation
@pytest.mark.parametrize("name", list(option_cases(np.random.default_rng(0), 1)))
def test_simt_backward_matches_the_oracle(name):
    rng, q, k, v, cq, ck = case(7, np.float64)
    options = option_cases(rng, q.shape[-2])[name]
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    g = varlen_gradients(BWD_SIMT, q, k, v, cq, ck, dout, **options)
    check_packed_gradients(g, dout, q, k, v, cq, ck, options)


@needs_emulation
@pytest.mark.parametrize("name", ["causal", "softcap_bias", "rel_qk"])
def test_simt_backward_float32(name):
    rng, q, k, v, cq, ck = case(8, np.float32)
    options = option_cases(rng, q.shape[-2])[name]
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(np.float32)
    g = varlen_gradients(BWD_SIMT, q, k, v, cq, ck, dout, **options)
    check_packed_gradients(g, dout, q, k, v, cq, ck, options)


@needs_emulation
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("name", ["plain", "causal", "alibi", "rel_bias", "rel_qk", "k_offset"])
def test_tensor_core_backward_matches_the_oracle(name, dtype):
    rng, q, k, v, cq, ck = case(9, dtype)
    options = option_cases(rng, q.shape[-2])[name]
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(dtype)
    p = validate_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, backend="emulate",
                           **options)
    assert "bwd_mma" in heuristics.plan_bwd_mma(p, Launch()).spec.key   # the family runs it
    g = varlen_gradients(BWD_MMA, q, k, v, cq, ck, dout, **options)
    check_packed_gradients(g, dout, q, k, v, cq, ck, options)


@needs_emulation
def test_backward_with_several_tiles_per_sequence():
    lengths_q, lengths_k = [70, 0, 45], [50, 9, 100]
    rng, q, k, v, cq, ck = case(10, np.float32, heads=1, lengths_q=lengths_q,
                                lengths_k=lengths_k)
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(np.float32)
    for family, dtype in ((BWD_SIMT, np.float32), (BWD_MMA, np.float16)):
        x = [a.astype(dtype) for a in (q, k, v, dout)]
        g = varlen_gradients(family, *x[:3], cq, ck, x[3], window=(20, 0))
        check_packed_gradients(g, x[3], *x[:3], cq, ck, {"window": (20, 0)})


# --------------------------------------------------------------------------------------------
# mutants and ThreadSanitizer


@needs_emulation
@pytest.mark.parametrize("family", [SIMT, MMA])
@pytest.mark.parametrize("name", ["varlen_last_key_dropped", "varlen_table_off_by_one"])
def test_mutants_of_the_table_lookup_fail_the_oracle(name, family):
    rng, q, k, v, cq, ck = case(6, np.float64, heads=1)
    out, lse = run(family, q, k, v, cq, ck, kernel_sources=mutant_sources(name))
    with pytest.raises(AssertionError):
        check_packed(q, k, v, cq, ck, out, lse, {})


@needs_emulation
@pytest.mark.parametrize("family", [BWD_SIMT, BWD_MMA])
def test_a_mutant_of_the_key_table_fails_the_oracle(family):
    rng, q, k, v, cq, ck = case(11, np.float64, heads=1)
    dout = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    g = varlen_gradients(family, q, k, v, cq, ck, dout,
                         kernel_sources=mutant_sources("varlen_bwd_key_rows"))
    with pytest.raises(AssertionError):
        check_packed_gradients(g, dout, q, k, v, cq, ck, {})


_TSAN_SCRIPT = """
import numpy as np, cuonline
from cuonline.engines.target import overrides
lengths_q, lengths_k = [3, 0, 20, 1], [5, 2, 40, 0]
cq = np.concatenate(([0], np.cumsum(lengths_q)))
ck = np.concatenate(([0], np.cumsum(lengths_k)))
rng = np.random.default_rng(0)
q = rng.standard_normal((cq[-1], 16)).astype(np.float32)
k, v = (rng.standard_normal((ck[-1], 16)).astype(np.float32) for _ in range(2))
with overrides(family={family!r}, emulate_options=dict(tsan=True)):
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True,
                                  backend="emulate", return_lse=True)
with overrides(family={bwd_family!r}, emulate_options=dict(tsan=True)):
    g = cuonline.attention_backward(np.ones_like(out), q, k, v, out, lse, cu_seqlens_q=cq,
                                    cu_seqlens_k=ck, causal=True, backend="emulate")
print("DONE", out.shape, g.dk.shape)
"""


@needs_emulation
def test_thread_sanitizer_on_packed_launches():
    # the SIMT forward, then the SIMT backward's two kernels
    check_races(_TSAN_SCRIPT.format(family=SIMT, bwd_family=BWD_SIMT), expect_race=False)



@needs_emulation
def test_the_gpu_check_script_runs_its_checks_emulated(tmp_path):
    # benchmarks/gpu_varlen.py (gpu_check.sh's packed-batch rows) with its checks on the CPU
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_varlen.py"),
                           "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (tmp_path / "gpu_varlen.md").read_text()
    assert report.count("ok  ") == 4 and "FAIL" not in report
