"""cuonline.jax: attention under jax.jit, jax.grad / jax.vjp, jax.vmap and their compositions,
every option, in float64 (jax_enable_x64), against the float64 oracle (tests/oracle.py),
cuonline.attention_backward and central finite differences; trace-time errors; merge."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from oracle import reference_attention, reference_attention_backward
from support import fast_tier
from test_frameworks import CASES, DV, FINITE_LSE_CASES, LQ, case_arrays, dense_attention

import cuonline

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
cj = pytest.importorskip("cuonline.jax")

DIFFERENTIABLE = ("q", "k", "v", "bias", "rel_bias", "rel_q", "rel_k")
FIELD = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "rel_bias": "drel_bias",
         "rel_q": "drel_q", "rel_k": "drel_k"}


@pytest.fixture(autouse=True, scope="module")
def _x64():
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


#: the operations dense_attention needs, in JAX
JAX_OPS = SimpleNamespace(einsum=jnp.einsum, tanh=jnp.tanh, where=jnp.where, exp=jnp.exp,
                          asarray=jnp.asarray,
                          logsumexp=lambda x: jax.scipy.special.logsumexp(x, axis=-1))


def split(arrays):
    """(differentiable arrays, constant arrays) of a case, as JAX arrays."""
    diff = {n: jnp.asarray(x) for n, x in arrays.items() if n in DIFFERENTIABLE}
    const = {n: jnp.asarray(x) for n, x in arrays.items() if n not in DIFFERENTIABLE}
    return diff, const


def loss_of(statics, const, weight, lse_weight=None):
    """A scalar of attention's results: sum(out * weight) (+ sum(lse * lse_weight))."""
    def loss(diff):
        if lse_weight is None:
            return (cj.attention(**diff, **const, **statics) * weight).sum()
        out, lse = cj.attention(**diff, **const, **statics, return_lse=True)
        return (out * weight).sum() + (lse * lse_weight).sum()
    return loss


@pytest.mark.parametrize("name", CASES)
def test_jit_forward_matches_the_oracle(name):
    arrays, statics = case_arrays(name)
    want_out, want_lse = reference_attention(**arrays, **statics)
    run = jax.jit(lambda a: cj.attention(**a, **statics, return_lse=True))
    out, lse = run({n: jnp.asarray(x) for n, x in arrays.items()})
    assert out.dtype == lse.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_jit_grad_matches_attention_backward_and_the_oracle(name):
    arrays, statics = case_arrays(name)
    weight = np.random.default_rng(9).standard_normal((2, 3, 5, 3))
    diff, const = split(arrays)
    grads = jax.jit(jax.grad(loss_of(statics, const, weight)))(diff)
    out, lse = cuonline.attention(**arrays, **statics, return_lse=True)
    g = cuonline.attention_backward(weight, **arrays, out=out, lse=lse, **statics)
    oracle = reference_attention_backward(weight, **arrays, **statics)
    assert set(grads) == set(diff)
    for n, got in grads.items():
        assert got.shape == arrays[n].shape and got.dtype == jnp.float64, n
        np.testing.assert_allclose(np.asarray(got), getattr(g, FIELD[n]), rtol=0, atol=1e-13)
        np.testing.assert_allclose(np.asarray(got), oracle[FIELD[n]], rtol=0, atol=1e-10)


