"""The NumPy engine's compiled task loop (cuonline/engines/_task_kernels.py): a query block's
walk over its key tiles in one compiled call, BLAS called from it.

It must give the bits of the engine's Python loop (the same products, the same tile kernel) on
every library and for every band, tile tail and row group, run where it applies and step aside
where it does not, and keep the engine's handling of values that are not finite.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from support import check_attention, check_gradients

import cuonline
from cuonline.engines import cpu_blas, cpu_runtime
from cuonline.engines import numpy as numpy_engine

# the libraries it calls (NumPy's matmul has no CBLAS to call: the Python loop runs)
on_cblas = pytest.mark.parametrize("library", ["openblas", "mkl"], indirect=True)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough that a short sequence has several, tails and row groups included."""
    monkeypatch.setattr(numpy_engine, "BLOCK_Q", 64)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 48)
    monkeypatch.setattr(numpy_engine, "SPAN_ROWS", 16)


def walks(monkeypatch):
    """Count the engine's compiled walks (the calls that ran)."""
    ran = []
    original = numpy_engine._compiled_walk

    def counted(*args):
        done = original(*args)
        ran.append(done)
        return done

    monkeypatch.setattr(numpy_engine, "_compiled_walk", counted)
    return ran


def python_loop(monkeypatch, fn):
    """``fn()`` with the engine's Python loop instead of the compiled walk."""
    with monkeypatch.context() as m:
        m.setattr(numpy_engine, "_compiled_walk", lambda *args: None)
        return fn()


def inputs(rng, batch, lq, lk, d, dv, dtype):
    """``q, k, v`` of shapes ``batch + (L, D)``, the scores spread (x 4) so that the running
    max moves from tile to tile."""
    return (rng.standard_normal(batch + (lq, d)).astype(dtype) * 2,
            rng.standard_normal(batch + (lk, d)).astype(dtype) * 2,
            rng.standard_normal(batch + (lk, dv)).astype(dtype))


def assert_same_bits(qkv, options, ran, reference, compiled=True):
    """``cuonline.attention`` on ``qkv`` took the compiled path every time (``compiled``;
    else never; ``ran``: the outcomes its counter recorded), gives the bits of
    ``reference(call)`` (the same call by another path) and the oracle's result."""
    def call():
        return cuonline.attention(*qkv, return_lse=True, **options)

    out, lse = call()
    assert ran and (all(ran) if compiled else not any(ran))
    want, want_lse = reference(call)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    check_attention(*qkv, out, lse, options)


BANDS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (40, 7)},
    "left window": {"window": (30, None)},
    "causal, kv_lengths": {"causal": True, "kv_lengths": np.array([150, 61])},
}


@on_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", sorted(BANDS))
@pytest.mark.parametrize("lq, lk, d, dv", [(150, 150, 24, 20), (97, 181, 24, 20),
                                           (181, 97, 24, 20), (70, 97, 1, 1)])
def test_same_bits_as_the_python_loop(library, small_tiles, monkeypatch, rng, dtype, band,
                                      lq, lk, d, dv):
    """Tails of one key (97 = 2 x 48 + 1) and head dimensions of 1 included: single rows
    and columns are passed to BLAS as the Python loop passes them."""
    options = dict(BANDS[band])
    if "kv_lengths" in options:
        options["kv_lengths"] = np.minimum(options["kv_lengths"], lk)
    assert_same_bits(inputs(rng, (2,), lq, lk, d, dv, dtype), options, walks(monkeypatch),
                     lambda call: python_loop(monkeypatch, call))


@on_cblas
def test_inputs_with_row_gaps_take_the_walk(library, small_tiles, monkeypatch, rng):
    """Rows a whole number of elements apart (a slice of a wider array, heads of a
    (B, L, H, D) layout) are read in place."""
    q, k, v = (rng.standard_normal((130, 2, 32)).astype(np.float32)[:, :, :16]
               .transpose(1, 0, 2) for _ in range(3))
    ran = walks(monkeypatch)
    out = cuonline.attention(q, k, v, causal=True)
    assert ran and all(ran)
    want = python_loop(monkeypatch, lambda: cuonline.attention(q, k, v, causal=True))
    np.testing.assert_array_equal(out, want)


