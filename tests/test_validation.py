"""Every bad input raises ValueError or TypeError before any work, with a message that names
the argument, what was expected and what came."""

from __future__ import annotations

import numpy as np
import pytest

import cuonline
from cuonline._validate import validate_attention

F = np.float32


def arrays(lq=4, lk=5, d=3, dv=2, batch=(2,), dtype=F):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(batch + (lq, d)).astype(dtype),
            rng.standard_normal(batch + (lk, d)).astype(dtype),
            rng.standard_normal(batch + (lk, dv)).astype(dtype))


q, k, v = arrays()
forward = cuonline.attention(q, k, v, return_lse=True)

CASES = [
    # (description, call, exception, regex matched against the message)
    ("q 1-d", lambda: cuonline.attention(q[0, 0], k, v), ValueError,
     r"`q` must have at least 2 dimensions \(\.\.\., Lq, D\), got shape \(3,\)"),
    ("v 1-d", lambda: cuonline.attention(q, k, v[0, 0]), ValueError, r"`v` must have at least 2"),
    ("D mismatch", lambda: cuonline.attention(q, arrays(d=4)[1], v), ValueError,
     r"`k` must have the head dimension of `q` \(D = 3\), got k.shape = \(2, 5, 4\)"),
    ("Lk mismatch", lambda: cuonline.attention(q, k, arrays(lk=6)[2]), ValueError,
     r"`v` must have as many rows as `k` \(Lk = 5\), got v.shape = \(2, 6, 2\)"),
    ("batch", lambda: cuonline.attention(q, *arrays(batch=(3,))[1:]), ValueError,
     r"leading \(batch\) dimensions of `q` \(2,\), `k` \(3,\) and `v` \(3,\) do not broadcast"),
    ("int q", lambda: cuonline.attention(q.astype(np.int32), k, v), TypeError,
     r"`q` must have a real floating dtype .* got integer dtype int32"),
    ("bool k", lambda: cuonline.attention(q, k > 0, v), TypeError,
     r"`k` must have a real floating dtype .* got boolean dtype bool"),
    ("complex v", lambda: cuonline.attention(q, k, v.astype(np.complex64)), TypeError,
     r"`v` must have a real floating dtype .* got complex dtype complex64"),
    ("dtypes differ", lambda: cuonline.attention(q, k.astype(np.float64), v), TypeError,
     r"share one dtype, got float32, float64 and float32; .*astype"),
    ("bias shape", lambda: cuonline.attention(q, k, v, bias=np.zeros((3, 4, 5))), ValueError,
     r"`bias` of shape \(3, 4, 5\) does not broadcast to S \+ \(Lq, Lk\) = \(2, 4, 5\)"),
    ("bias bool", lambda: cuonline.attention(q, k, v, bias=np.ones((4, 5), bool)), TypeError,
     r"`bias` must have a real floating dtype, got bool; pass booleans as `mask=`"),
    ("mask not bool", lambda: cuonline.attention(q, k, v, mask=np.ones((4, 5))), TypeError,
     r"`mask` must be a boolean array \(True = may attend\), got dtype float64"),
    ("mask shape", lambda: cuonline.attention(q, k, v, mask=np.ones((4, 6), bool)), ValueError,
     r"`mask` of shape \(4, 6\) does not broadcast to S \+ \(Lq, Lk\) = \(2, 4, 5\)"),
    ("kv_lengths shape", lambda: cuonline.attention(q, k, v, kv_lengths=np.array([1, 2, 3])),
     ValueError, r"`kv_lengths` of shape \(3,\) does not broadcast to the batch shape S = \(2,\)"),
    ("kv_lengths negative", lambda: cuonline.attention(q, k, v, kv_lengths=np.array([1, -2])),
     ValueError, r"`kv_lengths` must be >= 0, got minimum -2"),
    ("kv_lengths float", lambda: cuonline.attention(q, k, v, kv_lengths=np.array([1.0, 2.0])),
     TypeError, r"`kv_lengths` must be an integer array, got dtype float64"),
    ("alibi shape", lambda: cuonline.attention(q, k, v, alibi_slopes=np.ones(3)), ValueError,
     r"`alibi_slopes` of shape \(3,\) does not broadcast to the batch shape S = \(2,\)"),
    ("alibi int", lambda: cuonline.attention(q, k, v, alibi_slopes=np.ones(2, int)), TypeError,
     r"`alibi_slopes` must have a real floating dtype"),
    ("window negative", lambda: cuonline.attention(q, k, v, window=(-1, 2)), ValueError,
     r"`window` left side must be >= 0, got -1"),
    ("window not pair", lambda: cuonline.attention(q, k, v, window=3), ValueError,
     r"`window` must be a pair \(left, right\) of ints or None, got 3"),
    ("window float", lambda: cuonline.attention(q, k, v, window=(1, 2.5)), TypeError,
     r"`window` right side must be an int >= 0 or None, got 2.5"),
    ("softcap_bias without softcap", lambda: cuonline.attention(q, k, v, softcap_bias=True),
     ValueError, r"`softcap_bias=True` caps the whole logit with `softcap`, but `softcap` is "
                 r"None; pass softcap=c or leave softcap_bias=False"),
    ("q_offset float", lambda: cuonline.attention(q, k, v, q_offset=2.0), TypeError,
     r"`q_offset` must be an int or None \(a position\), got float 2.0"),
    ("k_offset bool", lambda: cuonline.attention(q, k, v, k_offset=True), TypeError,
     r"`k_offset` must be an int \(a position\), got bool True"),
    ("softcap zero", lambda: cuonline.attention(q, k, v, softcap=0.0), ValueError,
     r"`softcap` must be > 0, got 0.0"),
    ("softcap inf", lambda: cuonline.attention(q, k, v, softcap=np.inf), ValueError,
     r"`softcap` must be finite, got inf"),
    ("scale nan", lambda: cuonline.attention(q, k, v, scale=np.nan), ValueError,
     r"`scale` must be finite, got nan"),
    ("scale str", lambda: cuonline.attention(q, k, v, scale="1"), TypeError,
     r"`scale` must be a real number, got str '1'"),
    ("causal not bool", lambda: cuonline.attention(q, k, v, causal="yes"), TypeError,
     r"`causal` must be True or False, got 'yes'"),
    ("backend unknown", lambda: cuonline.attention(q, k, v, backend="torch"), ValueError,
     r"`backend` must be one of 'auto', 'numpy', 'cupy', 'emulate'; got 'torch'"),
    ("backend cupy on numpy", lambda: cuonline.attention(q, k, v, backend="cupy"), TypeError,
     r"backend='cupy' takes cupy arrays, got numpy arrays"),
    ("precision unknown", lambda: cuonline.attention(q, k, v, precision="fast"), ValueError,
     r"`precision` must be one of 'highest', 'tf32'; got 'fast'"),
    ("precision tf32 float64", lambda: cuonline.attention(*arrays(dtype=np.float64),
                                                          precision="tf32"), ValueError,
     r"precision='tf32' applies to float32 inputs, got float64"),
    ("softmax axis", lambda: cuonline.softmax(q, axis=3), ValueError,
     r"`axis` 3 is out of range for `x` with 3 dimensions"),
    ("softmax int", lambda: cuonline.logsumexp(np.arange(3)), TypeError,
     r"`x` must have a real floating dtype"),
    ("softmax mask", lambda: cuonline.log_softmax(q, mask=np.ones(3)), TypeError,
     r"`mask` must be a boolean array"),
    ("merge empty", lambda: cuonline.merge(), ValueError, r"needs at least one \(out, lse\)"),
    ("merge shapes", lambda: cuonline.merge((np.zeros((4, 2)), np.zeros(3))), ValueError,
     r"state 0: `out` must have shape lse.shape \+ \(Dv,\), got out \(4, 2\) and lse \(3,\)"),
    ("merge not pair", lambda: cuonline.merge(np.zeros(3)), TypeError,
     r"state 0 must be an \(out, lse\) pair, got ndarray"),
    ("masked q", lambda: cuonline.attention(np.ma.masked_array(q), k, v), TypeError,
     r"`q` is a numpy.ma masked array, whose mask cuonline would ignore; .* `mask=`"),
    ("masked bias", lambda: cuonline.attention(q, k, v, bias=np.ma.zeros((4, 5))), TypeError,
     r"`bias` is a numpy.ma masked array"),
    ("masked softmax x", lambda: cuonline.softmax(np.ma.masked_array([1.0, 2.0])), TypeError,
     r"`x` is a numpy.ma masked array, .* ~numpy.ma.getmaskarray\(x\)"),
    ("merge int out", lambda: cuonline.merge((np.ones((4, 2), int), np.zeros(4))), TypeError,
     r"state 0: `out` must have a real floating dtype .* got integer dtype int64"),
    ("merge complex lse", lambda: cuonline.merge((np.ones((4, 2)), np.zeros(4, complex))),
     TypeError, r"state 0: `lse` must have a real floating dtype .* got complex dtype complex128"),
    ("merge dtypes differ", lambda: cuonline.merge((np.ones((4, 2)), np.zeros(4)),
                                                   (np.ones((4, 2), F), np.zeros(4))),
     TypeError, r"state 1: `out` has dtype float32 but state 0 has float64; all states must "
                r"share one `out` dtype"),
    ("merge masked", lambda: cuonline.merge((np.ma.ones((4, 2)), np.zeros(4))), TypeError,
     r"`states\[0\]\[0\]` is a numpy.ma masked array"),
    ("kv_lengths huge negative", lambda: cuonline.attention(q, k, v, kv_lengths=[2**70, -2**70]),
     ValueError, r"`kv_lengths` must be >= 0, got minimum -1180591620717411303424"),
    ("dout None", lambda: cuonline.attention_backward(None, q, k, v, *forward), TypeError,
     r"`dout` must be an array, got None"),
    ("lse None", lambda: cuonline.attention_backward(forward[0], q, k, v, forward[0], None),
     TypeError, r"`lse` must be an array, got None"),
    ("dout float64 scalar", lambda: cuonline.attention_backward(np.float64(1), q, k, v,
                                                                *forward), TypeError,
     r"`dout` must have the dtype of `q` \(float32\), got float64"),
    ("dout shape", lambda: cuonline.attention_backward(np.ones(3, F), q, k, v, *forward),
     ValueError, r"`dout` of shape \(3,\) does not broadcast to S \+ \(Lq, Dv\) = \(2, 4, 2\)"),
]


