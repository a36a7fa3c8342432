"""Every array library in, the same library out: NumPy, torch and JAX arrays through the public
functions, read in place (no input copied), results in the caller's library; mixed libraries
refused with the arguments named. Also the option cases the framework tests share
(tests/test_frameworks_jax.py, tests/test_frameworks_torch.py) and ``dense_attention``, the
dense reference they differentiate with each framework's own autodiff.

A library is added to the parametrisations only where it imports (SciPy's backend fixture).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
from support import ROOT, peak_traced_bytes

import cuonline
from cuonline import _arrays

LIBRARIES = ["numpy"] + [name for name in ("torch", "jax")
                         if importlib.util.find_spec(name) is not None]

# --------------------------------------------------------------------------------------------
# the option cases: q (2, 3, Lq, D) against k, v (2, 1, Lk, .) (three query heads share one key
# head), float64, one row that sees no key in the masked case

LQ, LK, D, DV = 5, 7, 4, 3


def case_arrays(name: str, seed: int = 0) -> tuple[dict, dict]:
    """``(arrays, statics)`` of option case ``name``: NumPy float64 arrays (q, k, v and the
    array options) and the options that are Python values."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal
    arrays = {"q": normal((2, 3, LQ, D)), "k": normal((2, 1, LK, D)), "v": normal((2, 1, LK, DV))}
    statics: dict = {}
    if name == "scale_causal":
        statics = {"scale": 0.7, "causal": True}
    elif name == "window_offsets":
        statics = {"window": (2, 1), "q_offset": 3, "k_offset": 1}
    elif name == "bias":
        arrays["bias"] = normal((3, LQ, LK))              # per head, shared by the batch
    elif name == "mask_lengths":
        mask = rng.random((LQ, LK)) < 0.7
        mask[1] = False                                   # a query that sees no key
        arrays["mask"] = mask
        arrays["kv_lengths"] = np.array([[5], [7]])       # (2, 1): per batch element
    elif name == "alibi_softcap":
        arrays["alibi_slopes"] = np.array([0.5, 0.25, 0.125])
        statics = {"softcap": 2.0}
    elif name == "softcap_bias":
        arrays["bias"] = normal((LQ, LK))
        statics = {"softcap": 1.5, "softcap_bias": True}
    elif name == "bias_block":
        arrays["bias"] = normal((2, 1, 3, 4))             # ceil(5 / 2) x ceil(7 / 2) blocks
        statics = {"bias_block": (2, 2)}
    elif name == "rel_bias":
        arrays["rel_bias"] = normal((3, 9))               # distances -4 .. 4, per head
        statics = {"causal": True}
    elif name == "rel_qk":
        arrays["rel_q"] = normal((2, 3, LQ, 2))
        arrays["rel_k"] = normal((9, 2))
    elif name != "plain":
        raise ValueError(name)
    return arrays, statics


CASES = ["plain", "scale_causal", "window_offsets", "bias", "mask_lengths", "alibi_softcap",
         "softcap_bias", "bias_block", "rel_bias", "rel_qk"]
#: cases whose every query sees a key, so lse is finite (its gradient is tested there)
FINITE_LSE_CASES = ["plain", "bias", "softcap_bias", "bias_block", "rel_qk"]


# --------------------------------------------------------------------------------------------
# a dense attention written in the framework itself, differentiated by the framework