STEPS_ASIDE = {
    "a bias": lambda q: {"bias": np.zeros((q.shape[1], q.shape[1]), q.dtype)},
    "a soft cap": lambda q: {"softcap": 5.0},
    "a mask": lambda q: {"mask": np.ones((q.shape[1], q.shape[1]), bool)},
}


@on_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", ["plain", "causal", "window", "causal, kv_lengths"])
@pytest.mark.parametrize("slopes", [[0.5, 0.25], [1e-6, 3.0]], ids=["gentle", "steep"])
def test_alibi_takes_the_walk_with_the_bits_of_the_python_loop(
        library, small_tiles, monkeypatch, rng, dtype, band, slopes):
    """ALiBi's term is added in the walk, after each tile's product (the term's product
    rounded before the sum, as the score pipeline rounds it), for every band, tail and row
    group; a steep slope sends most weights of a row below the smallest normal number. (The
    keys outnumber the queries: each row has a key at distance 0. A row whose nearest key is
    67 away has logits near -201 under a slope of 3, rounded to float32's 1.5e-5 there, on
    both paths alike: 4x the oracle's naive error.)"""
    options = dict(BANDS[band], alibi_slopes=np.array(slopes, dtype))
    if "kv_lengths" in options:
        options["kv_lengths"] = np.array([181, 175])    # the last rows' keys 6 away
    assert_same_bits(inputs(rng, (2,), 97, 181, 24, 20, dtype), options, walks(monkeypatch),
                     lambda call: python_loop(monkeypatch, call))


@on_cblas
@pytest.mark.parametrize("case", sorted(STEPS_ASIDE))
def test_score_terms_take_the_python_loop(library, small_tiles, monkeypatch, rng, case):
    q = rng.standard_normal((2, 70, 16)).astype(np.float32)
    options = STEPS_ASIDE[case](q)
    ran = walks(monkeypatch)
    out, lse = cuonline.attention(q, q, q, return_lse=True, **options)
    assert ran and not any(ran)
    check_attention(q, q, q, out, lse, options)


@on_cblas
@pytest.mark.parametrize("layout", ["columns", "float16"])
def test_operands_cblas_cannot_read_in_place_take_the_python_loop(
        library, small_tiles, monkeypatch, rng, layout):
    """Keys stored by columns; float16 inputs (the products are float32's, of copies)."""
    q = rng.standard_normal((1, 90, 16)).astype(np.float32)
    k = np.asfortranarray(q[0])[None]
    if layout == "float16":
        q = k = q.astype(np.float16)
    ran = walks(monkeypatch)
    out, lse = cuonline.attention(q, k, q, return_lse=True)
    assert ran and not any(ran)
    check_attention(q, k, q, out, lse, {})


def test_numpys_matmul_takes_the_python_loop(small_tiles, monkeypatch, rng):
    monkeypatch.setenv("CUONLINE_CPU_BLAS", "numpy")
    cpu_blas.reset()
    try:
        q = rng.standard_normal((1, 90, 16))
        ran = walks(monkeypatch)
        cuonline.attention(q, q, q)
        assert ran and not any(ran)
    finally:
        cpu_blas.reset()


@on_cblas
def test_non_finite_values_reach_only_the_rows_that_see_them(library, small_tiles, rng):
    q, k, v = (rng.standard_normal((1, 100, 8)) for _ in range(3))
    v[0, 70] = np.nan                                      # seen by rows 70.. only
    out = cuonline.attention(q, k, v, causal=True)
    assert np.isfinite(out[0, :70]).all() and np.isnan(out[0, 70:]).all()


def test_without_the_task_kernel_the_python_loop_runs(small_tiles, monkeypatch, rng):
    def broken(name, dtype):
        raise RuntimeError("LLVM says no")

    from cuonline.engines import _task_kernels

    monkeypatch.setattr(_task_kernels, "compile_for", broken)
    monkeypatch.setattr(cpu_runtime, "compiled_kernels", {})
    q = rng.standard_normal((2, 90, 8))
    with pytest.warns(RuntimeWarning, match="forward_stack for float64 is unavailable"):
        out = cuonline.attention(q, q, q, causal=True)
    want = python_loop(monkeypatch, lambda: cuonline.attention(q, q, q, causal=True))
    np.testing.assert_array_equal(out, want)


