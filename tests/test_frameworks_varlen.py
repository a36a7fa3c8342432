"""Packed variable-length batches (``cu_seqlens_q``, ``cu_seqlens_k``) in the bindings:
``cuonline.jax.attention`` under jit, grad and vmap, ``cuonline.torch.attention`` with
autograd and torch.compile, against the NumPy engine's ``cuonline.attention`` and
``cuonline.attention_backward`` on the same packed arrays (and the float64 oracle run one
sequence at a time); gradients packed like their inputs; the boundaries as host values, a
traced one refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import reference_varlen_attention

import cuonline

#: per sequence: an empty query side, an empty key side, one token, lengths off any tile
LENGTHS_Q = [3, 0, 7, 1, 18]
LENGTHS_K = [5, 2, 0, 1, 21]
CQ = np.concatenate(([0], np.cumsum(LENGTHS_Q)))
CK = np.concatenate(([0], np.cumsum(LENGTHS_K)))
OPTIONS = {"causal": True, "cu_seqlens_q": CQ, "cu_seqlens_k": CK}
DIFFERENTIABLE = ("q", "k", "v", "rel_bias", "rel_q", "rel_k")
FIELD = {"q": "dq", "k": "dk", "v": "dv", "rel_bias": "drel_bias", "rel_q": "drel_q",
         "rel_k": "drel_k"}


def packed_case(seed=0):
    """q (heads 2, total_q, 4) against k, v shared by the heads, with every per-sequence
    term that takes a gradient: rel_bias, rel_q (packed like q), rel_k; ALiBi."""
    rng = np.random.default_rng(seed)
    tq, tk = int(CQ[-1]), int(CK[-1])
    arrays = {"q": rng.standard_normal((2, tq, 4)), "k": rng.standard_normal((1, tk, 4)),
              "v": rng.standard_normal((1, tk, 3)), "rel_bias": rng.standard_normal((2, 9)),
              "rel_q": rng.standard_normal((2, tq, 2)), "rel_k": rng.standard_normal((11, 2)),
              "alibi_slopes": np.array([0.25, 0.5])}
    return arrays, rng.standard_normal((2, tq, 3)), rng.standard_normal((2, tq))


def numpy_results(arrays, weight, lse_weight):
    """out, lse and the gradients of sum(out * weight) + sum(lse * lse_weight) (finite lse
    only), by the NumPy engine; the lse term by the backward of a column of -lse_weight."""
    out, lse = cuonline.attention(**arrays, **OPTIONS, return_lse=True)
    g = cuonline.attention_backward(weight, **arrays, out=out, lse=lse, **OPTIONS)
    return out, lse, g


# --------------------------------------------------------------------------------------------
# JAX


@pytest.fixture()
def jax_x64():
    jax = pytest.importorskip("jax")
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield jax
    jax.config.update("jax_enable_x64", before)


def test_jax_packed_forward_and_grad_under_jit_and_vmap(jax_x64):
    jax, jnp = jax_x64, pytest.importorskip("jax.numpy")
    cj = pytest.importorskip("cuonline.jax")
    arrays, weight, _ = packed_case()
    out_np, lse_np, g = numpy_results(arrays, weight, None)
    want_out, want_lse = reference_varlen_attention(**arrays, **OPTIONS)
    np.testing.assert_allclose(out_np, want_out, atol=1e-12)
    diff = {n: jnp.asarray(x) for n, x in arrays.items() if n in DIFFERENTIABLE}
    slopes = jnp.asarray(arrays["alibi_slopes"])
    # boundaries as a list, as NumPy and as a (concrete) JAX array
    options = {"causal": True, "cu_seqlens_q": CQ.tolist(), "cu_seqlens_k": jnp.asarray(CK)}

    def attention(diff):
        return cj.attention(**diff, alibi_slopes=slopes, **options, return_lse=True)

    out, lse = jax.jit(attention)(diff)
    np.testing.assert_array_equal(np.asarray(out), out_np)
    np.testing.assert_array_equal(np.asarray(lse), lse_np)
    assert lse.shape == (2, int(CQ[-1]))

    grads = jax.jit(jax.grad(lambda d: (attention(d)[0] * weight).sum()))(diff)
    for n, x in diff.items():
        assert grads[n].shape == x.shape, n                      # packed like the input
        np.testing.assert_array_equal(np.asarray(grads[n]), getattr(g, FIELD[n]), err_msg=n)

    # vmap over a stack of packed queries: one call with a leading batch axis
    qs = jnp.stack([diff["q"], 2.0 * diff["q"]])
    per = jax.jit(jax.vmap(jax.grad(
        lambda q, d: (attention({**d, "q": q})[0] * weight).sum(), argnums=(0, 1)),
        in_axes=(0, None)))(qs, diff)
    doubled = {**arrays, "q": 2.0 * arrays["q"]}
    _, _, g2 = numpy_results(doubled, weight, None)
    np.testing.assert_allclose(np.asarray(per[0][1]), g2.dq, atol=1e-13)
    np.testing.assert_allclose(np.asarray(per[1]["rel_k"][1]), g2.drel_k, atol=1e-13)
    np.testing.assert_allclose(np.asarray(per[1]["k"][0]), g.dk, atol=1e-13)


def test_jax_packed_lse_gradient(jax_x64):
    jax, jnp = jax_x64, pytest.importorskip("jax.numpy")
    cj = pytest.importorskip("cuonline.jax")
    arrays, weight, lse_weight = packed_case(1)
    # the lse gradient is tested where lse is finite: sequences whose queries see a key
    seen = np.isfinite(cuonline.attention(**arrays, **OPTIONS, return_lse=True)[1])
    lse_weight = np.where(seen, lse_weight, 0.0)
    diff = {n: jnp.asarray(x) for n, x in arrays.items() if n in DIFFERENTIABLE}

    def loss(d):
        out, lse = cj.attention(**d, alibi_slopes=arrays["alibi_slopes"], **OPTIONS,
                                return_lse=True)
        return (out * weight).sum() + jnp.where(seen, lse * lse_weight, 0.0).sum()

    value, grads = jax.value_and_grad(loss)(diff)
    direction = {n: np.random.default_rng(2).standard_normal(x.shape) for n, x in diff.items()}
    h = 1e-5
    plus = loss({n: x + h * direction[n] for n, x in diff.items()})
    minus = loss({n: x - h * direction[n] for n, x in diff.items()})
    numeric = float(plus - minus) / (2 * h)
    analytic = sum(float((grads[n] * direction[n]).sum()) for n in diff)
    assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), (numeric, analytic)


def test_jax_packed_errors_at_trace_time(jax_x64):
    jax, jnp = jax_x64, pytest.importorskip("jax.numpy")
    cj = pytest.importorskip("cuonline.jax")
    arrays, _, _ = packed_case()
    q, k, v = (jnp.asarray(arrays[n]) for n in "qkv")
    with pytest.raises(TypeError, match=r"`cu_seqlens_q` is a traced JAX value, but the "
                                        r"sequence boundaries decide the shape of the work"):
        jax.jit(lambda q, c: cj.attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=CK)).lower(
            q, jnp.asarray(CQ))
    with pytest.raises(ValueError, match=r"`bias` cannot be combined with `cu_seqlens_q`"):
        jax.jit(lambda q, b: cj.attention(q, k, v, bias=b, **OPTIONS)).lower(
            q, jnp.zeros((int(CQ[-1]), int(CK[-1]))))
    with pytest.raises(ValueError, match=r"`cu_seqlens_k` must end at k.shape\[-2\]"):
        jax.jit(lambda q: cj.attention(q, k, v, cu_seqlens_q=CQ,
                                       cu_seqlens_k=CK[:-1].tolist() + [CK[-1] + 1])).lower(q)
    with pytest.raises(TypeError, match=r"`cu_seqlens_q` must be a 1-D integer array of "
                                        r"sequence boundaries, got floating"):
        cj.attention(q, k, v, cu_seqlens_q=CQ.astype(float), cu_seqlens_k=CK)
    with pytest.raises(ValueError, match=r"`cu_seqlens_q` was given without `cu_seqlens_k`"):
        cj.attention(q, k, v, cu_seqlens_q=CQ)


# --------------------------------------------------------------------------------------------
# torch


def test_torch_packed_autograd_gradcheck_and_compile():
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("cuonline.torch")
    arrays, weight, _ = packed_case(3)
    out_np, _, g = numpy_results(arrays, weight, None)
    diff = {n: torch.from_numpy(x.copy()).requires_grad_(True) for n, x in arrays.items()
            if n in DIFFERENTIABLE}
    slopes = torch.from_numpy(arrays["alibi_slopes"])
    # boundaries as torch tensors
    options = {"causal": True, "cu_seqlens_q": torch.from_numpy(CQ),
               "cu_seqlens_k": torch.from_numpy(CK)}
    out = ct.attention(**diff, alibi_slopes=slopes, **options)
    np.testing.assert_array_equal(out.detach().numpy(), out_np)
    (out * torch.from_numpy(weight)).sum().backward()
    for n, x in diff.items():
        assert x.grad.shape == x.shape, n                        # packed like the input
        np.testing.assert_array_equal(x.grad.numpy(), getattr(g, FIELD[n]), err_msg=n)

    names = list(diff)

    def function(*xs):
        return ct.attention(**dict(zip(names, xs)), alibi_slopes=slopes, **options,
                            return_lse=True)[0]

    assert torch.autograd.gradcheck(function, tuple(x.detach().requires_grad_(True)
                                                    for x in diff.values()), eps=1e-6,
                                    atol=1e-7)

    # under torch.compile the boundaries are Python lists made outside the compiled
    # function (constants of the graph: their values shape the work)
    cq, ck = CQ.tolist(), CK.tolist()

    def loss(q, k, v):
        return ct.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                            causal=True).square().sum()

    leaves = [diff[n].detach().clone().requires_grad_(True) for n in "qkv"]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    compiled(*leaves).backward()
    eager = [diff[n].detach().clone().requires_grad_(True) for n in "qkv"]
    loss(*eager).backward()
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)

    with pytest.raises(ValueError, match=r"`kv_lengths` cannot be combined with `cu_seqlens_q`"):
        ct.attention(*leaves, kv_lengths=torch.tensor([3]), **options)
