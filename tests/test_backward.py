"""attention_backward / attention_vjp on the NumPy engine (issue 13).

The engine's gradients are held to float64 central finite differences of the forward and to a
dense float64 reference written from the softmax Jacobian (``oracle.reference_attention_backward``,
itself checked against finite differences here); tiles are shrunk so that small shapes cross
several tiles and ragged edges. Then broadcast shapes, dtypes, determinism, rows without keys,
NaN and bad inputs.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import pytest
from oracle import reference_attention, reference_attention_backward
from support import BFLOAT16, check_gradients

import cuonline
import cuonline._validate
from cuonline._gradients import sum_to_shape
from cuonline.engines import numpy_backward

GRAD_NAMES = ("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k")
#: input of each gradient
INPUT_OF = dict(dq="q", dk="k", dv="v", dbias="bias", drel_bias="rel_bias", drel_q="rel_q",
                drel_k="rel_k")


@pytest.fixture
def small_tiles(monkeypatch):
    """8 x 16 tiles: a 17 x 33 problem crosses 3 query tiles and 3 key blocks, ragged both."""
    monkeypatch.setattr(numpy_backward, "BLOCK_Q", 8)
    monkeypatch.setattr(numpy_backward, "BLOCK_K", 16)


def make(seed, options, *, batch=(2, 3), kv_batch=None, lq=17, lk=33, d=8, dv=6,
         dtype=np.float64):
    """``(q, k, v, dout, options)`` with every named option set (float64 terms)."""
    rng = np.random.default_rng(seed)
    kv_batch = batch if kv_batch is None else kv_batch
    full = np.broadcast_shapes(batch, kv_batch)
    q = rng.standard_normal(batch + (lq, d))
    k = rng.standard_normal(kv_batch + (lk, d))
    v = rng.standard_normal(kv_batch + (lk, dv))
    heads = full[-1]
    o = {}
    for name in options:
        if name == "causal":
            o["causal"] = True
        elif name == "window":
            o["window"] = (9, 4)
        elif name == "scale":
            o["scale"] = 0.7
        elif name == "bias":                         # shared by the batch: summed over it
            o["bias"] = rng.standard_normal((heads, lq, lk))
        elif name == "key_bias":                     # (B, 1, 1, Lk): summed over heads, rows
            o["bias"] = rng.standard_normal(full[:-1] + (1, 1, lk))
        elif name == "block_bias":
            o["bias_block"] = (5, 6)
            o["bias"] = rng.standard_normal((heads, -(-lq // 5), -(-lk // 6)))
        elif name == "rel_bias":
            o["rel_bias"] = rng.standard_normal((heads, 9))
        elif name == "rel_qk":
            o["rel_q"] = rng.standard_normal(full + (lq, 4)) * 0.5
            o["rel_k"] = rng.standard_normal((11, 4)) * 0.5
        elif name == "mask":
            m = rng.random((lq, lk)) < 0.7
            m[3] = False                             # a row that sees no key
            o["mask"] = m
        elif name == "kv_lengths":
            lengths = rng.integers(1, lk + 1, size=full)
            lengths.flat[0] = 0                      # a batch element that sees no key
            o["kv_lengths"] = lengths
        elif name == "alibi":
            o["alibi_slopes"] = rng.uniform(0.05, 0.5, size=(heads,))
        elif name == "softcap":
            o["softcap"] = 1.5
        elif name == "softcap_bias":
            o["softcap"], o["softcap_bias"] = 1.5, True
        elif name == "offsets":
            o["q_offset"], o["k_offset"] = 7, -4
        else:
            raise ValueError(name)
    dout = rng.standard_normal(full + (lq, dv))
    return q, k, v, dout, o


def backward(q, k, v, dout, options, **extra):
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options, **extra)
    return cuonline.attention_backward(dout, q, k, v, out, lse, **options, **extra)


OPTION_SETS = [
    (), ("causal",), ("window",), ("scale",), ("bias",), ("key_bias",), ("block_bias",),
    ("rel_bias",), ("rel_qk",), ("mask",), ("kv_lengths",), ("alibi",), ("softcap",),
    ("softcap", "bias"), ("softcap_bias", "bias"), ("offsets", "causal"),
    ("causal", "bias", "softcap", "alibi", "mask"),
    ("softcap_bias", "window", "kv_lengths", "alibi", "rel_bias"),
    ("softcap", "rel_qk", "rel_bias", "block_bias", "offsets", "window"),
    ("softcap_bias", "rel_qk", "key_bias", "causal", "kv_lengths"),
]


def _ids(options):
    return "-".join(options) or "plain"


@pytest.mark.parametrize("options", OPTION_SETS, ids=_ids)
def test_matches_dense_reference(small_tiles, options):
    q, k, v, dout, o = make(1, options)
    g = backward(q, k, v, dout, o)
    ref = reference_attention_backward(dout, q, k, v, **o)
    for name in GRAD_NAMES:
        got = getattr(g, name)
        if ref[name] is None:
            assert got is None, name
            continue
        assert got.shape == ref[name].shape and got.dtype == np.float64, name
        scale = max(1.0, float(np.max(np.abs(ref[name]))))
        np.testing.assert_allclose(got, ref[name], rtol=0, atol=1e-12 * scale, err_msg=name)


def _loss(q, k, v, dout, o):
    return float(np.sum(dout * cuonline.attention(q, k, v, **o)))


def _finite_differences(q, k, v, dout, o, name, entries, h=1e-5):
    """Central differences of ``sum(dout * out)`` at ``entries`` of input ``name``."""
    inputs = dict(q=q, k=k, v=v, **o)
    x = inputs[name]
    out = []
    for index in entries:
        values = []
        for step in (h, -h):
            moved = x.copy()
            moved[index] += step
            args = dict(inputs, **{name: moved})
            values.append(_loss(args.pop("q"), args.pop("k"), args.pop("v"), dout, args))
        out.append((values[0] - values[1]) / (2 * h))
    return np.array(out)


@pytest.mark.parametrize("options", OPTION_SETS, ids=_ids)
def test_finite_differences(small_tiles, options):
    """The engine against float64 central differences of the forward, at a few random entries
    of every differentiable input (kinks of the masks are avoided by the random data)."""
    q, k, v, dout, o = make(2, options)
    g = backward(q, k, v, dout, o)
    rng = np.random.default_rng(3)
    for grad_name in GRAD_NAMES:
        got = getattr(g, grad_name)
        if got is None:
            continue
        shape = got.shape
        entries = [tuple(int(rng.integers(0, n)) for n in shape) for _ in range(4)]
        fd = _finite_differences(q, k, v, dout, o, INPUT_OF[grad_name], entries)
        np.testing.assert_allclose(np.array([got[e] for e in entries]), fd, rtol=1e-6,
                                   atol=1e-7, err_msg=grad_name)


def test_reference_itself_matches_finite_differences():
    """The oracle's gradients against central differences of the forward oracle, every term."""
    q, k, v, dout, o = make(4, ("softcap", "rel_qk", "rel_bias", "block_bias", "alibi",
                                "window"), batch=(2,), lq=7, lk=9)
    ref = reference_attention_backward(dout, q, k, v, **o)
    inputs = dict(q=q, k=k, v=v, **o)
    h = 1e-5
    for grad_name in ("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k"):
        name = INPUT_OF[grad_name]
        x = inputs[name]
        for index in [(0,) * x.ndim, tuple(n - 1 for n in x.shape)]:
            values = []
            for step in (h, -h):
                moved = x.copy()
                moved[index] += step
                args = dict(inputs, **{name: moved})
                out, _ = reference_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
                values.append(float(np.sum(dout * out)))
            fd = (values[0] - values[1]) / (2 * h)
            assert abs(ref[grad_name][index] - fd) < 1e-7 * max(1, abs(fd)), (grad_name, index)