def dense_attention(ops, q, k, v, *, scale=None, causal=False, window=None, bias=None,
                    mask=None, kv_lengths=None, alibi_slopes=None, softcap=None,
                    softcap_bias=False, q_offset=None, k_offset=0, bias_block=None,
                    rel_bias=None, rel_q=None, rel_k=None):
    """``(out, lse)`` of softmax attention over the whole ``Lq x Lk`` logits, built term by
    term from docs/semantics.md in the framework's own operations (``ops``: ``jax.numpy``
    or torch, with ``ops.logsumexp(x)`` over the last axis and ``ops.asarray`` of NumPy),
    so that ``jax.grad`` or ``torch.autograd`` differentiates it. Which keys a query sees
    (positions, mask, lengths) is a NumPy constant; a row that sees none gives 0, -inf."""
    lq, d = q.shape[-2:]
    lk = k.shape[-2]
    batch = np.broadcast_shapes(tuple(q.shape[:-2]), tuple(k.shape[:-2]), tuple(v.shape[:-2]))
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    q_offset = lk - lq if q_offset is None else q_offset
    delta = np.arange(lk)[None, :] + k_offset - np.arange(lq)[:, None] - q_offset

    def entry(n):                      # a table of n = 2 R + 1 distances, clamped at its ends
        radius = (n - 1) // 2
        return ops.asarray(radius + np.clip(delta, -radius, radius))

    s = scale * ops.einsum("...id,...jd->...ij", q, k)
    if rel_q is not None:
        s = s + ops.einsum("...id,...ijd->...ij", rel_q, rel_k[..., entry(rel_k.shape[-2]), :])
    if softcap is not None and not softcap_bias:
        s = softcap * ops.tanh(s / softcap)
    if bias is not None:
        if bias_block is not None:
            r, c = bias_block
            rows, cols = ops.asarray(np.arange(lq) // r), ops.asarray(np.arange(lk) // c)
            bias = bias[..., rows, :][..., cols]
        s = s + bias
    if rel_bias is not None:
        s = s + rel_bias[..., entry(rel_bias.shape[-1])]
    if alibi_slopes is not None:
        s = s - alibi_slopes[..., None, None] * ops.asarray(np.abs(delta).astype(np.float64))
    if softcap is not None and softcap_bias:
        s = softcap * ops.tanh(s / softcap)
    visible = np.ones(batch + (lq, lk), dtype=bool)
    if causal:
        visible &= delta <= 0
    if window is not None:
        visible &= (delta >= -(window[0] if window[0] is not None else np.inf)) & (
            delta <= (window[1] if window[1] is not None else np.inf))
    if mask is not None:
        visible &= np.asarray(mask)
    if kv_lengths is not None:
        visible &= np.arange(lk) < np.broadcast_to(np.asarray(kv_lengths), batch)[..., None, None]
    seen = visible.any(axis=-1)
    # hidden keys at -1e300 (not -inf: a row that sees nothing stays finite, and its
    # gradient is cut by the last where, not poisoned by inf - inf)
    s = ops.where(ops.asarray(visible), s, -1e300)
    lse = ops.logsumexp(s)
    out = ops.einsum("...ij,...jd->...id", ops.exp(s - lse[..., None]), v)
    return (ops.where(ops.asarray(seen[..., None]), out, 0.0),
            ops.where(ops.asarray(seen), lse, -np.inf))


# --------------------------------------------------------------------------------------------
# converting between libraries in the tests


def to_library(lib: str, x):
    if lib == "numpy" or not isinstance(x, np.ndarray):
        return x
    if lib == "torch":
        import torch

        return torch.from_numpy(x)
    import jax.numpy as jnp

    return jnp.asarray(x)


def to_numpy(x):
    if hasattr(x, "detach"):
        return x.detach().numpy()
    return np.asarray(x)


def library_of(x) -> str:
    return {"ndarray": "numpy", "Tensor": "torch"}.get(type(x).__name__, "jax")


@pytest.fixture(autouse=True, scope="module")
def _x64():
    if "jax" not in LIBRARIES:
        yield
        return
    import jax

    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


# --------------------------------------------------------------------------------------------
# same library out


@pytest.mark.parametrize("lib", LIBRARIES)
@pytest.mark.parametrize("name", ["bias", "rel_qk", "mask_lengths"])
def test_attention_and_backward_answer_in_the_callers_library(lib, name):
    arrays, statics = case_arrays(name)
    out, lse = cuonline.attention(**arrays, **statics, return_lse=True)
    g = cuonline.attention_backward(np.ones_like(out), **arrays, out=out, lse=lse, **statics)
    mine = {n: to_library(lib, x) for n, x in arrays.items()}
    out2, lse2 = cuonline.attention(**mine, **statics, return_lse=True)
    g2 = cuonline.attention_backward(to_library(lib, np.ones_like(out)), **mine, out=out2,
                                     lse=lse2, **statics)
    assert library_of(out2) == library_of(lse2) == lib
    np.testing.assert_array_equal(to_numpy(out2), out)
    np.testing.assert_array_equal(to_numpy(lse2), lse)
    for field in ("dq", "dk", "dv", "dbias", "drel_bias", "drel_q", "drel_k"):
        a, b = getattr(g, field), getattr(g2, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert library_of(b) == lib, field
            np.testing.assert_array_equal(to_numpy(b), a)


@pytest.mark.parametrize("lib", LIBRARIES)
def test_merge_softmax_family_and_vjp_answer_in_the_callers_library(lib):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 6))
    mask = rng.random((3, 6)) < 0.8
    for function in (cuonline.softmax, cuonline.log_softmax, cuonline.logsumexp):
        got = function(to_library(lib, x), mask=to_library(lib, mask))
        assert library_of(got) == lib, function.__name__
        np.testing.assert_array_equal(to_numpy(got), function(x, mask=mask))
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    a = cuonline.attention(q, k[:, :2], v[:, :2], return_lse=True)
    b = cuonline.attention(q, k[:, 2:], v[:, 2:], return_lse=True)
    merged = cuonline.merge(*((to_library(lib, o), to_library(lib, s)) for o, s in (a, b)))
    assert [library_of(m) for m in merged] == [lib, lib]
    for got, want in zip(merged, cuonline.merge(a, b)):
        np.testing.assert_array_equal(to_numpy(got), want)
    out, vjp = cuonline.attention_vjp(*(to_library(lib, x) for x in (q, k, v)))
    g = vjp(to_library(lib, np.ones((2, 5, 4))))
    assert library_of(out) == library_of(g.dq) == lib