@on_cblas
def test_results_do_not_depend_on_the_thread_count(library, small_tiles, rng):
    q, k, v = (rng.standard_normal((3, 2, 200, 16)).astype(np.float32) for _ in range(3))
    one = cuonline.attention(q, k, v, causal=True, workers=1)
    np.testing.assert_array_equal(one, cuonline.attention(q, k, v, causal=True, workers=3))


# --------------------------------------------------------------------------------------------
# a batch of short sequences: the elements' walks in one call

def plan_alike(monkeypatch, engine, keys):
    """An engine module (the forward's or the backward's) planning alike on every machine:
    tiles of 512 rows and ``keys`` keys, 2 cores, row groups of 16."""
    for name, value in (("BLOCK_Q", 512), ("BLOCK_K", keys), ("SPAN_ROWS", 16)):
        monkeypatch.setattr(engine, name, value)
    monkeypatch.setattr(engine, "workers", lambda: 2)


@pytest.fixture
def stacks(monkeypatch):
    """Short sequences planned as stacks alike on every machine (512 x 512 tiles); returns
    the list of the compiled stack calls' outcomes (True: ran)."""
    plan_alike(monkeypatch, numpy_engine, 512)
    ran = []

    original = numpy_engine.stack_walks

    def counted(*args):
        walks = original(*args)
        ran.append(walks is not None)
        return walks

    monkeypatch.setattr(numpy_engine, "stack_walks", counted)
    return ran


def per_element(monkeypatch, fn):
    """``fn()`` with one task per batch element (no stacks): each a compiled walk of its own."""
    with monkeypatch.context() as m:
        m.setattr(numpy_engine, "stack_plan", lambda p: None)
        return fn()


@on_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", sorted(BANDS))
@pytest.mark.parametrize("batch, lq, lk, d, dv", [((3, 4), 40, 40, 8, 8),
                                                  ((2, 5), 33, 70, 16, 5),
                                                  ((7,), 100, 61, 1, 3),
                                                  ((2, 3), 200, 2100, 8, 8),
                                                  ((2, 3), 1100, 1300, 8, 4)])
def test_stacks_give_the_bits_of_a_task_per_element(library, stacks, monkeypatch, rng, dtype,
                                                     band, batch, lq, lk, d, dv):
    """Every element of every stack as its own task would give it: the same products (row
    groups on the diagonal included), the same kernel, the output in its place; 200 queries
    against 2100 keys walk three key tiles of 1024 (unless a window band narrows them); 1100
    queries are three query blocks, each of them stacked over the elements."""
    options = dict(BANDS[band])
    options.pop("kv_lengths", None)                  # stacks take one key range for all
    assert_same_bits(inputs(rng, batch, lq, lk, d, dv, dtype), options, stacks,
                     lambda call: per_element(monkeypatch, call))


@on_cblas
def test_stacks_read_strided_and_shared_keys_in_place(library, stacks, monkeypatch, rng):
    """Heads of a (B, L, H, D) layout (rows apart by H x D) and keys shared by groups of
    query heads (a zero batch stride): each element's address from the batch strides."""
    x = rng.standard_normal((3, 50, 4, 16)).astype(np.float32)
    q = x.transpose(0, 2, 1, 3)                      # (3, 4, 50, 16), rows 64 apart
    k = x[:, :, :1].transpose(0, 2, 1, 3)            # (3, 1, 50, 16): broadcast over heads
    v = k[..., ::-1]                                 # columns reversed: CBLAS cannot read it
    out = cuonline.attention(q, k, k[..., :8], causal=True)
    assert stacks and all(stacks)
    np.testing.assert_array_equal(out, per_element(
        monkeypatch, lambda: cuonline.attention(q, k, k[..., :8], causal=True)))
    check_attention(q, k, k[..., :8], out, None, {"causal": True})
    stacks.clear()
    out = cuonline.attention(q, k, v)
    assert stacks and not any(stacks)                # the batched products take it
    check_attention(q, k, v, out, None, {})