@pytest.mark.parametrize("lq, lk", [(1, 17), (17, 1), (33, 17), (17, 65), (65, 33), (16, 32)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lengths_both_ways(small_tiles, lq, lk, causal):
    o = {"causal": True} if causal else {}
    q, k, v, dout, _ = make(5, (), batch=(2,), lq=lq, lk=lk)
    g = backward(q, k, v, dout, o)
    ref = reference_attention_backward(dout, q, k, v, **o)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(g, name), ref[name], rtol=0, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("bias_shape", [(33,), (17, 1), (3, 1, 33), (2, 1, 17, 33), (1, 1)])
def test_broadcast_bias_and_grouped_keys(small_tiles, bias_shape):
    """k and v shared by the 3 query heads, a bias broadcast in other ways: each gradient has its
    input's shape and is the sum over what the input was broadcast to."""
    q, k, v, dout, _ = make(6, (), batch=(2, 3), kv_batch=(2, 1))
    bias = np.random.default_rng(7).standard_normal(bias_shape)
    g = backward(q, k, v, dout, {"bias": bias, "causal": True})
    ref = reference_attention_backward(dout, q, k, v, bias=bias, causal=True)
    assert g.dk.shape == k.shape and g.dv.shape == v.shape and g.dbias.shape == bias_shape
    for name in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_allclose(getattr(g, name), ref[name], rtol=0, atol=1e-12,
                                   err_msg=name)


def test_queries_shared_by_key_heads(small_tiles):
    """q broadcast over the batch (one query set against 4 key sets): dq sums over them."""
    q, k, v, dout, _ = make(8, (), batch=(1,), kv_batch=(4,))
    g = backward(q, k, v, dout, {})
    ref = reference_attention_backward(dout, q, k, v)
    assert g.dq.shape == q.shape
    np.testing.assert_allclose(g.dq, ref["dq"], rtol=0, atol=1e-12)


DTYPES = [np.float32, np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_low_precision_dtypes(small_tiles, dtype):
    """16-bit and float32 inputs compute in float32; dq/dk/dv come back in the dtype of q and
    dbias in the dtype of the bias as passed (float32 here); each by the accuracy rule."""
    q, k, v, dout, o = make(9, ("causal", "bias", "softcap"), batch=(2,))
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    o["bias"] = o["bias"][0].astype(np.float32)
    g = backward(q, k, v, dout, o)
    assert g.dq.dtype == g.dk.dtype == g.dv.dtype == np.dtype(dtype)
    assert g.dbias.dtype == np.float32
    check_gradients(g, dout, q, k, v, o)


@pytest.mark.parametrize("options", [("bias", "causal", "rel_qk", "rel_bias"),
                                     ("key_bias", "softcap", "kv_lengths")], ids=_ids)
def test_bitwise_deterministic(options):
    """Two runs, and workers=1 against workers=2, give the same bits; with default tiles, a
    problem of several groups (k/v shared by 2 query heads) and a broadcast bias summed over
    them."""
    q, k, v, dout, o = make(10, options, batch=(2, 4), kv_batch=(2, 1), lq=300, lk=530, d=16,
                            dtype=np.float32)
    q, k, v, dout = (x.astype(np.float32) for x in (q, k, v, dout))
    runs = [backward(q, k, v, dout, o, workers=w) for w in (1, 2, 2)]
    for other in runs[1:]:
        for name in GRAD_NAMES:
            a, b = getattr(runs[0], name), getattr(other, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert np.array_equal(a, b, equal_nan=True), name
                assert a.tobytes() == b.tobytes(), name


@pytest.mark.parametrize("options", [(), ("bias", "causal"), ("key_bias", "window"),
                                     ("rel_qk", "rel_bias", "block_bias")], ids=_ids)
def test_every_plan_gives_the_same_bits(small_tiles, monkeypatch, options):
    """One task per group (as many groups as cores) and the split into key-block and
    query-block tasks (fewer groups than cores) compute each tile alike and in the same order:
    identical bits."""
    q, k, v, dout, o = make(17, options, batch=(1, 2), kv_batch=(1, 1))
    results = {}
    for cores in (1, 64):
        monkeypatch.setattr(numpy_backward, "workers", lambda cores=cores: cores)
        p = cuonline._validate.validate_attention(q, k, v, **o)
        parts = {task[1] for task in numpy_backward._plan(p, _targets(dout, q, k, v, o))}
        # one core: a task per group, or (the plain score) stacks of them
        assert parts in (({"all"}, {"stack"}) if cores == 1 else ({"kv", "q"},))
        results[cores] = backward(q, k, v, dout, o, workers=2)
    for name in GRAD_NAMES:
        a, b = getattr(results[1], name), getattr(results[64], name)
        assert (a is None and b is None) or a.tobytes() == b.tobytes(), name


def _targets(dout, q, k, v, o):
    out, lse = cuonline.attention(q, k, v, return_lse=True, **o)
    return cuonline._validate.validate_attention_backward(dout, q, k, v, out, lse, **o).targets


def test_groups_share_no_gradient_slot():
    """The plan: a bias shared by the heads joins them into one group per batch element; k/v
    of shape (2, 1) join the heads too; without sharing each element is its own group."""
    from cuonline._gradients import Target
    plain = {n: Target((2, 3, 5, 4), np.float64, 2) for n in ("q", "k", "v")}
    assert len(numpy_backward._groups((2, 3), plain)) == 6
    shared = dict(plain, bias=Target((2, 1, 5, 4), np.float64, 2))
    assert numpy_backward._groups((2, 3), shared) == [[(0, 0), (0, 1), (0, 2)],
                                                      [(1, 0), (1, 1), (1, 2)]]
    everyone = dict(plain, bias=Target((5, 4), np.float64, 2))
    assert len(numpy_backward._groups((2, 3), everyone)) == 1


def test_rows_without_keys_get_zero_gradients(small_tiles):
    q, k, v, dout, o = make(11, ("mask", "kv_lengths"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = backward(q, k, v, dout, o)
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(getattr(g, name)).all(), name
    assert not g.dq[..., 3, :].any()                 # the masked row
    first = np.unravel_index(0, o["kv_lengths"].shape)
    assert not g.dq[first].any() and not g.dk[first].any() and not g.dv[first].any()


def test_keys_past_kv_lengths_are_never_read(small_tiles):
    """Keys and values past kv_lengths hold NaN: no NaN anywhere, zero gradient for them."""
    q, k, v, dout, _ = make(12, (), batch=(3,))
    lengths = np.array([0, 10, 33])
    k[0, :], v[0, :] = np.nan, np.nan
    k[1, 10:], v[1, 10:] = np.nan, np.inf
    g = backward(q, k, v, dout, {"kv_lengths": lengths})
    for name in ("dq", "dk", "dv"):
        assert np.isfinite(getattr(g, name)).all(), name
    assert not g.dk[1, 10:].any() and not g.dv[1, 10:].any() and not g.dk[0].any()
    ref = reference_attention_backward(dout, q, k, v, kv_lengths=lengths)
    np.testing.assert_allclose(g.dq, ref["dq"], rtol=0, atol=1e-12)


def test_nan_stays_in_its_rows(small_tiles):
    """A NaN query row makes its own dq row and the dk of the keys it sees NaN, nothing else;
    a NaN value makes the rows that see it NaN, and the keys they see, nothing else."""
    q, k, v, dout, _ = make(13, (), batch=(1,), lq=33, lk=33)
    q[0, 5, 2] = np.nan
    g = backward(q, k, v, dout, {"causal": True})
    nan_rows = np.isnan(g.dq[0]).any(axis=1)
    assert nan_rows.tolist() == [i == 5 for i in range(33)]
    assert np.isnan(g.dk[0]).any(axis=1).tolist() == [j <= 5 for j in range(33)]
    assert np.isnan(g.dv[0]).any(axis=1).tolist() == [j <= 5 for j in range(33)]   # P's row
    q, k, v, dout, _ = make(13, (), batch=(1,), lq=33, lk=33)
    v[0, 20, 1] = np.nan                             # seen by causal rows 20..32
    g = backward(q, k, v, dout, {"causal": True})
    assert np.isnan(g.dq[0]).any(axis=1).tolist() == [i >= 20 for i in range(33)]
    assert np.isfinite(g.dv[0, :20]).all() and np.isfinite(g.dv[0, 21:]).all()


def test_vjp_matches_forward_and_backward(small_tiles):
    q, k, v, dout, o = make(14, ("bias", "causal"))
    out, vjp = cuonline.attention_vjp(q, k, v, **o)
    assert np.array_equal(out, cuonline.attention(q, k, v, **o))
    g = vjp(dout)
    direct = backward(q, k, v, dout, o)
    for name in GRAD_NAMES:
        a, b = getattr(g, name), getattr(direct, name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    assert isinstance(g, cuonline.Gradients)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.dq = None


def test_broadcast_output_gradient(small_tiles):
    """dout may broadcast (the gradient of sum(out) is ones): read as a view."""
    q, k, v, _, _ = make(15, (), batch=(2,))
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    g = cuonline.attention_backward(np.ones(()), q, k, v, out, lse)
    ref = reference_attention_backward(np.ones(out.shape), q, k, v)
    np.testing.assert_allclose(g.dq, ref["dq"], rtol=0, atol=1e-12)


def test_sum_to_shape_fixed_order():
    g = np.arange(24.0).reshape(2, 3, 4)
    assert np.array_equal(sum_to_shape(np, g, (3, 1), tail=1), g.sum(axis=(0, 2))[:, None])
    assert np.array_equal(sum_to_shape(np, g, (4,)), g.sum(axis=(0, 1)))
    assert np.array_equal(sum_to_shape(np, g, (2, 3, 4)), g)
    # batch dimensions are added index by index, in C order
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, 7, 3)).astype(np.float32)
    expect = h[0, 0].copy()
    for i, j in list(np.ndindex(5, 7))[1:]:
        expect += h[i, j]
    assert sum_to_shape(np, h, (3,), tail=1).tobytes() == expect.tobytes()
    with pytest.raises(ValueError, match="cannot be summed"):
        sum_to_shape(np, g, (5,))


def test_backward_problem_reduces_full_gradients(small_tiles):
    """BackwardProblem.reduce (the CUDA engine's seam): a per-batch-element gradient summed to
    the input's shape and dtype, equal to the NumPy engine's sums."""
    q, k, v, dout, o = make(18, ("key_bias",), batch=(2, 3), kv_batch=(2, 1))
    o["bias"] = o["bias"].astype(np.float32)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **o)
    bp = cuonline._validate.validate_attention_backward(dout, q, k, v, out, lse, **o)
    full_dk = np.broadcast_to(k, (2, 3) + k.shape[-2:]) * 1.0
    reduced = bp.reduce("k", full_dk)
    assert reduced.shape == k.shape and reduced.dtype == np.float64
    np.testing.assert_allclose(reduced, 3 * k, rtol=1e-15)
    dbias = bp.reduce("bias", np.ones((2, 3, 17, 33)))
    assert dbias.shape == (2, 1, 1, 33) and dbias.dtype == np.float32
    assert np.all(dbias == 3 * 17)


def _bad_cases():
    q, k, v, dout, _ = make(16, (), batch=(2,), dtype=np.float64)
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    f32 = [x.astype(np.float32) for x in (q, k, v, dout)]
    out32, lse32 = cuonline.attention(*f32[:3], return_lse=True)
    return [
        ("dout shape", (dout[:, :5], q, k, v, out, lse), {}, ValueError, "`dout` of shape"),
        ("out shape", (dout, q, k, v, out[:, :5], lse), {}, ValueError,
         "`out` must have the shape"),
        ("lse shape", (dout, q, k, v, out, lse[:, :5]), {}, ValueError,
         "`lse` must have the shape"),
        ("lse dtype", (dout, q, k, v, out, lse.astype(np.float32)), {}, TypeError,
         "`lse` must have the dtype attention returns for float64 inputs, float64"),
        ("lse f32 inputs", (f32[3], *f32[:3], out32, lse32.astype(np.float64)), {}, TypeError,
         "float32, got float64"),
        ("dout dtype", (dout.astype(np.float32), q, k, v, out, lse), {}, TypeError,
         "`dout` must have the dtype of `q` (float64), got float32"),
        ("out dtype", (dout, q, k, v, out.astype(np.float32), lse), {}, TypeError,
         "`out` must have the dtype of `q`"),
        ("int dout", (dout.astype(int), q, k, v, out, lse), {}, TypeError,
         "`dout` must have a real"),
        ("return_lse", (dout, q, k, v, out, lse), {"return_lse": True}, TypeError, "return_lse"),
        ("forward rule", (dout, q, k, v, out, lse), {"softcap": -1.0}, ValueError, "`softcap`"),
        ("lse as a list", (dout, q, k, v, out, [1.0]), {}, ValueError, "`lse` must have the shape"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
    _, args, kwargs, error, message = case
    with pytest.raises(error, match=re.escape(message)):
        cuonline.attention_backward(*args, **kwargs)


@pytest.mark.parametrize("q_shape, k_shape", [((2, 0, 4), (2, 5, 4)), ((2, 3, 4), (2, 0, 4)),
                                              ((0, 3, 4), (0, 5, 4))])
def test_empty_shapes(q_shape, k_shape):
    q, k = np.ones(q_shape), np.ones(k_shape)
    g = backward(q, k, k, np.ones(q_shape), {})
    assert g.dq.shape == q_shape and g.dk.shape == g.dv.shape == k_shape
    assert not g.dq.any() and not g.dk.any() and not g.dv.any()


def test_nan_at_unseen_relative_table_places_reaches_no_gradient(small_tiles):
    """Issue 22, item 2: ``rel_k`` rows that no query sees (distances > 0 under causal) and a
    ``rel_q`` row of a query that sees no key contribute exactly zero: the gradients equal those
    of the same call with zeros there, where the dense products ``g @ band`` and ``g.T @ rel_q``
    would have carried 0 * NaN into every entry."""
    q, k, v, dout, o = make(21, ("rel_qk", "mask"), lq=33, lk=33)
    o["causal"] = True
    rk = o["rel_k"].shape[-2] // 2
    o["rel_k"][rk + 1:] = np.nan                      # distances > 0: never seen under causal
    o["rel_q"][0, 1, 3] = np.nan                      # row 3 sees no key (make's mask)
    g = backward(q, k, v, dout, o)
    clean = dict(o, rel_k=np.nan_to_num(o["rel_k"], nan=0.0),
                 rel_q=np.nan_to_num(o["rel_q"], nan=0.0))
    ref = reference_attention_backward(dout, q, k, v, **clean)
    for name in GRAD_NAMES:
        got = getattr(g, name)
        if ref[name] is None:
            continue
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, ref[name], rtol=0, atol=1e-12, err_msg=name)
    assert not g.drel_k[rk + 1:].any()


def _wrong_lse(how, q, k, v, o):
    out, lse = cuonline.attention(q, k, v, return_lse=True, **o)
    if how == "plus 5":
        return out, lse + 5
    if how == "minus 50":
        return out, lse - 50
    if how == "-inf where keys are seen":
        lse = lse.copy()
        lse[0, 0, 4] = -np.inf
        return out, lse
    if how == "+inf":
        lse = lse.copy()
        lse[1, 2, 0] = np.inf
        return out, lse
    # the lse of a call with other options: causal sees fewer keys
    return cuonline.attention(q, k, v, return_lse=True, causal=True, **o)


@pytest.mark.parametrize("how", ["plus 5", "minus 50", "-inf where keys are seen", "+inf",
                                 "causal lse"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_an_lse_of_other_inputs_is_refused(small_tiles, how, dtype):
    """Issue 22, item 6: each row's sum of P = exp(s - lse) must be 1 (0 for a row without
    keys) within rounding; before, every one of these returned finite, wrong gradients."""
    q, k, v, dout, o = make(22, ("bias", "rel_qk"))
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    out, lse = _wrong_lse(how, q, k, v, o)
    with pytest.raises(ValueError, match=r"`lse` must be the one attention returned .* row \("):
        cuonline.attention_backward(dout, q, k, v, out, lse, **o)


def test_the_lse_message_names_the_row_and_its_sum(small_tiles):
    q, k, v, dout, o = make(23, ())
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    lse = lse.copy()
    lse[1, 0, 7] += 5
    with pytest.raises(ValueError, match=r"row \(1, 0, 7\) sums to 0\.0067\d* .* by about 5"):
        cuonline.attention_backward(dout, q, k, v, out, lse)


def _cancelling(dtype, sigma, seed=24):
    """Large products cancelled by a bias: logits of order 1 from terms of order sigma**2."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, 40, 64)) * sigma).astype(dtype)
    k = (rng.standard_normal((1, 300, 64)) * sigma).astype(dtype)
    v = rng.standard_normal((1, 300, 8)).astype(dtype)
    bias = -(q[0].astype(np.float64) @ k[0].T.astype(np.float64)) / 8
    return q, k, v, (bias + rng.standard_normal(bias.shape)).astype(np.float32)


@pytest.mark.parametrize("case", ["cancelling f32", "cancelling f16", "large f32",
                                  "large bf16", "softcap", "every option", "extreme bias",
                                  "negative scale"])
def test_the_lse_check_never_fires_on_genuine_inputs(case):
    """Large logits, products cancelled by a bias (another tile shape in the backward rounds
    them another way), 16-bit inputs, every option, logits near float32's range, a negative
    scale (whose products bound the rounding by its magnitude)."""
    rng = np.random.default_rng(25)
    o = {}
    if case.startswith("cancelling"):
        dtype = np.float32 if case.endswith("f32") else np.float16
        q, k, v, o["bias"] = _cancelling(dtype, 300.0 if dtype == np.float32 else 8.0)
    elif case.startswith("large"):
        dtype = np.float32 if case.endswith("f32") else BFLOAT16
        if dtype is None:
            pytest.skip("ml_dtypes is not installed")
        q, k, v = (rng.standard_normal((2, 70, 32)) * 40).astype(dtype), \
            (rng.standard_normal((2, 600, 32)) * 40).astype(dtype), \
            rng.standard_normal((2, 600, 8)).astype(dtype)
    elif case == "softcap":
        q, k, v, o["bias"] = _cancelling(np.float32, 30.0)
        o["softcap"], o["softcap_bias"] = 20.0, True
    elif case == "every option":
        q, k, v, _, o = make(26, ("softcap", "rel_qk", "rel_bias", "block_bias", "offsets",
                                  "window", "alibi"), lq=70, lk=600, dtype=np.float32)
        q, k, v = (x.astype(np.float32) * 6 for x in (q, k, v))
    elif case == "extreme bias":
        q, k, v = (rng.standard_normal((1, 30, 16)).astype(np.float32) for _ in range(3))
        o["bias"] = np.full((30, 30), 3e38, np.float32) * np.sign(rng.standard_normal((30, 30)))
    else:
        q, k, v = ((rng.standard_normal((2, 64, 16)) * 10).astype(np.float32) for _ in range(3))
        o["scale"] = -0.5
    out, lse = cuonline.attention(q, k, v, return_lse=True, **o)
    dout = np.ones_like(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cuonline.attention_backward(dout, q, k, v, out, lse, **o)


def test_part_of_the_keys_with_the_global_lse(small_tiles):
    """Inside partial_keys (a Dask chunk pair), row sums below 1 are right; above is not."""
    from cuonline import _lse_check

    q, k, v, dout, o = make(27, ())
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    with _lse_check.partial_keys():
        cuonline.attention_backward(dout, q, k[..., :20, :], v[..., :20, :], out, lse)
        with pytest.raises(ValueError, match="`lse`"):
            cuonline.attention_backward(dout, q, k[..., :20, :], v[..., :20, :], out, lse - 50)
    with pytest.raises(ValueError, match="`lse`"):
        cuonline.attention_backward(dout, q, k[..., :20, :], v[..., :20, :], out, lse)


def test_the_row_sum_rule_itself():
    """cuonline._lse_check, the rule every engine's backward applies (also the CUDA one)."""
    from cuonline import _lse_check

    def check(sums, lse, **kw):
        kw = dict(dict(acc_dtype=np.float32, n_keys=100, logit_terms=8), **kw)
        _lse_check.check_row_sums(np, np.array(sums), np.array(lse, np.float32), **kw)

    tol = float(_lse_check.row_sum_tolerance(np, np.float32, 100, np.float32(2.0), 8))
    assert tol == pytest.approx(np.finfo(np.float32).eps * (100 + 12 * (2 + np.log(101) + 1)))
    assert _lse_check.row_sum_tolerance(np, np.float64, 100, 2.0, 8) < tol
    assert _lse_check.row_sum_tolerance(np, np.float32, 100, 2.0, 8, np.nan) == np.inf
    check([1.0, np.exp(tol / 2), 0.0, np.nan], [2.0, 2.0, -np.inf, np.nan])
    with pytest.raises(ValueError, match=r"row \(1,\) sums to"):
        check([1.0, np.exp(2 * tol)], [2.0, 2.0])
    with pytest.raises(ValueError, match=r"-inf at row \(1,\), which sees keys"):
        check([1.0, 0.0], [2.0, -np.inf], sees_keys=np.array([True, True]))
    with pytest.raises(ValueError, match=r"row \(0,\) sums to 0 .*more than the dtype's range"):
        check([0.0], [np.inf])
    check([0.3, 0.0], [2.0, 2.0], all_keys=False)               # part of the keys: below 1
    with pytest.raises(ValueError, match="`lse`"):
        check([1.5], [2.0], all_keys=False)
    assert not _lse_check.keys_are_partial()
    with _lse_check.partial_keys():
        assert _lse_check.keys_are_partial()
        check([0.3], [2.0])
    # R: scale |q_i| max_j |k_j| over keys below kv_lengths, NaN left out
    q = np.array([[[3.0, 4.0], [0.0, 1.0]]])
    k = np.array([[[1.0, 0.0], [0.0, 2.0], [np.nan, 9.0]]])
    r = _lse_check.product_bound(np, q, k, 0.5, kv_lengths=np.array([2]))
    np.testing.assert_allclose(r, [[0.5 * 5 * 2, 0.5 * 1 * 2]])
    np.testing.assert_allclose(_lse_check.product_bound(np, q, k, 0.5), r)   # NaN row left out
    np.testing.assert_array_equal(_lse_check.product_bound(np, q, k, -0.5), r)  # |scale|
    # R given as a function: called only for a row past the bound of R = 0
    calls = []

    def products(value):
        return lambda: calls.append(value) or np.array([value])

    big = float(_lse_check.row_sum_tolerance(np, np.float32, 100, np.float32(2.0), 8, 50.0))
    check([np.exp(tol / 2)], [2.0], products=products(50.0))
    assert calls == []
    check([np.exp((tol + big) / 2)], [2.0], products=products(50.0))
    assert calls == [50.0]
    with pytest.raises(ValueError, match=r"row \(0,\) sums to"):
        check([np.exp(2 * big)], [2.0], products=products(50.0))


def test_rows_within_the_least_bound_pass_without_the_full_check(monkeypatch):
    """docs/semantics.md: rows within the bound of |lse| = R = 0 and the fewest keys pass at
    once, on the sums' least and most; a row past it (or a row given lse = -inf, or part of
    the keys) takes the full check, the row-by-row bound."""
    from cuonline import _lse_check

    def full(*args, **kw):
        raise AssertionError("the full check ran")

    least = float(_lse_check.row_sum_tolerance(np, np.float32, 8, 0.0, 16))
    kw = dict(acc_dtype=np.float32, n_keys=np.array([[8], [100]]), logit_terms=16)
    sums = np.full((2, 3), np.exp(least / 2))
    with monkeypatch.context() as m:
        m.setattr(_lse_check, "row_sum_tolerance", full)
        _lse_check.check_row_sums(np, sums, np.zeros((2, 3)), **kw)
        for lse, sums_, all_keys in ((np.zeros((2, 3)), sums * np.exp(least), None),
                                     (np.full((2, 3), -np.inf), sums * 0, None),
                                     (np.zeros((2, 3)), sums, False)):
            with pytest.raises(AssertionError, match="full check"):
                _lse_check.check_row_sums(np, sums_, lse, all_keys=all_keys, **kw)


@pytest.mark.parametrize("scale", [0.5, -0.5])
def test_an_lse_within_the_bound_of_its_products_is_accepted(scale):
    """An lse off by more than the bound without the products' term R, less than the one
    with it, is accepted, under either sign of the scale (R takes its magnitude); past that,
    refused."""
    from cuonline import _lse_check

    rng = np.random.default_rng(31)
    q, k, v = ((rng.standard_normal((2, 40, 64)) * 10).astype(np.float32) for _ in range(3))
    out, lse = cuonline.attention(q, k, v, scale=scale, return_lse=True)
    wide = lse.astype(np.float64)
    tol0 = _lse_check.row_sum_tolerance(np, np.float32, 40, wide, 64)
    tol = _lse_check.row_sum_tolerance(np, np.float32, 40, wide, 64,
                                       _lse_check.product_bound(np, q, k, abs(scale)))
    assert (tol > 1.5 * tol0).all()
    dout = np.ones_like(out)
    cuonline.attention_backward(dout, q, k, v, out, (wide + (tol0 + tol) / 2).astype(np.float32),
                                scale=scale)
    with pytest.raises(ValueError, match="`lse`"):
        cuonline.attention_backward(dout, q, k, v, out, (wide + 2 * tol).astype(np.float32),
                                    scale=scale)


def test_the_product_bound_of_packed_sequences_is_each_sequences_own(rng):
    """Packed sequences: each query row's R is the one of its own sequence as a call of its
    own (its own keys' largest norm, NaN left out); a sequence without keys gives its rows 0,
    one without queries gives no row."""
    from cuonline import _lse_check

    cu_q, cu_k = np.array([0, 3, 3, 7, 9]), np.array([0, 4, 6, 6, 11])
    q = rng.standard_normal((2, 9, 8))
    k = rng.standard_normal((2, 11, 8)) * np.arange(1, 12)[:, None]  # each sequence its max
    k[1, 10, 2] = np.nan
    got = _lse_check.product_bound(np, q, k, -0.25, sequences=(cu_q, cu_k))
    assert got.shape == (2, 9)
    for s in range(4):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        want = _lse_check.product_bound(np, q[:, rows], k[:, keys], -0.25)
        np.testing.assert_allclose(got[:, rows], want, rtol=1e-14)
    assert (got[:, 3:7] == 0).all() and (got[:, 7:] > 0).all()


def test_the_product_bound_of_float32_inputs_is_an_upper_bound(rng):
    """Norms summed in float32 (the fast path) never fall below float64's, and squares that
    overflow float32 (|x| ~ 1e20) are summed in float64 instead of becoming inf."""
    from cuonline import _lse_check

    q = rng.standard_normal((3, 50, 64)).astype(np.float32) * 7
    k = rng.standard_normal((3, 40, 64)).astype(np.float32) * 3
    got = _lse_check.product_bound(np, q, k, 0.125)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    exact = 0.125 * np.linalg.norm(q64, axis=-1) * np.linalg.norm(k64, axis=-1).max(-1)[:, None]
    assert got.dtype == np.float64 and (got >= exact).all()
    np.testing.assert_allclose(got, exact, rtol=1e-4)
    q[1, 3] = 1e20
    got = _lse_check.product_bound(np, q, k, 0.125)
    assert np.isfinite(got).all() and got[1, 3] > 1e20 * 7


@pytest.mark.parametrize("options", [{}, {"causal": True, "bias": "bias"}], ids=["plain", "bias"])
def test_an_lse_off_by_delta_scales_every_gradient_by_exp_minus_delta(options):
    # the premise of the gradients' accuracy floor (tests/support.py, lse_rounding;
    # docs/semantics.md): P = exp(s - lse) is recomputed from the lse given, while Delta comes
    # from out, so every P, dS and gradient of a row scales by exp(-delta)
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 40, 8)) for _ in range(3))
    if "bias" in options:
        options = dict(options, bias=rng.standard_normal((40, 40)))
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape)
    # within the lse check's float64 tolerance (a few 1e-14), about 45 ulps of each P
    delta = 1e-14
    base = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
    moved = cuonline.attention_backward(dout, q, k, v, out, lse + delta, **options)
    for field in ("dq", "dk", "dv") + (("dbias",) if "bias" in options else ()):
        b, m = getattr(base, field), getattr(moved, field)
        size = delta * np.abs(b).max()
        assert np.abs(m - b).max() >= 0.5 * size, field                    # it moved
        assert np.abs(m - b * np.exp(-delta)).max() <= 0.2 * size, field  # by exp(-delta)
