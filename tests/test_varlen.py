"""Packed variable-length batches (``cu_seqlens_q``, ``cu_seqlens_k``) on the NumPy engine.

Forward and backward against the float64 oracle run one sequence at a time
(tests/oracle.py), with every per-sequence option; against per-sequence calls of attention
and attention_backward; empty sequences on either side; pack/unpack; and each bad
``cu_seqlens`` a clear error before any work.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import reference_varlen_attention, reference_varlen_attention_backward
from support import (boundaries, check_attention, check_gradients, packed_case,
                     packed_option_cases)

import cuonline

# query and key lengths per sequence: repeated shapes (one group of several sequences),
# Lq != Lk both ways, empty sequences on either side, lengths around the engine's tiles
LENGTHS_Q = [5, 0, 17, 5, 3, 64, 65, 1, 5]
LENGTHS_K = [5, 4, 17, 5, 0, 64, 30, 1, 5]


def case(seed, *, heads=2, d=6, dv=4, dtype=np.float64, lengths_q=LENGTHS_Q,
         lengths_k=LENGTHS_K):
    return packed_case(seed, dtype, lengths_q, lengths_k, heads=heads, d=d, dv=dv)


options_cases = packed_option_cases


@pytest.mark.parametrize("name", list(options_cases(np.random.default_rng(0), 1)))
def test_forward_and_backward_match_the_oracle(name):
    rng, q, k, v, cq, ck = case(1)
    options = options_cases(rng, q.shape[-2])[name]
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True,
                                  **options)
    ref_out, ref_lse = reference_varlen_attention(q, k, v, cq, ck, **options)
    assert out.shape == (2, cq[-1], v.shape[-1]) and lse.shape == (2, cq[-1])
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)
    assert np.isneginf(lse[:, cq[4]:cq[5]]).all()           # the sequence without keys
    dout = rng.standard_normal(out.shape)
    g = cuonline.attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                    **options)
    ref = reference_varlen_attention_backward(dout, q, k, v, cq, ck, **options)
    for field in ("dq", "dk", "dv", "drel_bias", "drel_q", "drel_k"):
        got = getattr(g, field)
        if ref.get(field) is None:
            assert got is None, field
            continue
        assert got.shape == ref[field].shape, field
        np.testing.assert_allclose(got, ref[field], rtol=1e-9, atol=1e-11, err_msg=field)
    # the keys of the sequence without queries receive nothing
    assert not g.dk[:, ck[1]:ck[2]].any() and not g.dv[:, ck[1]:ck[2]].any()


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (2, 3), "q_offset": 1}],
                         ids=["causal", "window-offset"])
def test_is_a_loop_of_per_sequence_calls(options):
    """Each sequence's rows are attention on that sequence alone, forward and backward, in
    float32 too (the same engine, so to rounding)."""
    rng, q, k, v, cq, ck = case(2, dtype=np.float32)
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True,
                                  **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    g = cuonline.attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                    **options)
    k_full, v_full = np.broadcast_to(k, (2,) + k.shape[1:]), np.broadcast_to(v, (2,) + v.shape[1:])
    dk = np.zeros(k_full.shape, np.float32)
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        o, s = cuonline.attention(q[:, sq], k[:, sk], v[:, sk], return_lse=True, **options)
        np.testing.assert_allclose(out[:, sq], o, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[:, sq], s, rtol=1e-5, atol=1e-6)
        gb = cuonline.attention_backward(dout[:, sq], q[:, sq], k_full[:, sk], v_full[:, sk],
                                         o, s, **options)
        np.testing.assert_allclose(g.dq[:, sq], gb.dq, rtol=1e-4, atol=1e-5)
        dk[:, sk] = gb.dk
    np.testing.assert_allclose(g.dk, dk.sum(axis=0, keepdims=True), rtol=1e-4, atol=1e-5)
    assert g.dq.dtype == np.float32 and lse.dtype == np.float32


def test_one_sequence_is_the_plain_call(rng):
    q, k, v = rng.standard_normal((3, 40, 8)), rng.standard_normal((3, 50, 8)), \
        rng.standard_normal((3, 50, 8))
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=[0, 40], cu_seqlens_k=[0, 50],
                                  causal=True, return_lse=True)
    ref, ref_lse = cuonline.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-14)


def test_no_queries_and_no_keys(rng):
    """Every sequence empty on one side: zeros and -inf, zero gradients, no work."""
    q, k, v = rng.standard_normal((0, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 4))
    out = cuonline.attention(q, k, v, cu_seqlens_q=[0, 0, 0], cu_seqlens_k=[0, 3, 7])
    assert out.shape == (0, 4)
    q = rng.standard_normal((6, 4))
    out, lse = cuonline.attention(q, k[:0], v[:0], cu_seqlens_q=[0, 6], cu_seqlens_k=[0, 0],
                                  return_lse=True)
    assert not out.any() and np.isneginf(lse).all()
    g = cuonline.attention_backward(np.ones_like(out), q, k[:0], v[:0], out, lse,
                                    cu_seqlens_q=[0, 6], cu_seqlens_k=[0, 0])
    assert not g.dq.any() and g.dk.shape == (0, 4)


@pytest.mark.parametrize("scale", [0.5, -0.5])
def test_an_lse_within_the_bound_of_its_products_is_accepted(scale):
    """The packed lse check's products' term R (each row's norm times its own sequence's
    largest key norm) takes the scale's magnitude: an lse off by more than the bound
    without R, less than the one with it, is accepted under either sign; past it, refused."""
    from cuonline import _lse_check

    _, q, k, v, cq, ck = case(9, d=64, dtype=np.float32)
    q, k = q * 10, k * 10
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, scale=scale,
                                  return_lse=True)
    n_keys = np.repeat(np.diff(ck), np.diff(cq))
    largest = [np.linalg.norm(k[:, a:z], axis=-1).max(axis=-1, initial=0.0)
               for a, z in zip(ck[:-1], ck[1:])]
    r = abs(scale) * np.linalg.norm(q, axis=-1) * np.repeat(np.stack(largest, -1), np.diff(cq),
                                                              axis=-1)
    seen = np.isfinite(lse)
    wide = np.where(seen, lse, 0).astype(np.float64)
    tol0 = _lse_check.row_sum_tolerance(np, np.float32, n_keys, wide, 64)
    tol = _lse_check.row_sum_tolerance(np, np.float32, n_keys, wide, 64, r)
    assert (tol[seen] > 1.5 * tol0[seen]).all()
    dout = np.ones_like(out)

    def backward(shift):
        return cuonline.attention_backward(
            dout, q, k, v, out, np.where(seen, wide + shift, -np.inf).astype(np.float32),
            cu_seqlens_q=cq, cu_seqlens_k=ck, scale=scale)

    backward((tol0 + tol) / 2)
    with pytest.raises(ValueError, match="`lse`"):
        backward(2 * tol)


def test_vjp_and_lists_of_boundaries(rng):
    """attention_vjp takes the keywords; boundaries as lists, int32 or uint16 arrays."""
    _, q, k, v, cq, ck = case(3)
    out, vjp = cuonline.attention_vjp(q, k, v, cu_seqlens_q=list(cq),
                                      cu_seqlens_k=ck.astype(np.uint16), causal=True)
    out2, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq.astype(np.int32), cu_seqlens_k=ck,
                                   causal=True, return_lse=True)
    np.testing.assert_array_equal(out, out2)
    dout = rng.standard_normal(out.shape)
    g = cuonline.attention_backward(dout, q, k, v, out2, lse, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                    causal=True)
    np.testing.assert_array_equal(vjp(dout).dq, g.dq)


def test_results_do_not_depend_on_workers(rng):
    _, q, k, v, cq, ck = case(6)
    runs = []
    for workers in (1, 2, None):
        out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True,
                                      return_lse=True, workers=workers)
        g = cuonline.attention_backward(np.ones_like(out), q, k, v, out, lse, cu_seqlens_q=cq,
                                        cu_seqlens_k=ck, causal=True, workers=workers)
        runs.append((out, g.dq, g.dk))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_a_batch_of_many_tasks():
    """Sequences long enough for several tasks of the one task list
    (``numpy_varlen.TASK_WORK``): the same bits for every ``workers``, the gradients of the
    tables that every sequence shares included, and each sequence accurate (the oracle and
    the accuracy rule, on that sequence alone)."""
    rng = np.random.default_rng(7)
    cq = boundaries([300, 1, 0, 257, 520, 64, 129])
    q, k, v, dout = (rng.standard_normal((2, cq[-1], 16)).astype(np.float32) for _ in range(4))
    tables = {"causal": True, "rel_bias": rng.standard_normal((2, 33)),
              "rel_q": rng.standard_normal((2, cq[-1], 4)),
              "rel_k": rng.standard_normal((1, 17, 4))}
    runs = []
    for workers in (1, 2, 3):
        out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=cq,
                                      return_lse=True, workers=workers, **tables)
        g = cuonline.attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=cq,
                                        cu_seqlens_k=cq, workers=workers, **tables)
        runs.append((out, lse, g.dq, g.dk, g.dv, g.drel_bias, g.drel_q, g.drel_k))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    options = {"causal": True, "softcap": 2.0, "alibi_slopes": np.array([0.1, 0.3])}
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=cq, return_lse=True,
                                  **options)
    g = cuonline.attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=cq, cu_seqlens_k=cq,
                                    **options)
    check_each_sequence(q, k, v, cq, out, lse, dout, g, options)


def check_each_sequence(q, k, v, cu, out, lse, dout, grads, options):
    """Each sequence's rows of a packed self-attention's results (``cu`` both boundaries)
    against the oracle, by the accuracy rule (tests/support.py)."""
    for b in range(len(cu) - 1):
        rows = slice(cu[b], cu[b + 1])
        if cu[b + 1] > cu[b]:
            parts = [x[:, rows] for x in (q, k, v)]
            check_attention(*parts, out[:, rows], lse[:, rows], options)
            check_gradients({"dq": grads.dq[:, rows], "dk": grads.dk[:, rows],
                             "dv": grads.dv[:, rows]}, dout[:, rows], *parts, options)


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (9, 4)}], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_short_sequences_run_their_heads_as_stacks(monkeypatch, options, dtype):
    """A sequence's heads run as stacks, one compiled call each: in the forward where every
    head is one tile (longer sequences keep a unit per head and block), in the backward every
    sequence (several tiles each included); the bits of one unit per head and block."""
    from cuonline.engines import numpy as numpy_engine
    from cuonline.engines import numpy_backward

    monkeypatch.setattr(numpy_engine, "BLOCK_Q", 64)       # a stack: up to 64 x 1024 scores
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 1024)
    monkeypatch.setattr(numpy_backward, "BLOCK_Q", 64)
    monkeypatch.setattr(numpy_backward, "BLOCK_K", 64)
    lengths = [40, 130, 64, 0, 7, 65, 33]
    rng, q, k, v, cq, ck = case(7, heads=5, d=16, dv=8, dtype=dtype, lengths_q=lengths,
                                lengths_k=lengths)
    keywords = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, **options)
    stacked = {"forward": [], "backward": []}
    for module, name, key in ((numpy_engine, "attend_stacked", "forward"),
                              (numpy_backward, "stacked_gradients", "backward")):
        def counted(p, elements, *args, original=getattr(module, name), key=key):
            stacked[key].append((getattr(p, "forward", p).lq, len(elements)))
            return original(p, elements, *args)
        monkeypatch.setattr(module, name, counted)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **keywords)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = cuonline.attention_backward(dout, q, k, v, out, lse, **keywords)
    # forward: the sequences of 40, 64, 7 and 33 rows, each its 5 heads in one stack
    assert sorted(stacked["forward"]) == [(7, 5), (33, 5), (40, 5), (64, 5)]
    assert sorted(stacked["backward"]) == [(7, 5), (33, 5), (40, 5), (64, 5), (65, 5),
                                           (130, 5)]
    with monkeypatch.context() as m:
        m.setattr(numpy_engine, "stack_limit", lambda p: None)
        m.setattr(numpy_backward, "stack_limit", lambda p: 0)
        want_out, want_lse = cuonline.attention(q, k, v, return_lse=True, **keywords)
        want = cuonline.attention_backward(dout, q, k, v, out, lse, **keywords)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    check_each_sequence(q, k, v, cq, out, lse, dout, got, options)


def test_a_wrong_lse_is_still_refused(rng):
    """The backward's check of lse runs on every group."""
    _, q, k, v, cq, ck = case(4)
    out, lse = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True)
    with pytest.raises(ValueError, match="lse"):
        cuonline.attention_backward(np.ones_like(out), q, k, v, out, lse + 3.0, cu_seqlens_q=cq,
                                    cu_seqlens_k=ck)