# --------------------------------------------------------------------------------------------
# no input copied


@pytest.mark.parametrize("lib", [lib for lib in LIBRARIES if lib != "numpy"])
def test_foreign_arrays_are_read_in_place(lib):
    rng = np.random.default_rng(2)
    base = rng.standard_normal((4, 6, 8))
    x = to_library(lib, base)
    if lib == "torch":
        import torch

        x = x[:, ::2].requires_grad_(True)        # strided, and a leaf that requires grad
        pointer = x.data_ptr()
    else:
        pointer = x.unsafe_buffer_pointer()
    views, origin = _arrays.adapt({"q": x, "bias": None, "scale": 0.5})
    assert views["bias"] is None and views["scale"] == 0.5
    assert isinstance(views["q"], np.ndarray) and views["q"].ctypes.data == pointer
    assert views["q"].shape == tuple(x.shape)
    assert (origin.library, origin.device, origin.stream) == (lib, "cpu", None)


def test_torch_bfloat16_is_read_in_place_and_comes_back_as_bfloat16():
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    x = torch.randn(2, 9, 8).to(torch.bfloat16)
    views, _ = _arrays.adapt({"q": x})
    assert views["q"].dtype.name == "bfloat16" and views["q"].ctypes.data == x.data_ptr()
    out = cuonline.attention(x, x, x.requires_grad_(True))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 9, 8)
    want = cuonline.attention(*(views["q"],) * 3)
    np.testing.assert_array_equal(out.view(torch.int16).numpy(), want.view(np.int16))


