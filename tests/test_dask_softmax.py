"""softmax, log_softmax and logsumexp on Dask arrays (cuonline/engines/dask.py).

Lazy results against the in-memory NumPy call: one block along the axis (each block is the
in-memory call), the axis chunked (per-block (m, l) states merged by a fixed tree), masks,
slices with nothing visible, NaN and +inf, every dtype; validation on stand-ins.

The tests marked ``needs_dispatch`` go through ``cuonline.softmax`` and its siblings: they
fail (strict xfail) until cuonline/_api.py hands Dask arrays to
``cuonline.engines.dask.softmax``; the others call the engine directly.
"""

from __future__ import annotations

import numpy as np
import pytest
from support import needs_gpu

import cuonline
from cuonline.engines import dask as dask_engine

da = pytest.importorskip("dask.array")
import dask  # noqa: E402 - after the skip: dask is an extra

FUNCTIONS = {"softmax": cuonline.softmax, "log_softmax": cuonline.log_softmax,
             "logsumexp": cuonline.logsumexp}


def _dispatched() -> bool:
    return isinstance(cuonline.softmax(da.zeros(3, chunks=1)), da.Array)


needs_dispatch = pytest.mark.xfail(
    not _dispatched(), strict=True,
    reason="cuonline.softmax/log_softmax/logsumexp do not hand Dask arrays to "
           "cuonline.engines.dask.softmax yet (their dispatch lines in cuonline/_api.py)")


def engine(mode, x, axis=-1, **options):
    """The Dask engine for ``mode``, called as the public function will call it."""
    return dask_engine.softmax(FUNCTIONS[mode], x, axis, mode=mode, **options)


def rtol(dtype):
    # a few ulp of the accumulation: float16 is rounded once, at the end
    return {np.dtype(np.float64): 1e-13, np.dtype(np.float32): 4e-6,
            np.dtype(np.float16): 2e-3}[np.dtype(dtype)]


def check_same(got, ref):
    """Dask ``got`` computes to NumPy ``ref``: type, shape, dtype, -inf and NaN places,
    values to a few ulp (relative to the slice's magnitude for log_softmax/logsumexp)."""
    assert isinstance(got, da.Array), type(got)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    have = got.compute()
    assert isinstance(have, np.ndarray) and have.shape == ref.shape and have.dtype == ref.dtype
    assert np.array_equal(np.isneginf(have), np.isneginf(ref))
    assert np.array_equal(np.isnan(have), np.isnan(ref))
    finite = np.isfinite(ref)
    scale = max(1.0, float(np.abs(ref[finite]).max(initial=0)))
    np.testing.assert_allclose(have[finite].astype(np.float64), ref[finite].astype(np.float64),
                               rtol=0, atol=rtol(ref.dtype) * scale)


def random_chunks(rng, n):
    cuts = sorted(set(rng.integers(1, n, size=rng.integers(1, min(n, 6))).tolist())) if n > 1 \
        else []
    bounds = [0, *cuts, n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def random_case(seed):
    """``x`` (NumPy), its Dask chunks, an axis, a mask or None: random, with large logits,
    ``-inf`` entries and a slice with nothing visible."""
    rng = np.random.default_rng(seed)
    dtype = [np.float64, np.float32, np.float16][seed % 3]
    shape = tuple(int(n) for n in rng.integers(1, 12, size=1 + seed % 3))
    x = (rng.standard_normal(shape) * [1, 50, 4][seed % 3]).astype(dtype)
    x[rng.random(shape) < 0.2] = -np.inf
    axis = int(rng.integers(-len(shape), len(shape)))
    chunks = tuple(random_chunks(rng, n) for n in shape)
    mask = None
    if seed % 2:
        mshape = tuple(n if rng.random() < 0.6 else 1 for n in shape)
        mask = rng.random(mshape) < 0.7
        if seed % 4 == 1:
            mask = da.from_array(mask, chunks=tuple(random_chunks(rng, n) for n in mshape))
    return x, chunks, axis, mask


@pytest.mark.parametrize("mode", FUNCTIONS)
@pytest.mark.parametrize("seed", range(12))
def test_the_engine_matches_the_numpy_call(mode, seed):
    x, chunks, axis, mask = random_case(seed)
    kw = {"keepdims": bool(seed % 2)} if mode == "logsumexp" else {}
    in_memory_mask = mask.compute() if isinstance(mask, da.Array) else mask
    ref = FUNCTIONS[mode](x, axis, mask=in_memory_mask, **kw)
    check_same(engine(mode, da.from_array(x, chunks=chunks), axis, mask=mask, **kw), ref)


@pytest.mark.parametrize("mode", FUNCTIONS)
def test_a_chunked_axis_merges_states_and_a_whole_axis_calls_the_function(mode):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 200)) * 30
    whole = engine(mode, da.from_array(x, chunks=(2, 200)))
    chunked = engine(mode, da.from_array(x, chunks=(2, 10)))
    names = [key[0] for key in dict(chunked.__dask_graph__()) if isinstance(key, tuple)]
    # 20 blocks per slice: merges of 8, 8 and 4, then one of 3, per row block
    assert sum(n.endswith("-merge") for n in names) == 3 * 4
    assert not any(n.endswith(("-merge", "-state")) for key in dict(whole.__dask_graph__())
                   if isinstance(key, tuple) for n in [key[0]])
    ref = FUNCTIONS[mode](x, -1)
    check_same(whole, ref)
    check_same(chunked, ref)
    # the tree is fixed: the result does not depend on the scheduler
    assert np.array_equal(chunked.compute(scheduler="synchronous"),
                          chunked.compute(scheduler="threads", num_workers=2))