def _zeros(*shape):
    """A float32 view of ``shape`` over one element: huge shapes cost nothing."""
    return np.broadcast_to(np.float32(0), shape)


#: The CUDA kernels' size limits, raised by validation (the engine and the planner never see
#: such a call): head width, 32-bit sequence lengths, the grid of batch x query blocks.
CUDA_LIMITS = [
    ("head dim", (_zeros(4, 257), _zeros(5, 257), _zeros(5, 2)),
     r"backend='emulate' supports head dimensions up to 256, got D = 257, Dv = 2; use "
     r"backend='numpy'"),
    ("Lk >= 2**31", (_zeros(4, 3), _zeros(2**31, 3), _zeros(2**31, 2)),
     r"backend='emulate' needs Lq and Lk below 2\*\*31, got Lq = 4, Lk = 2147483648"),
    ("grid", (_zeros(2**29, 17, 1), _zeros(1, 5, 1), _zeros(1, 5, 1)),
     r"the batch shape \(536870912,\) with Lq = 17 may need 2684354560 blocks, above CUDA's "
     r"grid limit 2147483647; split the batch"),
]


@pytest.mark.parametrize("qkv,message", [c[1:] for c in CUDA_LIMITS],
                         ids=[c[0] for c in CUDA_LIMITS])