@pytest.mark.parametrize("lib", [lib for lib in LIBRARIES if lib != "numpy"])
def test_foreign_calls_allocate_what_numpy_calls_allocate(lib):
    """tracemalloc sees NumPy's allocations: a copy of an input into NumPy would show as 8 MB
    more at the peak than the same call on NumPy arrays."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2048, 512))
    k, v = q[:, :64], q[:, :64, :8]
    mine = [to_library(lib, np.ascontiguousarray(x)) for x in (q, k, v)]
    arrays = [np.ascontiguousarray(x) for x in (q, k, v)]
    warm = [lambda: cuonline.attention(*arrays, workers=1)]
    numpy_peak, _ = peak_traced_bytes(lambda: cuonline.attention(*arrays, workers=1), warm)
    foreign_peak, _ = peak_traced_bytes(lambda: cuonline.attention(*mine, workers=1), warm)
    assert foreign_peak < numpy_peak + q.nbytes // 4, (foreign_peak, numpy_peak)


# --------------------------------------------------------------------------------------------
# mixed libraries


@pytest.mark.parametrize("lib", [lib for lib in LIBRARIES if lib != "numpy"])
def test_mixed_libraries_name_the_arguments_and_their_libraries(lib):
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 7, 4))
    bias = rng.standard_normal((5, 7))
    cases = [
        (lambda: cuonline.attention(to_library(lib, q), to_library(lib, k), to_library(lib, k),
                                    bias=bias), "`q`", "`bias`"),
        (lambda: cuonline.merge((to_library(lib, q), to_library(lib, q[..., 0])),
                                (q, q[..., 0])), "`states[0][0]`", "`states[1][0]`"),
        (lambda: cuonline.softmax(to_library(lib, bias), mask=bias > 0), "`x`", "`mask`"),
        (lambda: cuonline.attention_backward(q, to_library(lib, q), to_library(lib, k),
                                             to_library(lib, k), q, q[..., 0]), "`q`", "`dout`"),
    ]
    for call, foreign, numpy_arg in cases:
        with pytest.raises(TypeError, match="arrays from different libraries") as info:
            call()
        assert f"{foreign} is a {lib} array" in str(info.value)
        assert f"{numpy_arg} is a numpy array" in str(info.value)


def test_torch_beside_jax_names_both():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    q = np.ones((3, 4))
    with pytest.raises(TypeError, match=r"`k` is a jax array and `q` is a torch array"):
        cuonline.attention(torch.from_numpy(q), jnp.asarray(q), jnp.asarray(q))


def test_a_jax_tracer_is_sent_to_cuonline_jax():
    jax = pytest.importorskip("jax")
    with pytest.raises(TypeError, match=r"being traced .* cuonline\.jax\.attention"):
        jax.jit(lambda q: cuonline.attention(q, q, q))(np.ones((3, 4)))


# --------------------------------------------------------------------------------------------
# import cuonline imports no framework


def test_import_cuonline_imports_neither_jax_nor_torch():
    code = ("import sys, numpy, cuonline; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', "
            "'torch', 'cupy', 'dask')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# the GPU check of benchmarks/gpu_check.sh, run on the host (it needs a GPU to check the GPU)


@pytest.mark.slow                  # a benchmark script: left out of the fast tier
@pytest.mark.skipif(LIBRARIES != ["numpy", "torch", "jax"], reason="needs torch and JAX")
def test_gpu_framework_check_runs_on_the_host(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_frameworks.py"), "--cpu-dry-run",
         "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "gpu_frameworks.txt").read_text(encoding="utf-8").splitlines()
    assert len([line for line in report if line.startswith("ok ")]) == 48, report


# --------------------------------------------------------------------------------------------
# the bindings take every option of cuonline.attention


@pytest.mark.parametrize("module", [f"cuonline.{lib}" for lib in LIBRARIES if lib != "numpy"])
def test_bindings_take_the_options_of_attention_and_document_them(module):
    binding = importlib.import_module(module).attention
    ours = inspect.signature(binding).parameters
    theirs = inspect.signature(cuonline.attention).parameters
    # every parameter of cuonline.attention, then the bindings' own: layout
    assert [(n, p.kind, p.default) for n, p in ours.items()] == \
        [(n, p.kind, p.default) for n, p in theirs.items()] + [
            ("layout", inspect.Parameter.KEYWORD_ONLY, "bhld")]
    keywords = [n for n, p in theirs.items() if p.kind is p.KEYWORD_ONLY]
    assert f"    {', '.join(keywords)}\n" in binding.__doc__


@pytest.mark.slow
@pytest.mark.skipif(LIBRARIES != ["numpy", "torch", "jax"], reason="needs torch and JAX")
def test_framework_benchmark_prints_its_tables():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_frameworks.py"), "--sizes", "128",
         "--repeat", "1"], capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 128 |")]
    # three tables (forward, forward + backward, torch), every time and memory cell a number
    assert len(rows) == 3, rows
    for row in rows:
        [float(cell.strip().rstrip("%")) for cell in row.strip("|").split("|")]   # not "-"
    assert all(float(cell) > 0 for cell in rows[2].split("|")[2:4]), rows