# fast tier: rel_qk, the case with the most differentiable inputs; every case's jit gradient
# is test_jit_grad_matches_attention_backward_and_the_oracle's
@pytest.mark.parametrize("name", fast_tier(CASES, ("rel_qk",)))
def test_grad_under_jit_and_vmap_matches_jax_grad_of_a_dense_reference(name):
    """jax.grad of cuonline.jax.attention against jax.grad of dense_attention written in
    jax.numpy (float64), for every differentiable input of the case (q, k, v, bias,
    rel_bias, rel_q, rel_k; through lse too where it is finite): under jax.jit, and under
    jax.vmap over a stack of queries (per-element gradients of every input)."""
    arrays, statics = case_arrays(name)
    diff, const = split(arrays)
    with_lse = name in FINITE_LSE_CASES
    rng = np.random.default_rng(17)
    weight, lse_weight = rng.standard_normal((2, 3, LQ, DV)), rng.standard_normal((2, 3, LQ))

    def ours(diff):
        if not with_lse:
            return (cj.attention(**diff, **const, **statics) * weight).sum()
        out, lse = cj.attention(**diff, **const, **statics, return_lse=True)
        return (out * weight).sum() + (lse * lse_weight).sum()

    def dense(diff):
        out, lse = dense_attention(JAX_OPS, **diff, **const, **statics)
        return (out * weight).sum() + ((lse * lse_weight).sum() if with_lse else 0.0)

    np.testing.assert_allclose(float(jax.jit(ours)(diff)), float(dense(diff)), rtol=1e-13)
    got, want = jax.jit(jax.grad(ours))(diff), jax.grad(dense)(diff)
    assert set(got) == set(want) == set(diff)
    for n in diff:
        assert got[n].shape == diff[n].shape and got[n].dtype == jnp.float64, n
        np.testing.assert_allclose(np.asarray(got[n]), np.asarray(want[n]), rtol=0,
                                   atol=1e-12, err_msg=n)

    qs = jnp.stack([diff["q"], 0.5 * diff["q"], -diff["q"]])
    rest = {n: x for n, x in diff.items() if n != "q"}

    def per_query(loss):
        return jax.vmap(jax.grad(lambda q, rest: loss({**rest, "q": q}), argnums=(0, 1)),
                        in_axes=(0, None))

    (got_q, got_rest) = jax.jit(per_query(ours))(qs, rest)
    (want_q, want_rest) = per_query(dense)(qs, rest)
    np.testing.assert_allclose(np.asarray(got_q), np.asarray(want_q), rtol=0, atol=1e-12)
    for n in rest:
        assert got_rest[n].shape == (3,) + diff[n].shape, n
        np.testing.assert_allclose(np.asarray(got_rest[n]), np.asarray(want_rest[n]), rtol=0,
                                   atol=1e-12, err_msg=n)


@pytest.mark.parametrize("name", FINITE_LSE_CASES)
def test_vjp_with_lse_matches_central_differences(name):
    arrays, statics = case_arrays(name)
    rng = np.random.default_rng(10)
    weight, lse_weight = rng.standard_normal((2, 3, 5, 3)), rng.standard_normal((2, 3, 5))
    diff, const = split(arrays)
    loss = loss_of(statics, const, weight, lse_weight)
    value, vjp = jax.vjp(loss, diff)
    (grads,) = vjp(jnp.ones(()))
    direction = {n: rng.standard_normal(x.shape) for n, x in diff.items()}
    h = 1e-5
    plus = loss({n: x + h * direction[n] for n, x in diff.items()})
    minus = loss({n: x - h * direction[n] for n, x in diff.items()})
    numeric = float(plus - minus) / (2 * h)
    analytic = sum(float((grads[n] * direction[n]).sum()) for n in diff)
    assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), (numeric, analytic)


def test_constants_get_zero_cotangents():
    arrays, statics = case_arrays("mask_lengths")
    arrays["alibi_slopes"] = np.array([0.5, 0.25, 0.125])
    q, k, v = (jnp.asarray(arrays[n]) for n in "qkv")
    consts = {n: jnp.asarray(arrays[n]) for n in ("mask", "kv_lengths", "alibi_slopes")}

    def loss(q, consts):
        return cj.attention(q, k, v, **consts, **statics).sum()

    _, vjp = jax.vjp(loss, q, consts)
    _, dconst = vjp(jnp.ones(()))
    assert dconst["mask"].dtype == jax.dtypes.float0
    assert dconst["kv_lengths"].dtype == jax.dtypes.float0
    assert not np.asarray(dconst["alibi_slopes"]).any()


# --------------------------------------------------------------------------------------------
# vmap


def _loop(fn, *columns):
    return np.stack([fn(*args) for args in zip(*columns)])


def test_vmap_maps_axes_of_any_argument_into_the_batch():
    arrays, _ = case_arrays("bias")
    q, k, v, bias = (arrays[n] for n in ("q", "k", "v", "bias"))
    qs = np.stack([q, q + 1.0, q - 1.0], axis=2)               # mapped axis 2 of q
    biases = np.stack([bias, 2 * bias, -bias])                 # mapped axis 0 of bias
    got = jax.jit(jax.vmap(lambda q, b: cj.attention(q, k, v, bias=b, causal=True),
                           in_axes=(2, 0)))(qs, biases)
    want = _loop(lambda q, b: cuonline.attention(q, k, v, bias=b, causal=True),
                 np.moveaxis(qs, 2, 0), biases)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-13)


