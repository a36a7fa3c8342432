"""The CPU engines' matrix products (``cuonline.engines.cpu_blas``): every library this
machine has gives the products NumPy gives, for every layout the engines pass; the engines
are accurate and thread-count independent on each; the measured choice is stored and reused;
``CUONLINE_CPU_BLAS`` is checked.

MKL's cases run where the ``mkl`` package is installed (``pip install cuonline[mkl]``; CI
installs it), OpenBLAS's where NumPy is built on it (the PyPI wheels).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import (GRADIENT_CASES, check_attention, check_gradients, gradient_case,
                     make_case)

import cuonline
from cuonline.engines import cpu_blas

@pytest.fixture
def fresh_choice(monkeypatch, tmp_path):
    """An empty cache directory and no choice made yet in this process."""
    monkeypatch.setenv("CUONLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUONLINE_CPU_BLAS", raising=False)
    cpu_blas.reset()
    yield tmp_path / "cpu" / "blas.json"
    cpu_blas.reset()


def _exact(a, b):
    return a.astype(np.float64) @ b.astype(np.float64)


def _operands(rng, dtype, m=37, k=19, n=23):
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    return a, b


LAYOUTS = {
    "row-major": lambda a, b: (a, b),
    "column-major": lambda a, b: (np.asfortranarray(a), np.asfortranarray(b)),
    "transposed views": lambda a, b: (np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T),
    # strides in both dimensions: not CBLAS's to take, NumPy's (after its own copy)
    "strided both ways": lambda a, b: (np.repeat(np.repeat(a, 2, 0), 2, 1)[::2, ::2],
                                       np.repeat(np.repeat(b, 2, 0), 2, 1)[::2, ::2]),
    "row slices of wider arrays": lambda a, b: (np.pad(a, ((0, 0), (3, 5)))[:, 3:-5],
                                                np.pad(b, ((0, 0), (2, 1)))[:, 2:-1]),
    "column slices of taller column-major arrays": lambda a, b: (
        np.asfortranarray(np.pad(a, ((3, 5), (0, 0))))[3:-5],
        np.asfortranarray(np.pad(b, ((2, 1), (0, 0))))[2:-1]),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_products_match_the_exact_product_in_every_layout(library, rng, dtype, layout):
    a, b = LAYOUTS[layout](*_operands(rng, dtype))
    exact = _exact(a, b)
    tolerance = 8 * a.shape[1] * np.finfo(dtype).eps * (np.abs(a) @ np.abs(b)).max()
    got = cpu_blas.product(a, b)
    assert got.dtype == dtype and got.shape == exact.shape
    np.testing.assert_allclose(got, exact, rtol=0, atol=tolerance)
    # into a slice of a larger output, and added to what is there: nothing outside it moves
    big = np.full((a.shape[0] + 4, b.shape[1] + 6), 2.0, dtype=dtype)
    assert cpu_blas.product(a, b, big[2:-2, 3:-3], add=True) is not None
    np.testing.assert_allclose(big[2:-2, 3:-3], exact + 2, rtol=0, atol=tolerance + 4 * 2 *
                               np.finfo(dtype).eps)
    inner = np.ones(big.shape, dtype=bool)
    inner[2:-2, 3:-3] = False
    assert (big[inner] == 2).all()


def test_special_cases_take_numpys_path_and_stay_right(library, rng):
    a, b = _operands(rng, np.float32)
    # mixed dtypes: NumPy's promotion
    got = cpu_blas.product(a, b.astype(np.float64))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, _exact(a, b), rtol=1e-5, atol=1e-5)
    # empty dimensions
    assert cpu_blas.product(a[:0], b).shape == (0, b.shape[1])
    np.testing.assert_array_equal(cpu_blas.product(a[:, :0], b[:0]), np.zeros((37, 23)))
    # an output that is a column-major array, and one that overlaps an operand
    out = np.empty((37, 23), dtype=np.float32, order="F")
    np.testing.assert_allclose(cpu_blas.product(a, b, out), _exact(a, b), rtol=1e-5,
                               atol=1e-5)
    square = rng.standard_normal((16, 16)).astype(np.float32)
    expected = _exact(square, square) + square
    np.testing.assert_allclose(cpu_blas.product(square, square.copy(), square, add=True),
                               expected, rtol=1e-5, atol=1e-5)
    # a stack of products, one operand broadcast
    stack = rng.standard_normal((3, 37, 19)).astype(np.float32)
    got = cpu_blas.product(stack, b)
    np.testing.assert_allclose(got, stack.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stacks_of_products_match_the_exact_products(library, rng, dtype):
    a = rng.standard_normal((6, 37, 19)).astype(dtype)
    keys = rng.standard_normal((6, 23, 19)).astype(dtype)
    tolerance = 8 * 19 * np.finfo(dtype).eps * 50
    for lhs, rhs in [(a, keys.transpose(0, 2, 1)),                   # kᵀ views, as the engine
                     (a[::2], np.ascontiguousarray(keys.transpose(0, 2, 1))[1::2]),
                     (np.asfortranarray(a), keys.transpose(0, 2, 1)[:, :, 3:20])]:
        exact = np.einsum("gmk,gkn->gmn", lhs.astype(np.float64), rhs.astype(np.float64))
        got = cpu_blas.product(lhs, rhs)
        assert got.shape == exact.shape and got.dtype == dtype
        np.testing.assert_allclose(got, exact, rtol=0, atol=tolerance)
        out = np.ones(exact.shape, dtype=dtype)
        cpu_blas.product(lhs, rhs, out, add=True)
        np.testing.assert_allclose(out, exact + 1, rtol=0, atol=tolerance)


def _placed(x, offset):
    """A copy of ``x`` whose data starts ``offset`` elements past a 64-byte boundary."""
    per_line = 64 // x.itemsize
    buffer = np.empty(x.size + 2 * per_line, dtype=x.dtype)
    start = (-(buffer.ctypes.data // x.itemsize)) % per_line + offset
    placed = buffer[start:start + x.size].reshape(x.shape)
    placed[...] = x
    return placed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(512, 1024, 64, "kT"), (512, 64, 1024, "v"),
                                   (333, 77, 129, "kT"), (7, 64, 513, "v")])
def test_a_products_bits_do_not_follow_the_alignment_of_its_operands(library, rng, dtype,
                                                                     shape):
    # The engines' tasks multiply views of the user's arrays and buffers of their own, wherever
    # they lie in memory: results the same for every ``workers`` need products whose rounding
    # does not follow an operand's address (MKL: its reproducibility mode). The tiles' shapes,
    # q kᵀ (transposed keys) and P v (added into the output), and odd ones.
    m, n, k, kind = shape
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if kind == "kT" else (k, n)).astype(dtype)
    c = rng.standard_normal((m, n)).astype(dtype)
    first = None
    for offsets in [(0, 0, 0), (1, 0, 0), (0, 3, 0), (0, 0, 5), (3, 1, 7), (2, 5, 1)]:
        lhs, rhs, out = (_placed(x, o) for x, o in zip((a, b, c), offsets))
        cpu_blas.product(lhs, rhs.T if kind == "kT" else rhs, out, add=True)
        if first is None:
            first = out
        else:
            np.testing.assert_array_equal(out, first, err_msg=f"offsets {offsets}")


def test_non_finite_operands_propagate_as_in_numpy(library):
    a = np.ones((4, 3), dtype=np.float32)
    b = np.ones((3, 5), dtype=np.float32)
    b[1, 2] = np.nan
    b[0, 4] = np.inf
    got = cpu_blas.product(a, b)
    assert np.isnan(got[:, 2]).all() and np.isposinf(got[:, 4]).all()
    assert np.isfinite(got[:, :2]).all()
    # a NaN already in the output stays there when the product is added to it
    out = np.zeros((4, 5), dtype=np.float32)
    out[0, 0] = np.nan
    cpu_blas.product(a, np.ones((3, 5), dtype=np.float32), out, add=True)
    assert np.isnan(out[0, 0]) and (out.ravel()[1:] == 3).all()


def test_sizes_beyond_the_librarys_integers_take_numpys_path(library, monkeypatch, rng):
    blas = cpu_blas.chosen()
    if blas is None:
        pytest.skip("NumPy's matmul: no integer width of its own")
    monkeypatch.setattr(blas, "_int_max", 30)          # as if 37 rows overflowed its ints
    a, b = _operands(rng, np.float64)
    np.testing.assert_allclose(cpu_blas.product(a, b), _exact(a, b), rtol=1e-12, atol=1e-12)
    assert blas.gemm(a, b, np.empty((37, 23)), False) is False


def test_add_without_an_output_is_refused(library, rng):
    with pytest.raises(ValueError, match="out="):
        cpu_blas.product(*_operands(rng, np.float32), add=True)


# --------------------------------------------------------------------------------------------
# the engines on each library


@pytest.mark.parametrize("options", [(), ("causal",), ("window", "bias", "kv_lengths"),
                                     ("mask", "return_lse")])
def test_the_engine_is_accurate_on_every_library(library, options):
    # 600 queries and 1100 keys: several query blocks, key tiles and a tail of each
    q, k, v, opts = make_case(5, batch=(2,), lq=600, lk=1100, d=40, dv=24, options=options)
    result = cuonline.attention(q, k, v, **opts)
    out, lse = result if opts.get("return_lse") else (result, None)
    check_attention(q, k, v, out, lse, opts)


@pytest.mark.parametrize("case", ["gqa-causal", "every-term"])
def test_gradients_are_accurate_on_every_library(library, case):
    rng, q, k, v = gradient_case(np.float64)
    options = GRADIENT_CASES[case](rng)
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    grads = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
    check_gradients(grads, dout, q, k, v, options)


def test_results_do_not_depend_on_the_thread_count_on_any_library(library):
    q, k, v, opts = make_case(9, batch=(3,), lq=700, lk=1500, d=32, dv=32,
                              options=("causal",))
    first = cuonline.attention(q, k, v, workers=1, **opts)
    for workers in (2, 3):
        np.testing.assert_array_equal(cuonline.attention(q, k, v, workers=workers, **opts),
                                      first)


def test_non_finite_values_reach_only_the_rows_that_see_them(library):
    q, k, v, _ = make_case(3, batch=(1,), lq=40, lk=60, d=8, dv=8)
    v[0, 50] = np.nan                               # key 50: seen only by rows >= 50 - 20
    out = cuonline.attention(q, k, v, causal=True)
    assert np.isfinite(out[0, :30]).all() and np.isnan(out[0, 30:]).all()


# --------------------------------------------------------------------------------------------
# the choice


def test_the_measured_choice_is_stored_and_reused(fresh_choice, monkeypatch):
    if cpu_blas.available("openblas") is None or cpu_blas.available("mkl") is None:
        pytest.skip("one library only: nothing to choose between")
    timed = []
    monkeypatch.setattr(cpu_blas, "_seconds",
                        lambda blas: timed.append(blas.name) or {"mkl": 1.0, "openblas": 2.0}[
                            blas.name])
    assert cpu_blas.chosen().name == "mkl"
    assert sorted(timed) == ["mkl", "openblas"]
    stored = json.loads(fresh_choice.read_text())
    assert stored["choice"] == "mkl" and stored["seconds"] == {"mkl": 1.0, "openblas": 2.0}
    # a later process (here: after a reset) reads the choice and times nothing
    cpu_blas.reset()
    timed.clear()
    assert cpu_blas.chosen().name == "mkl" and timed == []
    # another machine's file, or a damaged one, is measured again and replaced
    for content in ({**stored, "cpu": "another CPU", "choice": "openblas"}, "{not json"):
        fresh_choice.write_text(content if isinstance(content, str) else json.dumps(content))
        cpu_blas.reset()
        assert cpu_blas.chosen().name == "mkl" and sorted(timed) == ["mkl", "openblas"]
        timed.clear()


def test_threads_asking_at_once_wait_for_one_measurement(fresh_choice, monkeypatch):
    if cpu_blas.available("openblas") is None or cpu_blas.available("mkl") is None:
        pytest.skip("one library only: nothing to choose between")
    timed = []

    def slow(blas):
        timed.append(blas.name)
        time.sleep(0.05)                    # long enough for the other threads to arrive
        return {"mkl": 1.0, "openblas": 2.0}[blas.name]

    monkeypatch.setattr(cpu_blas, "_seconds", slow)
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(lambda _: cpu_blas.chosen(), range(8)))
    assert {c.name for c in choices} == {"mkl"}
    assert sorted(timed) == ["mkl", "openblas"]          # one measurement, not one per thread


def test_mkl_must_be_clearly_faster_to_be_chosen(fresh_choice, monkeypatch):
    if cpu_blas.available("openblas") is None or cpu_blas.available("mkl") is None:
        pytest.skip("one library only: nothing to choose between")
    monkeypatch.setattr(cpu_blas, "_seconds", lambda blas: {"mkl": 0.98, "openblas": 1.0}[
        blas.name])
    assert cpu_blas.chosen().name == "openblas"


def test_an_unwritable_cache_keeps_the_choice_with_a_warning(fresh_choice, monkeypatch):
    if cpu_blas.available("openblas") is None or cpu_blas.available("mkl") is None:
        pytest.skip("one library only: nothing to choose between")
    monkeypatch.setattr(cpu_blas, "_seconds", lambda blas: {"mkl": 1.0, "openblas": 2.0}[
        blas.name])
    fresh_choice.parent.parent.mkdir(parents=True, exist_ok=True)
    fresh_choice.parent.write_text("a file where the folder should be")
    with pytest.warns(RuntimeWarning, match="could not store the CPU BLAS choice"):
        assert cpu_blas.chosen().name == "mkl"


@pytest.mark.parametrize("value", ["MKL", "blis", " mkl", "1"])
def test_a_bad_cpu_blas_variable_is_refused_by_name(fresh_choice, monkeypatch, rng, value):
    monkeypatch.setenv("CUONLINE_CPU_BLAS", value)
    with pytest.raises(ValueError, match=r"CUONLINE_CPU_BLAS=.*expected auto, numpy, openblas "
                                         r"or mkl"):
        cuonline.attention(*_operands(rng, np.float32, 4, 8, 8)[:1] * 3)


def test_a_library_asked_for_but_missing_is_refused(fresh_choice, monkeypatch, rng):
    monkeypatch.setenv("CUONLINE_CPU_BLAS", "mkl")
    monkeypatch.setitem(cpu_blas._loaded, "mkl", None)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"CUONLINE_CPU_BLAS='mkl'.*pip install cuonline\[mkl\]"):
        cuonline.attention(x, x, x)


def test_numpy_named_takes_numpys_matmul(fresh_choice, monkeypatch):
    monkeypatch.setenv("CUONLINE_CPU_BLAS", "numpy")
    assert cpu_blas.chosen() is None
    assert cpu_blas.describe() == "numpy's matmul (CUONLINE_CPU_BLAS=numpy)"