# --------------------------------------------------------------------------------------------
# pack and unpack


def test_pack_unpack_round_trip(rng):
    seqs = [rng.standard_normal((2, n, 3)) for n in (4, 0, 9)]
    packed, cu_seqlens = cuonline.pack(seqs)
    assert packed.shape == (2, 13, 3) and cu_seqlens.tolist() == [0, 4, 4, 13]
    for a, b in zip(cuonline.unpack(packed, cu_seqlens), seqs):
        np.testing.assert_array_equal(a, b)
    lse, cu_lse = cuonline.pack([s[..., 0] for s in seqs], axis=-1)
    np.testing.assert_array_equal(cu_lse, cu_seqlens)
    assert [x.shape for x in cuonline.unpack(lse, cu_lse, axis=-1)] == [(2, 4), (2, 0), (2, 9)]


def test_packed_attention_of_a_list_is_attention_of_each(rng):
    seqs = [rng.standard_normal((n, 8)) for n in (12, 30, 7)]
    x, cu_seqlens = cuonline.pack(seqs)
    out = cuonline.attention(x, x, x, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                             causal=True)
    for o, s in zip(cuonline.unpack(out, cu_seqlens), seqs):
        np.testing.assert_allclose(o, cuonline.attention(s, s, s, causal=True), rtol=1e-12)