def test_nested_vmap_of_grad_and_grad_of_vmap():
    arrays, _ = case_arrays("rel_qk")
    q, k, v, rel_q, rel_k = (arrays[n] for n in ("q", "k", "v", "rel_q", "rel_k"))
    rng = np.random.default_rng(11)
    ks = rng.standard_normal((2,) + k.shape)                   # outer map: k
    rel_ks = rng.standard_normal((3,) + rel_k.shape)           # inner map: rel_k

    def loss(k, rel_k, q):
        return (cj.attention(q, k, v, rel_q=rel_q, rel_k=rel_k) ** 2).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = jax.jit(jax.vmap(jax.vmap(grad, in_axes=(None, 0, None)),
                           in_axes=(0, None, None)))(ks, rel_ks, q)

    def numpy_grads(k, rel_k):
        out, lse = cuonline.attention(q, k, v, rel_q=rel_q, rel_k=rel_k, return_lse=True)
        g = cuonline.attention_backward(2 * out, q, k, v, out, lse, rel_q=rel_q, rel_k=rel_k)
        return g.dk, g.drel_k, g.dq

    for i in range(2):
        for j in range(3):
            for got_g, want_g in zip(got, numpy_grads(ks[i], rel_ks[j])):
                np.testing.assert_allclose(np.asarray(got_g[i, j]), want_g, atol=1e-12)

    # grad of a vmapped loss: the per-element gradients of an unmapped argument are summed
    total = jax.grad(lambda q: jax.vmap(loss, in_axes=(0, None, None))(ks, rel_k, q).sum())(q)
    want = sum(numpy_grads(ks[i], rel_k)[2] for i in range(2))
    np.testing.assert_allclose(np.asarray(total), want, atol=1e-12)


def test_vmap_of_an_unmapped_differentiable_argument_gives_per_element_gradients():
    arrays, _ = case_arrays("bias")
    q, k, v, bias = (jnp.asarray(arrays[n]) for n in ("q", "k", "v", "bias"))
    scales = jnp.asarray([1.0, 2.0])
    per = jax.vmap(jax.grad(lambda b, s: (cj.attention(q * s, k, v, bias=b) ** 2).sum()),
                   in_axes=(None, 0))(bias, scales)
    assert per.shape == (2,) + bias.shape
    for i in range(2):
        want = jax.grad(lambda b: (cj.attention(q * scales[i], k, v, bias=b) ** 2).sum())(bias)
        np.testing.assert_allclose(np.asarray(per[i]), np.asarray(want), atol=1e-13)


def test_vmap_over_constants_only():
    """Only the mask and the key lengths are mapped: the batch still grows, and q gets one
    gradient per mapped element."""
    rng = np.random.default_rng(15)
    q, k, v = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 7, 4)), \
        rng.standard_normal((3, 7, 2))
    masks, lengths = rng.random((4, 5, 7)) < 0.7, np.array([2, 7, 5, 3])

    def loss(q, mask, length):
        return (cj.attention(q, k, v, mask=mask, kv_lengths=length) ** 2).sum()

    got = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(q, masks, lengths)
    for i in range(4):
        out, lse = cuonline.attention(q, k, v, mask=masks[i], kv_lengths=lengths[i],
                                      return_lse=True)
        g = cuonline.attention_backward(2 * out, q, k, v, out, lse, mask=masks[i],
                                        kv_lengths=lengths[i])
        np.testing.assert_allclose(np.asarray(got[i]), g.dq, atol=1e-13)


# --------------------------------------------------------------------------------------------
# dtypes, errors, merge


def test_float32_and_bfloat16():
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 9, 8))
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(q, dtype=dtype)
        out, lse = jax.jit(lambda x: cj.attention(x, x, x, return_lse=True))(x)
        assert out.dtype == dtype and lse.dtype == jnp.float32
        want = cuonline.attention(*(np.asarray(x),) * 3)
        np.testing.assert_array_equal(np.asarray(out), want)


def test_without_x64_float64_becomes_float32():
    q = np.random.default_rng(13).standard_normal((9, 8))
    jax.config.update("jax_enable_x64", False)
    try:
        out = cj.attention(q, q, q)              # JAX's rule: jnp.asarray makes float32
    finally:
        jax.config.update("jax_enable_x64", True)
    assert out.dtype == jnp.float32
    want = cuonline.attention(*(q.astype(np.float32),) * 3)
    np.testing.assert_array_equal(np.asarray(out), want)


