"""cuonline.torch: torch.autograd.gradcheck in float64 for every option (lse included), the
gradients against cuonline.attention_backward, results against SDPA where SDPA has the option,
torch.compile of a function that calls it, requires_grad and bfloat16 inputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from support import fast_tier
from test_frameworks import CASES, DV, FINITE_LSE_CASES, LQ, case_arrays, dense_attention

import cuonline

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cuonline.torch")

DIFFERENTIABLE = ("q", "k", "v", "bias", "rel_bias", "rel_q", "rel_k")
FIELD = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "rel_bias": "drel_bias",
         "rel_q": "drel_q", "rel_k": "drel_k"}


#: the operations dense_attention needs, in torch
TORCH_OPS = SimpleNamespace(einsum=torch.einsum, tanh=torch.tanh, where=torch.where,
                            exp=torch.exp, asarray=torch.as_tensor,
                            logsumexp=lambda x: torch.logsumexp(x, dim=-1))


def tensors(arrays):
    """(differentiable leaves, constants) of a case as torch tensors."""
    diff = {n: torch.from_numpy(x.copy()).requires_grad_(True) for n, x in arrays.items()
            if n in DIFFERENTIABLE}
    const = {n: torch.from_numpy(x) for n, x in arrays.items() if n not in DIFFERENTIABLE}
    return diff, const


# fast tier: rel_qk, the case with the most differentiable inputs; every case's gradients are
# test_autograd_matches_autograd_of_a_dense_reference's
@pytest.mark.parametrize("name", fast_tier(CASES, ("rel_qk",)))
def test_gradcheck_every_option(name):
    arrays, statics = case_arrays(name)
    diff, const = tensors(arrays)
    names = list(diff)
    with_lse = name in FINITE_LSE_CASES

    def function(*xs):
        return ct.attention(**dict(zip(names, xs)), **const, **statics, return_lse=with_lse)

    assert torch.autograd.gradcheck(function, tuple(diff.values()), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", CASES)
def test_autograd_matches_autograd_of_a_dense_reference(name):
    """torch.autograd through cuonline.torch.attention against torch.autograd through
    dense_attention written in torch (float64), for every differentiable input of the case,
    through lse too where it is finite."""
    arrays, statics = case_arrays(name)
    with_lse = name in FINITE_LSE_CASES
    rng = np.random.default_rng(18)
    weight = torch.from_numpy(rng.standard_normal((2, 3, LQ, DV)))
    lse_weight = torch.from_numpy(rng.standard_normal((2, 3, LQ)))
    ours_in, const = tensors(arrays)
    dense_in, _ = tensors(arrays)
    out, lse = ct.attention(**ours_in, **const, **statics, return_lse=True)
    want, want_lse = dense_attention(TORCH_OPS, **dense_in, **const, **statics)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
    ours_loss = (out * weight).sum() + ((lse * lse_weight).sum() if with_lse else 0.0)
    dense_loss = (want * weight).sum() + ((want_lse * lse_weight).sum() if with_lse else 0.0)
    got = torch.autograd.grad(ours_loss, tuple(ours_in.values()))
    expected = torch.autograd.grad(dense_loss, tuple(dense_in.values()))
    for n, a, b in zip(ours_in, got, expected):
        assert a.shape == ours_in[n].shape, n
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", CASES)
def test_gradients_are_attention_backward(name):
    arrays, statics = case_arrays(name)
    diff, const = tensors(arrays)
    weight = np.random.default_rng(5).standard_normal((2, 3, 5, 3))
    out = ct.attention(**diff, **const, **statics)
    (out * torch.from_numpy(weight)).sum().backward()
    want_out, lse = cuonline.attention(**arrays, **statics, return_lse=True)
    np.testing.assert_array_equal(out.detach().numpy(), want_out)
    g = cuonline.attention_backward(weight, **arrays, out=want_out, lse=lse, **statics)
    for n, x in diff.items():
        assert x.grad.shape == x.shape, n
        np.testing.assert_array_equal(x.grad.numpy(), getattr(g, FIELD[n]), err_msg=n)


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"scale": 0.3}, {"mask": True},
                                     {"bias": True}], ids=["plain", "causal", "scale", "mask",
                                                           "bias"])
def test_against_sdpa_where_it_has_the_option(options):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 33, 16, dtype=torch.float64, generator=gen,
                           requires_grad=True) for _ in range(3))
    ours, theirs = dict(options), dict(options)
    if options.get("mask"):
        mask = torch.rand(33, 33, generator=gen) < 0.8
        mask[:, 0] = True                  # SDPA gives NaN for a row that sees no key
        ours["mask"], theirs["attn_mask"] = mask, mask
        del theirs["mask"]
    if options.get("bias"):
        bias = torch.randn(3, 33, 33, dtype=torch.float64, generator=gen)
        ours["bias"], theirs["attn_mask"] = bias, bias
        del theirs["bias"]
    # with Lq == Lk, cuonline's causal diagonal (bottom right) is SDPA's (top left)
    theirs = {("is_causal" if n == "causal" else n): x for n, x in theirs.items()}
    out = ct.attention(q, k, v, **ours)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = sdpa(q, k, v, **theirs)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-11)


def test_torch_compile_keeps_the_operator_in_one_graph():
    arrays, statics = case_arrays("rel_bias")
    diff, _ = tensors(arrays)

    def loss(q, k, v, rel_bias):
        return ct.attention(q, k, v, rel_bias=rel_bias, **statics).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    value = compiled(*diff.values())
    value.backward()
    eager = {n: x.detach().clone().requires_grad_(True) for n, x in diff.items()}
    loss(*eager.values()).backward()
    for n in diff:
        torch.testing.assert_close(diff[n].grad, eager[n].grad, rtol=0, atol=0)


def test_requires_grad_bfloat16_and_errors():
    x = torch.randn(2, 9, 8).to(torch.bfloat16).requires_grad_(True)
    out = ct.attention(x, x, x)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    with pytest.raises(ValueError, match=r"`k` must have the head dimension of `q`"):
        ct.attention(x, x[..., :4], x)
    with pytest.raises(TypeError, match=r"`bias` is a numpy array and `q` is a torch array"):
        ct.attention(x, x, x, bias=np.zeros((9, 9)))
    with pytest.raises(TypeError, match=r"`q` must be a torch.Tensor, got ndarray"):
        ct.attention(np.zeros((9, 8)), x, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and CuPy")
@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_tensors_on_the_current_stream():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 300, 64, generator=gen) for _ in range(3))
    want = cuonline.attention(q.numpy(), k.numpy(), v.numpy())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        qc, kc, vc = (x.cuda().requires_grad_(True) for x in (q, k, v))
        torch.cuda._sleep(10_000_000)          # work queued before the call
        out = ct.attention(qc, kc, vc)
        out.sum().backward()
    stream.synchronize()
    assert out.device == qc.device
    np.testing.assert_allclose(out.detach().cpu().numpy(), want, atol=2e-5)


def test_layout_blhd_reads_flash_attention_arrays_through_their_strides():
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 33, 4, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 40, 1, 16, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in range(2))
    bias = torch.randn(2, 4, 33, 40, dtype=torch.float64, generator=gen)
    out, lse = ct.attention(q, k, v, bias=bias, causal=True, return_lse=True, layout="blhd")
    assert out.shape == (2, 33, 4, 16) and lse.shape == (2, 4, 33)
    grads = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    heads_first = [x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v)]
    want, want_lse = ct.attention(*heads_first, bias=bias, causal=True, return_lse=True)
    want_grads = torch.autograd.grad(want.square().sum() + want_lse.sum(), heads_first)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected.transpose(1, 2), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"layout='blhd' takes `k` of shape \(batch, length, "
                                         r"heads, dim\), got shape \(40, 16\)"):
        ct.attention(q, k[0, :, 0], v, layout="blhd")
    with pytest.raises(ValueError, match=r"`layout` must be one of 'bhld', 'blhd'; got 'bshd'"):
        ct.attention(q, k, v, layout="bshd")