def test_the_result_is_lazy():
    x = da.ones((4, 30), chunks=(2, 10)).map_blocks(_raise_if_computed, dtype=float)
    for mode in FUNCTIONS:
        out = engine(mode, x, 1)
        with pytest.raises(RuntimeError, match="computed"):
            out.compute()


def _raise_if_computed(x):
    if x.size:
        raise RuntimeError("a block was computed")
    return x


@pytest.mark.parametrize("chunks", [(3, 4), (3, 12)], ids=["chunked", "whole"])
def test_invisible_nan_and_infinite_slices(chunks):
    x = np.random.default_rng(2).standard_normal((3, 12))
    x[0] = -np.inf                              # nothing visible: 0, -inf
    x[1, 7] = np.nan                            # NaN
    x[2, 5] = np.inf                            # +inf: NaN, as the in-memory call
    mask = np.ones((3, 12), bool)
    mask[2, :] = True
    for mode in FUNCTIONS:
        with np.errstate(invalid="ignore"):
            ref = FUNCTIONS[mode](x, mask=mask)
            check_same(engine(mode, da.from_array(x, chunks=chunks), mask=mask), ref)
    masked = np.zeros((3, 12), bool)
    for mode in FUNCTIONS:
        ref = FUNCTIONS[mode](x[1:2] * 0, mask=masked[1:2])
        check_same(engine(mode, da.from_array(x[1:2] * 0, chunks=chunks), mask=masked[1:2]),
                   ref)


BAD = [
    ("axis", dict(axis=2)),
    ("axis type", dict(axis=1.0)),
    ("mask dtype", dict(mask=np.ones((3, 4)))),
    ("mask shape", dict(mask=np.ones((5,), bool))),
    ("backend", dict(backend="cupy")),
    ("keepdims", dict(keepdims="yes")),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_errors_are_those_of_the_numpy_call(case):
    _, options = case
    x = np.zeros((3, 4))
    options = dict(options)
    axis = options.pop("axis", -1)
    with pytest.raises((TypeError, ValueError)) as numpy_error:
        cuonline.logsumexp(x, axis, **options)
    lazy = da.from_array(x, chunks=2).map_blocks(_raise_if_computed, dtype=x.dtype)
    with pytest.raises(numpy_error.type) as dask_error:
        engine("logsumexp", lazy, axis, **options)
    assert str(dask_error.value) == str(numpy_error.value)


def test_unknown_chunk_sizes_are_refused():
    x = da.from_array(np.arange(6.0), chunks=3)
    with pytest.raises(ValueError, match=r"`x` has unknown chunk sizes .* "
                                         r"x\.compute_chunk_sizes\(\)"):
        engine("softmax", x[x > 2])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("chunks", [(16, 8), (16, 64)], ids=["chunked", "whole"])
def test_cupy_chunks_give_cupy_blocks(chunks):
    import cupy
    x = np.random.default_rng(4).standard_normal((64, 64)).astype(np.float32) * 10
    dx = da.from_array(cupy.asarray(x), chunks=chunks, asarray=False)
    for mode in FUNCTIONS:
        got = engine(mode, dx).compute()
        assert isinstance(got, cupy.ndarray), mode
        ref = FUNCTIONS[mode](x)
        np.testing.assert_allclose(got.get(), ref, rtol=0,
                                   atol=rtol(x.dtype) * max(1, np.abs(ref).max()))


# --------------------------------------------------------------------------------------------
# through the public functions


@needs_dispatch
@pytest.mark.parametrize("mode", FUNCTIONS)
@pytest.mark.parametrize("chunks", [(2, 5), (2, 20)], ids=["chunked", "whole"])
def test_the_public_functions_return_lazy_dask_arrays(mode, chunks):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 20)) * 20
    mask = rng.random((1, 20)) < 0.8
    kw = {"keepdims": True} if mode == "logsumexp" else {}
    got = FUNCTIONS[mode](da.from_array(x, chunks=chunks), mask=mask, **kw)
    check_same(got, FUNCTIONS[mode](x, mask=mask, **kw))
    # a Dask mask alone makes the call a Dask one too
    got = FUNCTIONS[mode](x, 0, mask=da.from_array(np.broadcast_to(mask, x.shape), chunks=2))
    check_same(got, FUNCTIONS[mode](x, 0, mask=mask))


@needs_dispatch
def test_the_public_functions_validate_on_stand_ins():
    lazy = da.zeros((3, 4), chunks=2).map_blocks(_raise_if_computed, dtype=float)
    with pytest.raises(ValueError, match="`axis` 2 is out of range"):
        cuonline.softmax(lazy, 2)
    assert isinstance(dask.compute(cuonline.logsumexp(da.zeros((3, 4)), 0))[0], np.ndarray)