def test_errors_are_raised_at_trace_time():
    q = jnp.ones((2, 5, 4))
    with pytest.raises(ValueError, match=r"`k` must have the head dimension of `q` \(D = 4\)"):
        jax.jit(lambda q, k: cj.attention(q, k, k)).lower(q, jnp.ones((2, 5, 3)))
    with pytest.raises(TypeError, match=r"`mask` must be a boolean array"):
        jax.jit(lambda q, m: cj.attention(q, q, q, mask=m)).lower(q, jnp.ones((5, 5)))
    with pytest.raises(TypeError, match=r"`q_offset` must be a Python value known when the JAX"):
        jax.jit(lambda q, o: cj.attention(q, q, q, q_offset=o)).lower(q, 3)
    with pytest.raises(TypeError, match=r"`scale` must be a Python value"):
        jax.jit(lambda q, s: cj.attention(q, q, q, scale=s)).lower(q, 0.5)
    # validation for the engine the callback will run: a CUDA engine's limits (here the
    # emulated one on the CPU; on a GPU, backend="auto" on CuPy stand-ins) and a backend
    # that does not take the device's arrays, when the program is traced, not when it runs
    with pytest.raises(ValueError, match=r"backend='emulate' supports head dimensions up to"):
        jax.jit(lambda q: cj.attention(q, q, q, backend="emulate")).lower(jnp.ones((5, 300)))
    with pytest.raises(TypeError, match=r"backend='cupy' takes cupy arrays, got numpy"):
        jax.jit(lambda q: cj.attention(q, q, q, backend="cupy")).lower(q)


def test_merge_under_jit_and_grad():
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))

    def split_attention(k):
        a = cj.attention(q, k[:, :2], v[:, :2], return_lse=True)
        b = cj.attention(q, k[:, 2:], v[:, 2:], return_lse=True)
        return cj.merge(a, b)

    out, lse = jax.jit(split_attention)(k)
    want_out, want_lse = cuonline.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-13)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-13)
    got = jax.grad(lambda k: split_attention(k)[0].sum())(k)
    g = cuonline.attention_backward(np.ones_like(want_out), q, k, v, want_out, want_lse)
    np.testing.assert_allclose(np.asarray(got), g.dk, atol=1e-12)
    with pytest.raises(ValueError, match=r"state 1: `out` has shape"):
        cj.merge((out, lse), (out[:1], lse[:1]))


def test_layout_blhd_against_jax_nn_dot_product_attention():
    """jax.nn takes (batch, length, heads, dim); it computes the softmax in float32 even for
    float64 inputs, so it agrees to float32 accuracy, and the heads-first call exactly."""
    rng = np.random.default_rng(16)
    q = jnp.asarray(rng.standard_normal((2, 33, 4, 16)))     # (batch, length, heads, dim)
    k, v = (jnp.asarray(rng.standard_normal((2, 40, 1, 16))) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((2, 4, 33, 40)))

    def ours(q, k, v):
        return cj.attention(q, k, v, bias=bias, layout="blhd")

    def heads_first(q, k, v):
        out = cj.attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), bias=bias)
        return jnp.swapaxes(out, 1, 2)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, bias=bias)

    out = jax.jit(ours)(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(heads_first(q, k, v)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(theirs(q, k, v)), atol=1e-6)
    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()      # noqa: E731
    got = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    exact = jax.grad(loss(heads_first), argnums=(0, 1, 2))(q, k, v)
    near = jax.grad(loss(theirs), argnums=(0, 1, 2))(q, k, v)
    for a, b, c in zip(got, exact, near):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5)
    out, lse = cj.attention(q, k, v, return_lse=True, layout="blhd")
    assert out.shape == (2, 33, 4, 16) and lse.shape == (2, 4, 33)
    # read through strides inside the callback: the program transposes nothing, forward or
    # backward
    for program in (ours, jax.grad(loss(ours), argnums=(0, 1, 2))):
        text = jax.jit(program).lower(q, k, v).as_text()
        assert "custom_call" in text and "transpose" not in text
    # vmapped: the mapped axis goes in front of the batch, the strides still do the rest
    qs = jnp.stack([q, -q])
    mapped = jax.jit(jax.vmap(jax.grad(loss(ours), argnums=(0, 1)), in_axes=(0, None, None)))(
        qs, k, v)
    for i in range(2):
        each = jax.grad(loss(ours), argnums=(0, 1))(qs[i], k, v)
        for a, b in zip(mapped, each):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))
    with pytest.raises(ValueError, match=r"layout='blhd' takes `q` of shape"):
        cj.attention(q[0], k, v, layout="blhd")