@on_cblas
@pytest.mark.parametrize("layout", ["rows reversed", "columns strided"])
def test_stacks_copy_the_queries_cblas_cannot_read(library, stacks, monkeypatch, rng, layout):
    """The compiled walk reads each element's queries in place where CBLAS could and scales
    them itself; queries it cannot read so are copied once per stack first: the same bits as
    a task per element, which scales its own copy."""
    q, k, v = inputs(rng, (2, 3), 40, 70, 8, 8, np.float32)
    q = q[..., ::-1, :] if layout == "rows reversed" else np.repeat(q, 2, axis=-1)[..., ::2]
    assert_same_bits((q, k, v), {"causal": True}, stacks,
                     lambda call: per_element(monkeypatch, call))


@on_cblas
def test_a_stack_of_several_key_tiles_that_cblas_cannot_read(library, stacks, monkeypatch, rng):
    """Values with reversed columns and keys past one tile: no compiled walk and no batched
    products (those take one tile); each element runs as its own task would, the same bits."""
    q, k, v = inputs(rng, (2, 3), 200, 2100, 8, 8, np.float32)
    v = v[..., ::-1]                                 # columns reversed: CBLAS cannot read it
    assert_same_bits((q, k, v), {"causal": True}, stacks,
                     lambda call: per_element(monkeypatch, call), compiled=False)


@on_cblas
def test_a_nan_in_a_stack_stays_in_the_rows_that_see_it(library, stacks, rng):
    q, k, v = (rng.standard_normal((6, 30, 8)) for _ in range(3))
    v[4, 10] = np.nan
    out = cuonline.attention(q, k, v, causal=True)
    assert stacks and all(stacks)
    assert np.isfinite(out[[0, 1, 2, 3, 5]]).all() and np.isfinite(out[4, :10]).all()
    assert np.isnan(out[4, 10:]).all()


# --------------------------------------------------------------------------------------------
# the backward's key blocks


@pytest.fixture
def small_backward_tiles(monkeypatch):
    """Several tiles per element, each key block in a compiled call of its own (no stacks:
    they are the section below's)."""
    from cuonline.engines import numpy_backward

    monkeypatch.setattr(numpy_backward, "BLOCK_Q", 64)
    monkeypatch.setattr(numpy_backward, "BLOCK_K", 48)
    monkeypatch.setattr(numpy_backward, "SPAN_ROWS", 16)
    monkeypatch.setattr(numpy_backward, "_stacks", lambda p, groups: None)
    return numpy_backward


def blocks_done(monkeypatch, backward):
    """The tiles each compiled key block did, of those it was given (blocks no row sees
    have none)."""
    done = []
    original = backward._compiled_block

    def counted(p, e, tiles, *args):
        n = original(p, e, tiles, *args)
        if tiles:
            done.append(n)
        return n

    monkeypatch.setattr(backward, "_compiled_block", counted)
    return done


def backward_case(rng, dtype, lq, lk, d=24, dv=20, **options):
    q = rng.standard_normal((2, lq, d)).astype(dtype) * 2
    k = rng.standard_normal((2, lk, d)).astype(dtype) * 2
    v = rng.standard_normal((2, lk, dv)).astype(dtype)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(dtype)
    return dout, q, k, v, out, lse


