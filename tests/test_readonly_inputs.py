"""Every public function takes read-only inputs: a read-only copy, a broadcast view (NumPy
makes those read-only) and a file mapped with ``np.memmap(mode="r")``, as a user meets them
(a memory-mapped data set, a zero-copy view of a JAX array).

Each call is compared bit for bit with the same call on writable arrays of the same layout, so
a read-only input changes nothing but the flag; the engines' accuracy is tested elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from support import needs_emulation

import cuonline

KINDS = ("readonly", "broadcast", "memmap")
ENGINES = [pytest.param("numpy", id="numpy"),
           pytest.param("emulate", id="emulate", marks=needs_emulation)]


class Inputs:
    """Turns writable arrays into read-only ones of one kind, and gives the writable twin of
    each (same values, same strides) for the comparison call."""

    def __init__(self, kind, tmp_path):
        self.kind = kind
        self.tmp_path = tmp_path
        self.count = 0

    def readonly(self, a):
        """``a`` (whose first axis has length 2) as a read-only array of this kind."""
        a = np.ascontiguousarray(a)
        if self.kind == "readonly":
            out = a.copy()
            out.flags.writeable = False
        elif self.kind == "broadcast":
            # a zero-stride first axis: both entries read one row of a
            out = np.broadcast_to(a[:1], a.shape)
        else:
            self.count += 1
            path = self.tmp_path / f"input{self.count}.dat"
            writer = np.memmap(path, dtype=a.dtype, mode="w+", shape=a.shape)
            writer[...] = a
            writer.flush()
            del writer
            out = np.memmap(path, dtype=a.dtype, mode="r", shape=a.shape)
        assert not out.flags.writeable
        return out

    @staticmethod
    def writable(a):
        """A writable array with the values and strides of ``a`` (a zero stride included: the
        engines read broadcast views as such): ``a``'s strides over a C-contiguous copy reach
        the same values, since every array of :meth:`readonly` has C-contiguous inner axes."""
        twin = np.lib.stride_tricks.as_strided(np.array(a, order="C"), a.shape, a.strides, writeable=True)
        assert twin.flags.writeable
        return twin


@pytest.fixture(params=KINDS)
def inputs(request, tmp_path):
    return Inputs(request.param, tmp_path)


def _case(seed=0, lq=5, lk=7, d=4, dv=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, lq, d)).astype(np.float32)
    k = rng.standard_normal((2, lk, d)).astype(np.float32)
    v = rng.standard_normal((2, lk, dv)).astype(np.float32)
    bias = rng.standard_normal((2, lq, lk)).astype(np.float32)
    mask = rng.random((2, lq, lk)) < 0.8
    return q, k, v, bias, mask


def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def _same_gradients(got, want):
    for name in ("dq", "dk", "dv", "dbias"):
        _same(getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("backend", ENGINES)
def test_attention(inputs, backend):
    q, k, v, bias, mask = (inputs.readonly(a) for a in _case())
    got = cuonline.attention(q, k, v, bias=bias, mask=mask, causal=True, return_lse=True,
                             backend=backend)
    want = cuonline.attention(*(inputs.writable(a) for a in (q, k, v)),
                              bias=inputs.writable(bias), mask=inputs.writable(mask),
                              causal=True, return_lse=True, backend=backend)
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.parametrize("backend", ENGINES)
def test_attention_backward(inputs, backend):
    q, k, v, bias, _ = _case(1)
    out, lse = cuonline.attention(q, k, v, bias=bias, return_lse=True, backend=backend)
    dout = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
    if inputs.kind == "broadcast":   # out and lse of broadcast inputs are broadcast too
        q, k, v, bias, dout = (np.broadcast_to(a[:1], a.shape) for a in (q, k, v, bias, dout))
        out, lse = cuonline.attention(q, k, v, bias=bias, return_lse=True, backend=backend)
    arrays = [inputs.readonly(a) for a in (dout, q, k, v, out, lse, bias)]
    got = cuonline.attention_backward(*arrays[:6], bias=arrays[6], backend=backend)
    twins = [inputs.writable(a) for a in arrays]
    want = cuonline.attention_backward(*twins[:6], bias=twins[6], backend=backend)
    _same_gradients(got, want)


@pytest.mark.parametrize("backend", ENGINES)
def test_attention_vjp(inputs, backend):
    q, k, v, bias, _ = _case(3)
    dout = np.random.default_rng(4).standard_normal((2, 5, 3)).astype(np.float32)
    arrays = [inputs.readonly(a) for a in (q, k, v, bias, dout)]
    out, vjp = cuonline.attention_vjp(*arrays[:3], bias=arrays[3], backend=backend)
    got = vjp(arrays[4])
    twins = [inputs.writable(a) for a in arrays]
    want_out, want_vjp = cuonline.attention_vjp(*twins[:3], bias=twins[3], backend=backend)
    _same(out, want_out)
    _same_gradients(got, want_vjp(twins[4]))


def test_merge(inputs):
    # merge has one engine per array library; NumPy arrays take the NumPy one
    q, k, v, _, _ = _case(5)
    states = [cuonline.attention(q, k[:, a:a + 4], v[:, a:a + 4], return_lse=True)
              for a in (0, 4)]
    readonly = [tuple(inputs.readonly(x) for x in state) for state in states]
    got = cuonline.merge(*readonly)
    want = cuonline.merge(*(tuple(inputs.writable(x) for x in state) for state in readonly))
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_family(inputs, backend, name, dtype):
    x = np.random.default_rng(6).standard_normal((2, 3, 37)).astype(dtype) * 10
    x[1, 2] = -np.inf                                   # a row with nothing visible
    fn = getattr(cuonline, name)
    readonly = inputs.readonly(x)
    _same(fn(readonly, backend=backend), fn(inputs.writable(readonly), backend=backend))


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_softmax_family_with_a_readonly_mask(inputs, name):
    x = np.random.default_rng(7).standard_normal((2, 4, 9))
    mask = np.random.default_rng(8).random((2, 4, 9)) < 0.7
    fn = getattr(cuonline, name)
    got = fn(inputs.readonly(x), mask=inputs.readonly(mask))
    want = fn(inputs.writable(inputs.readonly(x)), mask=inputs.writable(inputs.readonly(mask)))
    _same(got, want)