@pytest.mark.parametrize("seqs, error, message", [
    ([], ValueError, "at least one"),
    (np.zeros((2, 3, 4)), TypeError, "list or tuple"),
    ([np.zeros((3, 4)), np.zeros((3, 5))], ValueError, r"seqs\[1\]. has shape \(3, 5\)"),
    ([np.zeros((3, 4)), np.zeros((3, 4), np.float32)], TypeError, "dtype float32"),
])
def test_pack_refuses(seqs, error, message):
    with pytest.raises(error, match=message):
        cuonline.pack(seqs)


def test_pack_and_unpack_refuse_bad_axes():
    with pytest.raises(ValueError, match="`axis` 2 is out of range for `seqs\\[0\\]` with 2"):
        cuonline.pack([np.zeros((3, 4))], axis=2)
    with pytest.raises(TypeError, match="`axis` must be an int, got float 1.0"):
        cuonline.unpack(np.zeros((3, 4)), [0, 3], axis=1.0)


# --------------------------------------------------------------------------------------------
# bad input: every rule names the argument, what it expected and what came


BAD = {
    "decreasing": ([0, 5, 3, 12], ValueError, r"cu_seqlens_q. must be non-decreasing.*"
                   r"cu_seqlens_q\[2\] = 3 < cu_seqlens_q\[1\] = 5"),
    "not from 0": ([2, 5, 12], ValueError, "must start at 0, got 2"),
    "last not the total": ([0, 5, 11], ValueError, r"must end at q.shape\[-2\] = 12.*got 11"),
    "past the total": ([0, 5, 13], ValueError, r"must end at q.shape\[-2\] = 12.*got 13"),
    "negative": ([0, -5, 12], ValueError, "non-decreasing"),
    "floats": (np.array([0.0, 5.0, 12.0]), TypeError, "integer array.*floating dtype float64"),
    "bools": (np.array([False, True, True]), TypeError, "integer array.*boolean dtype bool"),
    "2-D": (np.array([[0, 5, 12]]), ValueError, r"1-D .*got shape \(1, 3\)"),
    "empty": (np.zeros(0, np.int64), ValueError, r"got shape \(0,\)"),
    "huge": ([0, 2**70, 12], TypeError, "integer array.*object"),
    "uint64 beyond int64": (np.array([0, 2**63 + 5, 12], np.uint64), ValueError,
                            "must end at"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_boundaries_are_clear_errors(name):
    value, error, message = BAD[name]
    q = np.zeros((12, 4))
    k = np.zeros((16, 4))
    ck = [0, 7, 16] if np.ndim(value) != 1 or len(value) != 4 else [0, 7, 8, 16]
    with pytest.raises(error, match=message):
        cuonline.attention(q, k, k, cu_seqlens_q=value, cu_seqlens_k=ck)
    with pytest.raises(error, match=message.replace("q.shape", "packed.shape").replace(
            "cu_seqlens_q", "cu_seqlens")):
        cuonline.unpack(q, value)


def test_boundaries_of_different_counts_or_alone():
    q = np.zeros((12, 4))
    with pytest.raises(ValueError, match="same length B \\+ 1.*got 3 and 4"):
        cuonline.attention(q, q, q, cu_seqlens_q=[0, 5, 12], cu_seqlens_k=[0, 5, 6, 12])
    with pytest.raises(ValueError, match="`cu_seqlens_q` was given without `cu_seqlens_k`"):
        cuonline.attention(q, q, q, cu_seqlens_q=[0, 5, 12])
    with pytest.raises(ValueError, match="`cu_seqlens_k` was given without `cu_seqlens_q`"):
        cuonline.attention_backward(q, q, q, q, q, q[:, 0], cu_seqlens_k=[0, 12])


@pytest.mark.parametrize("option", [
    {"bias": np.zeros((12, 12))}, {"mask": np.ones((12, 12), bool)},
    {"kv_lengths": np.array(5)}, {"bias": np.zeros((3, 3)), "bias_block": 4}],
    ids=["bias", "mask", "kv_lengths", "bias_block"])
def test_options_without_meaning_across_sequences_are_refused(option):
    q = np.zeros((12, 4))
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"`{name}` cannot be combined with `cu_seqlens_q`"):
        cuonline.attention(q, q, q, cu_seqlens_q=[0, 5, 12], cu_seqlens_k=[0, 5, 12], **option)


def test_torch_inputs_and_boundaries_of_any_library():
    """cuonline.attention answers torch arrays in kind, boundaries of any library (the
    differentiable bindings' packed batches: tests/test_frameworks_varlen.py)."""
    torch = pytest.importorskip("torch")
    _, q, k, v, cq, ck = case(5)
    ref = cuonline.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    out = cuonline.attention(*(torch.from_numpy(x) for x in (q, k, v)),
                             cu_seqlens_q=torch.from_numpy(cq), cu_seqlens_k=ck, causal=True)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), ref)


@pytest.mark.slow
def test_benchmark_prints_the_three_layouts_agreeing():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_varlen.py"), "--quick"],
        capture_output=True, text=True, check=True, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)})
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1]
            for line in result.stdout.splitlines() if line.startswith("| ")}
    assert set(rows) == {"layout", "packed", "padded", "loop"}
    for name in ("packed", "padded", "loop"):
        cells = [float(c) for c in rows[name]]
        assert all(c > 0 for c in cells[:2])
        assert cells[-1] < 1e-5, name                # the same attention, however laid out


def test_cuda_statistics_refuse_packed_batches():
    """The CUDA statistics kernels take padded batches: a packed attention_stats on a CUDA
    backend is a ValueError naming the arguments, not a silent run on the NumPy engine."""
    q = np.zeros((12, 4), np.float32)
    with pytest.raises(ValueError, match="attention_stats of packed batches.*NumPy engine only"):
        cuonline.attention_stats(q, q, cu_seqlens_q=[0, 5, 12], cu_seqlens_k=[0, 5, 12],
                                 backend="emulate")