def test_cuda_size_limits_are_validation_errors(qkv, message):
    with pytest.raises(ValueError, match=message):
        validate_attention(*qkv, backend="emulate")
    # the NumPy engine has none of these limits: the same views validate there
    validate_attention(*qkv, backend="numpy")


def test_grid_bound_holds_for_every_family_at_its_edge():
    """Just below the bound validation accepts, and every family plans a grid within CUDA's
    limit (the planner's check is an internal assertion)."""
    from cuonline.kernels import families, heuristics
    from cuonline.kernels.launch import Launch

    nbatch = heuristics.MAX_GRID_X // 5            # Lq = 17: at most 5 blocks of 4 rows
    p = validate_attention(_zeros(nbatch, 17, 64), _zeros(1, 40, 64), _zeros(1, 40, 64),
                           backend="emulate")
    for family in families.forward_families():
        for arch in ("sm_75", "sm_90"):
            if family.name.endswith("mma") and arch == "sm_75":
                continue
            plan = families.plan_attention(p, Launch(family=family.name, arch=arch))
            assert plan.grid[0] <= heuristics.MAX_GRID_X


@pytest.mark.parametrize("call,exc,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def test_numpy_beside_cupy_names_both():
    cupy = pytest.importorskip("cupy")
    try:
        on_gpu = cupy.zeros((4, 3), dtype=F)
    except Exception as exc:  # noqa: BLE001 - CuPy imports without a GPU but cannot allocate
        pytest.skip(f"CuPy cannot allocate here: {type(exc).__name__}")
    with pytest.raises(TypeError, match=r"`k` is a cupy array and `q` is a numpy array"):
        cuonline.attention(q[0], on_gpu, on_gpu)


def test_numpy_beside_a_cupy_like_array_names_both(monkeypatch):
    """The library check works on any class whose module is cupy, GPU or not."""
    FakeCupyArray = type("ndarray", (), {"__module__": "cupy._core.core"})
    with pytest.raises(TypeError, match=r"`bias` is a cupy array and `q` is a numpy array"):
        cuonline.attention(q, k, v, bias=FakeCupyArray())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dout_as_a_python_number_takes_the_dtype_of_q(dtype):
    """A Python number is converted to q's dtype, as Python numbers are in every option."""
    qkv = arrays(dtype=dtype)
    out, lse = cuonline.attention(*qkv, return_lse=True)
    g = cuonline.attention_backward(1.0, *qkv, out, lse)
    expected = cuonline.attention_backward(np.ones_like(out), *qkv, out, lse)
    for field in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(g, field), getattr(expected, field))
        assert getattr(g, field).dtype == dtype