def same_gradients(got, want, subnormals=False):
    """The same bits; ``subnormals``: but for results below the smallest normal number,
    which the compiled blocks flush to 0 (their products run under flush-to-zero, the
    Python loop's do not)."""
    for name in ("dq", "dk", "dv"):
        g, w = getattr(got, name), getattr(want, name)
        if subnormals:
            tiny = np.finfo(w.dtype).tiny
            assert np.count_nonzero(g != w) < g.size / 100, name
            np.testing.assert_allclose(g, w, rtol=0, atol=tiny, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


@on_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", sorted(BANDS))
@pytest.mark.parametrize("lq, lk, d, dv", [(150, 150, 24, 20), (97, 181, 24, 20),
                                           (70, 97, 1, 1)])
@pytest.mark.parametrize("cores", [1, 64], ids=["one task per element", "kv and q tasks"])
def test_backward_same_bits_as_the_python_loop(library, small_backward_tiles, monkeypatch,
                                               rng, dtype, band, lq, lk, d, dv, cores):
    backward = small_backward_tiles
    monkeypatch.setattr(backward, "workers", lambda: cores)
    options = dict(BANDS[band])
    if "kv_lengths" in options:
        options["kv_lengths"] = np.minimum(options["kv_lengths"], lk)
    case = backward_case(rng, dtype, lq, lk, d, dv, **options)
    assert_blocks_like_the_python_loop(monkeypatch, backward, case, options)


def assert_blocks_like_the_python_loop(monkeypatch, backward, case, options, subnormals=False):
    """Every compiled key block did all its tiles, with the Python loop's gradients
    (:func:`same_gradients`) and the oracle's."""
    done = blocks_done(monkeypatch, backward)
    got = cuonline.attention_backward(*case, **options)
    assert done and all(done)
    with monkeypatch.context() as m:
        m.setattr(backward, "_compiled_block", lambda *args: 0)
        want = cuonline.attention_backward(*case, **options)
    same_gradients(got, want, subnormals)
    check_gradients(got, case[0], *case[1:4], options)


@on_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", ["plain", "causal", "window"])
@pytest.mark.parametrize("cores", [1, 64], ids=["one task per element", "kv and q tasks"])
def test_backward_alibi_same_bits_as_the_python_loop(library, small_backward_tiles,
                                                     monkeypatch, rng, dtype, band, cores):
    """ALiBi's term added in the compiled blocks (the forward walk's _add_alibi), gentle and
    steep slopes, every key block and tile tail: the Python loop's bits, but for gradients
    below the smallest normal number (the steep slope's far keys), 0 in the blocks."""
    backward = small_backward_tiles
    monkeypatch.setattr(backward, "workers", lambda: cores)
    options = dict(BANDS[band], alibi_slopes=np.array([0.25, 3.0], dtype))
    case = backward_case(rng, dtype, 97, 181, **options)
    assert_blocks_like_the_python_loop(monkeypatch, backward, case, options, subnormals=True)


@on_cblas
def test_backward_rows_that_see_nothing_take_the_python_loop(
        library, small_backward_tiles, monkeypatch, rng):
    """Causal with more queries than keys: the first rows see no key (lse -inf)."""
    case = backward_case(rng, np.float32, 181, 97, causal=True)
    done = blocks_done(monkeypatch, small_backward_tiles)
    got = cuonline.attention_backward(*case, causal=True)
    assert done and not any(done)
    check_gradients(got, case[0], *case[1:4], {"causal": True})


@on_cblas
def test_backward_hands_a_non_finite_tile_to_the_python_loop(
        library, small_backward_tiles, monkeypatch, rng):
    """NaN in V reaches dS of the rows that see it (through dP = dO V^T): the block stops
    at that tile and the loop keeps NaN where it belongs (dQ of those rows, dK of that key);
    the tiles before it are the compiled block's."""
    dout, q, k, v, out, lse = backward_case(rng, np.float64, 150, 150, causal=True)
    v[0, 100] = np.nan
    done = blocks_done(monkeypatch, small_backward_tiles)
    got = cuonline.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert any(0 < n for n in done) and any(n == 0 for n in done)
    assert np.isnan(got.dq[0, 100:]).all() and np.isfinite(got.dq[0, :100]).all()
    assert np.isnan(got.dk[0, 100]).all() and np.isfinite(np.delete(got.dk[0], 100, 0)).all()
    assert np.isfinite(got.dv).all() and np.isfinite(got.dq[1]).all()
    with monkeypatch.context() as m:
        m.setattr(small_backward_tiles, "_compiled_block", lambda *args: 0)
        want = cuonline.attention_backward(dout, q, k, v, out, lse, causal=True)
    same_gradients(got, want)


@on_cblas
@pytest.mark.parametrize("case", sorted(STEPS_ASIDE))
def test_backward_score_terms_take_the_python_loop(library, small_backward_tiles,
                                                   monkeypatch, rng, case):
    q = rng.standard_normal((2, 70, 16))
    options = STEPS_ASIDE[case](q)
    out, lse = cuonline.attention(q, q, q, return_lse=True, **options)
    done = blocks_done(monkeypatch, small_backward_tiles)
    got = cuonline.attention_backward(out, q, q, q, out, lse, **options)
    assert done and not any(done)
    check_gradients(got, out, q, q, q, options)


# --------------------------------------------------------------------------------------------
# the backward of a batch of short sequences: stacks of elements in one call


@pytest.fixture
def backward_stacks(monkeypatch):
    """Short sequences planned as stacks alike on every machine (512 x 256 tiles); returns
    the list of ``(elements done, elements given)`` of the compiled stack calls."""
    from cuonline.engines import numpy_backward

    plan_alike(monkeypatch, numpy_backward, 256)
    calls = []
    original = numpy_backward._compiled_stack

    def counted(bp, elements, *args):
        done = original(bp, elements, *args)
        calls.append((done[0], len(elements)))
        return done

    monkeypatch.setattr(numpy_backward, "_compiled_stack", counted)
    return calls


def backward_per_element(monkeypatch, fn):
    """``fn()`` with one task per group of batch elements (no stacks)."""
    from cuonline.engines import numpy_backward

    with monkeypatch.context() as m:
        m.setattr(numpy_backward, "_stacks", lambda p, groups: None)
        return fn()


def gradients_case(rng, q, k, v, options):
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    return rng.standard_normal(out.shape).astype(out.dtype), q, k, v, out, lse


@on_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", ["plain", "causal", "window", "left window"])
@pytest.mark.parametrize("batch, lq, lk, d, dv", [((3, 4), 40, 40, 8, 8),
                                                  ((2, 5), 33, 70, 16, 5),
                                                  ((7,), 61, 100, 1, 3)])
def test_backward_stacks_give_the_bits_of_a_task_per_element(
        library, backward_stacks, monkeypatch, rng, dtype, band, batch, lq, lk, d, dv):
    """Every element's gradients and row sums as its own task would give them (the row
    groups of the diagonal tile included), each in its own slot."""
    options = BANDS[band]
    case = gradients_case(rng, *inputs(rng, batch, lq, lk, d, dv, dtype), options)
    got = cuonline.attention_backward(*case, **options)
    assert backward_stacks and all(done == n for done, n in backward_stacks)
    assert len(backward_stacks) == 2                       # one stack per core
    same_gradients(got, backward_per_element(
        monkeypatch, lambda: cuonline.attention_backward(*case, **options)))
    if d > 1:
        # d = 1 (scale 1, logits up to ~30): dQ's error is often 10x the naive one's on every
        # path, the Python loop's included: Delta = rowsum(dO * O) takes the forward's O, a
        # few ulps off, which P = exp(s - lse) no longer cancels (docs/performance.md)
        check_gradients(got, case[0], *case[1:4], options)


@on_cblas
def test_backward_stacks_take_alibi(library, backward_stacks, monkeypatch, rng):
    """Each element's ALiBi slope reaches its walk in a stack: the bits of a task per
    element."""
    slopes = np.array([[0.5, 0.125, 2.0, 1e-3]], np.float32).repeat(3, 0)
    options = {"causal": True, "alibi_slopes": slopes}
    case = gradients_case(rng, *inputs(rng, (3, 4), 40, 40, 8, 8, np.float32), options)
    got = cuonline.attention_backward(*case, **options)
    assert backward_stacks and all(done == n for done, n in backward_stacks)
    same_gradients(got, backward_per_element(
        monkeypatch, lambda: cuonline.attention_backward(*case, **options)))
    check_gradients(got, case[0], *case[1:4], options)


@on_cblas
def test_backward_stacks_add_shared_keys_in_order(library, backward_stacks, monkeypatch, rng):
    """Keys and values shared by groups of query heads (a zero batch stride) in a (B, L, H, D)
    layout: a group's heads add into one dK/dV slot, in the order a task per group adds."""
    x = rng.standard_normal((3, 50, 4, 16)).astype(np.float32)
    q = x.transpose(0, 2, 1, 3)                      # (3, 4, 50, 16), rows 64 apart
    k = x[:, :, :1].transpose(0, 2, 1, 3)            # (3, 1, 50, 16): shared by 4 heads
    v = k[..., :8]
    case = gradients_case(rng, q, k, v, {"causal": True})
    got = cuonline.attention_backward(*case, causal=True)
    assert backward_stacks and all(done == n for done, n in backward_stacks)
    assert got.dk.shape == k.shape and got.dv.shape == v.shape
    same_gradients(got, backward_per_element(
        monkeypatch, lambda: cuonline.attention_backward(*case, causal=True)))
    check_gradients(got, case[0], q, k, v, {"causal": True})


@on_cblas
@pytest.mark.parametrize("layout", ["BHLD", "BLHD"])
def test_backward_stacks_read_runs_of_elements_in_either_layout(library, backward_stacks,
                                                                 monkeypatch, rng, layout):
    """A stack is a run of consecutive elements: read as one slice where the batch axes
    merge (B, H, L, D), gathered where they do not (the heads of a (B, L, H, D) array); the
    same bits either way, and its row sums added in place."""
    def array(d):
        x = rng.standard_normal((3, 4, 50, d) if layout == "BHLD" else (3, 50, 4, d))
        x = x.astype(np.float32)
        return x if layout == "BHLD" else x.transpose(0, 2, 1, 3)

    q, k, v = array(16), array(16), array(8)
    case = gradients_case(rng, q, k, v, {"causal": True})
    got = cuonline.attention_backward(*case, causal=True)
    assert backward_stacks and all(done == n for done, n in backward_stacks)
    same_gradients(got, backward_per_element(
        monkeypatch, lambda: cuonline.attention_backward(*case, causal=True)))
    check_gradients(got, case[0], q, k, v, {"causal": True})


@on_cblas
def test_a_nan_stops_a_backward_stack_at_its_element(library, backward_stacks, monkeypatch,
                                                     rng):
    """NaN in element 5's values reaches its dS: the stack stops there, the elements from it
    on are done one by one, and NaN stays in the gradients of what saw it."""
    case = gradients_case(rng, *inputs(rng, (8,), 30, 30, 8, 8, np.float64), {"causal": True})
    dout, q, k, v, out, lse = case
    v[5, 10] = np.nan
    got = cuonline.attention_backward(*case, causal=True)
    assert sorted(backward_stacks) == [(1, 4), (4, 4)]     # element 5: the second of 4..7
    assert np.isnan(got.dq[5, 10:]).all() and np.isfinite(got.dq[5, :10]).all()
    assert np.isnan(got.dk[5, 10]).all() and np.isfinite(np.delete(got.dk[5], 10, 0)).all()
    others = [0, 1, 2, 3, 4, 6, 7]
    assert all(np.isfinite(g[others]).all() for g in (got.dq, got.dk, got.dv))
    same_gradients(got, backward_per_element(
        monkeypatch, lambda: cuonline.attention_backward(*case, causal=True)))


@on_cblas
@pytest.mark.parametrize("case", ["rows that see no key", "a NaN query", "columns",
                                  "float16"])
def test_backward_stacks_step_aside(library, backward_stacks, monkeypatch, rng, case):
    """Rows that see no key (causal, more queries than keys), a non-finite operand and
    operands CBLAS cannot read in place: the stack does nothing and each element takes its
    own path, with the right gradients."""
    lq = 50 if case == "rows that see no key" else 30
    q, k, v = inputs(rng, (4,), lq, 30, 8, 8, np.float32)
    if case == "float16":
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
    elif case == "columns":
        k = np.asfortranarray(k.transpose(1, 2, 0)).transpose(2, 0, 1)
    options = {"causal": True}
    dout, q, k, v, out, lse = gradients_case(rng, q, k, v, options)
    if case == "a NaN query":
        q = q.copy()
        q[2, 3, 0] = np.nan
    got = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
    if case == "a NaN query":                # the stack of elements 2 and 3 only
        assert sorted(backward_stacks) == [(0, 2), (2, 2)]
    else:
        assert backward_stacks and all(done == 0 for done, _ in backward_stacks)
    want = backward_per_element(
        monkeypatch, lambda: cuonline.attention_backward(dout, q, k, v, out, lse, **options))
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    if case != "a NaN query":
        check_gradients(got, dout, q, k, v, options)


@on_cblas
def test_backward_stacks_do_not_depend_on_the_thread_count(library, backward_stacks, rng):
    case = gradients_case(rng, *inputs(rng, (3, 5), 40, 60, 16, 8, np.float32), {})
    one = cuonline.attention_backward(*case, workers=1)
    assert backward_stacks and all(done == n for done, n in backward_stacks)
    same_gradients(one, cuonline.attention_backward(*case, workers=3))


@on_cblas
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_stack_stopped_inside_an_element_resumes_at_its_tile(library, monkeypatch, rng,
                                                               dtype):
    """Elements of several key blocks and query tiles in one stack; NaN in element 2's value
    at key 100 makes dS of its tiles from key block 96 on not finite: the stack stops after
    that element's earlier tiles, the Python loop adds the rest of it from the stopping tile
    on, and the elements after it go one by one, all with the bits of a task per element."""
    from cuonline.engines import numpy_backward

    plan_alike(monkeypatch, numpy_backward, 48)
    monkeypatch.setattr(numpy_backward, "BLOCK_Q", 64)
    outcomes = []
    original = numpy_backward._compiled_stack

    def counted(bp, elements, *args):
        outcomes.append(original(bp, elements, *args))
        return outcomes[-1]

    monkeypatch.setattr(numpy_backward, "_compiled_stack", counted)
    dout, q, k, v, out, lse = gradients_case(
        rng, *inputs(rng, (4,), 150, 150, 8, 8, dtype), {"causal": True})
    v[2, 100] = np.nan
    got = cuonline.attention_backward(dout, q, k, v, out, lse, causal=True)
    # stacks [0, 1] and [2, 3]: the second stops in element 2 after its blocks 0 and 48
    # (3 + 3 tiles: query tiles from 0, 64, 128 see keys [0, 48); the same for [48, 96))
    assert sorted(outcomes) == [(0, 6), (2, 0)]
    assert np.isnan(got.dq[2, 100:]).all() and np.isfinite(got.dq[2, :100]).all()
    assert np.isnan(got.dk[2, 100]).all() and np.isfinite(np.delete(got.dk[2], 100, 0)).all()
    assert all(np.isfinite(g[[0, 1, 3]]).all() for g in (got.dq, got.dk, got.dv))
    same_gradients(got, backward_per_element(
        monkeypatch, lambda: cuonline.attention_backward(dout, q, k, v, out, lse,
                                                         causal=True)))


# calls of every compiled path with what users pass: read-only inputs, outputs and lse, a
# scalar output gradient, queries whose rows are apart; the kernels' compiled signatures after
_SIGNATURES = r"""
import json
import numpy as np
import cuonline
from cuonline.engines import _task_kernels as t
rng = np.random.default_rng(0)
for dtype in (np.float32, np.float64):
    for shape, options in (((2, 8, 16, 16), {}), ((1, 2, 700, 16), {}),
                           ((2, 8, 16, 16), {'causal': True})):
        q, k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
        for x in (q, k, v):
            x.flags.writeable = False
        out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
        out.flags.writeable = lse.flags.writeable = False
        cuonline.attention_backward(np.ones_like(out), q, k, v, out, lse, **options)
        cuonline.attention_backward(1.0, q, k, v, out, lse, **options)
        apart = q[..., ::2, :]
        out, lse = cuonline.attention(apart, k, v, return_lse=True, **options)
        cuonline.attention_backward(out, apart, k, v, out, lse, **options)
print(json.dumps({name: len(getattr(t, name).signatures)
                  for name in ('forward_stack', 'backward_block', 'backward_stack')}))
"""


@pytest.mark.slow
def test_the_engine_calls_each_kernel_with_the_types_it_was_compiled_for():
    """Every call of a compiled task loop passes the argument types of its warm-up: one
    compiled signature a dtype. An argument of another type (a read-only view where the
    warm-up passed a writeable array) is compiled anew on first use, seconds of a user's
    call, and cached beside the others."""
    run = subprocess.run([sys.executable, "-c", _SIGNATURES], check=True, timeout=600,
                         capture_output=True, text=True)
    counts = json.loads(run.stdout.splitlines()[-1])
    assert counts == {"forward_stack": 2, "backward_block": 2, "backward_stack": 2}, counts
