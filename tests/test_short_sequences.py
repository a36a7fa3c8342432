"""A batch of sequences on the NumPy engine run as stacks of batch elements
(``numpy.stack_plan``) rather than one task per element and query block: short sequences,
every query in one block, as whole elements; longer ones (where the compiled walk applies)
query block by query block."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from support import check_attention

import cuonline
from cuonline import _validate
from cuonline.engines import numpy as numpy_engine
from cuonline.engines import cpu_runtime
from cuonline.engines.cpu_runtime import ElementRun
from cuonline.engines.numpy_scores import SLICE_BYTES

SHAPES = [((3, 5), 1, 1, 8), ((2, 4), 64, 64, 32), ((7,), 100, 130, 16), ((2, 3), 256, 256, 64)]
OPTIONS = [{}, {"causal": True}, {"window": (20, 3)}, {"causal": True, "q_offset": 5},
           {"scale": 0.3, "return_lse": True}]


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    """The stacks depend on the tile shape and the core count: fixed here (512 x 512 tiles,
    2 cores, every call cut for them however little its work) so that every machine plans
    these cases alike."""
    monkeypatch.setattr(numpy_engine, "BLOCK_Q", 512)
    monkeypatch.setattr(numpy_engine, "BLOCK_K", 512)
    monkeypatch.setattr(numpy_engine, "workers", lambda: 2)
    monkeypatch.setattr(cpu_runtime, "workers", lambda: 2)
    monkeypatch.setattr(cpu_runtime, "PARALLEL_WORK", 0)


def data(rng, batch, lq, lk, d, dtype=np.float32):
    return (rng.standard_normal(batch + (lq, d)).astype(dtype),
            rng.standard_normal(batch + (lk, d)).astype(dtype),
            rng.standard_normal(batch + (lk, d)).astype(dtype))


def per_element(monkeypatch, call):
    """``call()`` with the stacks turned off: one task per batch element and query block."""
    with monkeypatch.context() as m:
        m.setattr(numpy_engine, "stack_plan", lambda p: None)
        return call()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stacks_agree_with_the_oracle_and_the_per_element_path(rng, monkeypatch, shape,
                                                              options, dtype):
    batch, lq, lk, d = shape
    q, k, v = data(rng, batch, lq, lk, d, dtype)
    assert numpy_engine.stack_plan(_validate.validate_attention(q, k, v, **options))
    result = cuonline.attention(q, k, v, **options)
    out, lse = result if options.get("return_lse") else (result, None)
    check_attention(q, k, v, out, lse, options)
    single = per_element(monkeypatch, lambda: cuonline.attention(q, k, v, **options))
    np.testing.assert_allclose(result if lse is None else out,
                               single if lse is None else single[0], rtol=0, atol=1e-6)


@contextlib.contextmanager
def without_compiled_walk(monkeypatch):
    """Within: no stack takes the compiled walk (as where numba or a CBLAS is missing, or
    CBLAS cannot read the keys or values in place)."""
    with monkeypatch.context() as m:
        m.setattr(numpy_engine, "_stack_walk", lambda p, element: None)
        yield


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_stack_writes_every_value_of_the_output_it_is_given(rng, dtype):
    # the engine hands the stacks its results unzeroed (np.empty): whatever the output held,
    # NaN and inf included, the values come out the same, rows that see no key included
    q, k, v = data(rng, (6,), 40, 70, 16, dtype)
    options = {"causal": True, "q_offset": -5, "return_lse": True}   # rows 0-4 see nothing
    p = _validate.validate_attention(q, k, v, **options)
    elements = ElementRun((6,), 1, 5)
    results = []
    for fill in (0.0, np.nan, np.inf):
        held = np.full((4, 40, 16), fill, dtype)
        o, lse = numpy_engine.attend_stacked(p, elements, 0, 40, 0, 70, held)
        results.append((np.array(o), lse))
    out, lse = cuonline.attention(q, k, v, **options)
    assert (lse[:, :5] == -np.inf).all() and (out[:, :5] == 0).all()
    for o, got_lse in results:
        np.testing.assert_array_equal(o, out[1:5])
        np.testing.assert_array_equal(got_lse, lse[1:5])


def test_compiled_stacks_hold_their_queries_and_outputs_within_a_slice(rng):
    # the compiled walk reads keys and values in place through one score tile: the stacks
    # are as few as feed every core, however many elements that puts beside one score tile
    q, k, v = data(rng, (40, 3), 64, 96, 8)
    p = _validate.validate_attention(q, k, v)
    stacks = numpy_engine.stack_plan(p)
    rows, keys = numpy_engine.blocks(p.acc_dtype)
    assert sum(len(elements) for elements, *_ in stacks) == 120
    assert len(stacks) == 2                      # one stack per core
    assert all(len(elements) * 64 * 96 > rows * keys for elements, *_ in stacks)
    # a head dimension whose queries and outputs fill the slice: stacks of the most that fit
    q, k, v = data(rng, (6,), 32, 48, 2048)
    p = _validate.validate_attention(q, k, v)
    most = numpy_engine.stack_limit(p)[2]
    assert most == SLICE_BYTES // (32 * (2048 + 2048) * 4) == 8
    q, k, v = data(rng, (6,), 32, 48, 16384)
    assert numpy_engine.stack_plan(_validate.validate_attention(q, k, v)) is None


def test_without_the_compiled_walk_a_stack_never_outgrows_one_score_tile(rng, monkeypatch):
    q, k, v = data(rng, (40, 3), 64, 96, 8)
    p = _validate.validate_attention(q, k, v)
    with without_compiled_walk(monkeypatch):
        stacks = numpy_engine.stack_plan(p)
        out = cuonline.attention(q, k, v)
    rows, keys = numpy_engine.blocks(p.acc_dtype)
    assert sum(len(elements) for elements, *_ in stacks) == 120
    assert all(len(elements) * 64 * 96 <= rows * keys for elements, *_ in stacks)
    assert len(stacks) >= 2                      # at least one stack per core
    np.testing.assert_array_equal(out, cuonline.attention(q, k, v))
    check_attention(q, k, v, out, None, {})


# (ALiBi's term is the compiled walk's: its stacks are tested in tests/test_task_kernels.py)
@pytest.mark.parametrize("options", [{"bias": np.zeros((8, 8))}, {"softcap": 5.0},
                                     {"kv_lengths": np.array([3, 8])}], ids=str)
def test_score_terms_take_the_general_path(rng, options):
    q, k, v = data(rng, (2,), 8, 8, 4)
    assert numpy_engine.stack_plan(_validate.validate_attention(q, k, v, **options)) is None


def test_a_call_of_little_work_runs_as_one_stack(rng, monkeypatch, backward_machine):
    """Below PARALLEL_WORK multiply-adds a call's elements are one stack, run in the calling
    thread (a pool thread's hand-off costs more than it saves); at it, a stack per core, the
    forward's and the backward's alike; the same results either way."""
    q, k, v = data(rng, (4, 3), 16, 16, 8)
    p = _validate.validate_attention(q, k, v)
    work = 12 * 16 * 16 * (8 + 8)                       # the forward's multiply-adds
    out, lse = cuonline.attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = cuonline.attention_backward(dout, q, k, v, out, lse)
    for limit, stacks in ((work + 1, 1), (work, 2)):
        monkeypatch.setattr(cpu_runtime, "PARALLEL_WORK", limit)
        assert len(numpy_engine.stack_plan(p)) == stacks
        np.testing.assert_array_equal(cuonline.attention(q, k, v), out)
    backward_work = 12 * 16 * 16 * (2 * 8 + 3 * 8)
    for limit, stacks in ((backward_work + 1, 1), (backward_work, 2)):
        monkeypatch.setattr(cpu_runtime, "PARALLEL_WORK", limit)
        tasks = backward_plan(backward_machine, q, k, v)
        assert [part for _, part, _, _ in tasks] == ["stack"] * stacks
        again = cuonline.attention_backward(dout, q, k, v, out, lse)
        for name in ("dq", "dk", "dv"):
            np.testing.assert_array_equal(getattr(again, name), getattr(grads, name))


@pytest.mark.parametrize("options", OPTIONS[:4] + [{"alibi_slopes": np.linspace(0.1, 1, 6)}],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_stack_and_a_stack_per_core_give_the_same_bits(rng, monkeypatch, backward_machine,
                                                          options, dtype):
    """A call of little work runs as one stack, the tests' others as a stack per core: the
    same bits for every score the stacks take, forward and backward, with an element whose
    output is not finite (redone by the careful path) and keys shared by two query heads
    (the backward's groups)."""
    q = rng.standard_normal((3, 2, 24, 8)).astype(dtype)
    k, v = (rng.standard_normal((3, 1, 24, 8)).astype(dtype) for _ in range(2))
    v[1, 0, 20, 3] = np.inf
    if "alibi_slopes" in options:
        options = {"alibi_slopes": options["alibi_slopes"].reshape(3, 2).astype(dtype)}
    results = []
    for limit, stacks in ((1 << 62, 1), (0, 2)):
        monkeypatch.setattr(cpu_runtime, "PARALLEL_WORK", limit)
        p = _validate.validate_attention(q, k, v, **options)
        assert len(numpy_engine.stack_plan(p)) == stacks
        out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
        dout = np.ones_like(out)
        bp = _validate.validate_attention_backward(dout, q, k, v, out, lse, **options)
        tasks = backward_machine._plan(bp.forward, bp.targets)
        assert [part for _, part, _, _ in tasks] == ["stack"] * stacks
        grads = cuonline.attention_backward(dout, q, k, v, out, lse, **options)
        results.append((out, lse, grads.dq, grads.dk, grads.dv))
    assert not np.isfinite(results[0][0][1, :, 20:]).all()
    for one, per_core in zip(*results):
        np.testing.assert_array_equal(one, per_core)
    finite = ([0, 2], slice(None))
    check_attention(q[finite], k[finite], v[finite], results[0][0][finite],
                    results[0][1][finite], options if "alibi_slopes" not in options
                    else {"alibi_slopes": options["alibi_slopes"][[0, 2]]})


def test_long_or_single_sequences_take_the_general_path(rng, monkeypatch):
    # one element; more queries than a block
    rows, keys = numpy_engine.blocks(np.float32)
    for batch, lq, lk in (((1,), 16, 16), ((2,), rows + 1, 16)):
        q, k, v = data(rng, batch, lq, lk, 4)
        assert numpy_engine.stack_plan(_validate.validate_attention(q, k, v)) is None
    # without the compiled walk, a stack of one element: a block's queries against a tile's
    # keys fill the batched products' score tile (the compiled walk stacks them)
    width = numpy_engine.key_tile(rows, rows, keys)
    q, k, v = data(rng, (4,), rows, width, 4)
    p = _validate.validate_attention(q, k, v)
    assert numpy_engine.stack_plan(p)
    with without_compiled_walk(monkeypatch):
        assert numpy_engine.stack_plan(p) is None


def test_keys_past_one_tile_are_stacked(rng):
    # a block's queries against three tiles of keys
    rows, keys = numpy_engine.blocks(np.float32)
    width = numpy_engine.key_tile(rows // 2, rows, keys)
    q, k, v = data(rng, (8,), rows // 2, 2 * width + 5, 4)
    stacks = numpy_engine.stack_plan(_validate.validate_attention(q, k, v))
    assert stacks and sum(len(elements) for elements, *_ in stacks) == 8


def test_a_nan_stays_in_the_rows_that_see_it(rng):
    # element 1's value at key 5 is NaN: under the causal band, rows 0-4 of that element do
    # not see it and keep finite outputs; every other element is untouched
    q, k, v = data(rng, (4,), 12, 12, 8)
    v[1, 5, 0] = np.nan
    out = cuonline.attention(q, k, v, causal=True)
    assert np.isfinite(out[[0, 2, 3]]).all()
    assert np.isfinite(out[1, :5]).all()
    assert np.isnan(out[1, 5:, 0]).all() and np.isfinite(out[1, :, 1:]).all()
    check_attention(q[[0, 2, 3]], k[[0, 2, 3]], v[[0, 2, 3]], out[[0, 2, 3]], None,
                    {"causal": True})


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elements_not_finite_in_stacks_of_several_blocks_are_redone_in_place(
        rng, monkeypatch, dtype):
    # query blocks of 64 rows stacked over a batch of 3 x 4: the calling thread works out
    # each block's lse and redoes the elements whose outputs were not finite after every
    # stack has run; each such element must land at its own place of the batch and block
    monkeypatch.setattr(numpy_engine, "BLOCK_Q", 64)
    q, k, v = data(rng, (3, 4), 150, 150, 8, dtype)
    v[2, 1, 100, 0] = np.nan                       # element 9, seen by rows 100- (block 1, 2)
    q[0, 3, 140, 2] = np.inf                       # element 3, its row 140 only (block 2)
    p = _validate.validate_attention(q, k, v, causal=True)
    stacks = numpy_engine.stack_plan(p)
    assert len({(i0, i1) for _, i0, i1, _, _ in stacks}) == 3
    assert len({(e.start, e.stop) for e, *_ in stacks}) >= 2
    out, lse = cuonline.attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = per_element(
        monkeypatch, lambda: cuonline.attention(q, k, v, causal=True, return_lse=True))
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    assert np.isnan(out[2, 1, 100:, 0]).all() and np.isfinite(out[2, 1, :100]).all()
    assert np.isnan(out[0, 3, 140]).all() and np.isfinite(np.delete(out[0, 3], 140, 0)).all()
    clean = np.ones((3, 4), dtype=bool)
    clean[2, 1] = clean[0, 3] = False
    assert np.isfinite(out[clean]).all()
    check_attention(q[clean], k[clean], v[clean], out[clean], lse[clean], {"causal": True})


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["query", "key"])
def test_a_value_not_finite_reaches_only_the_gradients_it_belongs_to(rng, backward_machine,
                                                                     monkeypatch, bad, where):
    # element 1's query row 0 (or key 5) is not finite. Under the causal band query row 0
    # sees key 0 alone, and keys 8 on lie in key blocks of their own, where the row sees
    # nothing: a product over the block's rows would take 0 x inf = NaN into their dK. Rows
    # 0-4 do not see key 5, and keep finite dQ. The other elements are as their own calls
    # compute them.
    monkeypatch.setattr(backward_machine, "BLOCK_K", 8)
    q, k, v = data(rng, (4,), 24, 24, 8)
    (q if where == "query" else k)[1, 0 if where == "query" else 5, 2] = bad
    out, lse = cuonline.attention(q, k, v, causal=True, return_lse=True)
    grads = cuonline.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    if where == "query":
        assert np.isfinite(grads.dk[1, 1:]).all() and np.isfinite(grads.dq[1, 1:]).all()
    else:
        assert np.isfinite(grads.dq[1, :5]).all() and not np.isfinite(grads.dq[1, 5:]).all()
    for b in (0, 2, 3):
        alone = cuonline.attention_backward(np.ones_like(out[b]), q[b], k[b], v[b], out[b],
                                            lse[b], causal=True)
        for name in ("dq", "dk", "dv"):
            np.testing.assert_array_equal(getattr(grads, name)[b], getattr(alone, name))


@pytest.mark.parametrize("where", ["q", "dout", "k", "lse"])
def test_a_compiled_stack_stops_at_the_first_element_not_finite(rng, backward_machine,
                                                                monkeypatch, where):
    # the backward's stack kernel checks each element's operands before its tiles: the
    # elements before the first one that is not finite (or has a row that sees no key) are
    # done, nothing of that one (its key blocks before the bad key included), and that one
    # and those after are left to the caller's careful loop
    monkeypatch.setattr(backward_machine, "BLOCK_K", 4)
    q, k, v = data(rng, (5,), 16, 16, 8)
    options = {"causal": True, "q_offset": -1} if where == "lse" else {"causal": True}
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    dout = np.ones_like(out)
    if where == "lse":                   # rows past the keys' diagonal see none: -inf lse
        bad = 0
    else:
        bad = 2
        {"q": q, "dout": dout, "k": k}[where][bad, 13, 1] = np.inf     # key block 3
    bp = _validate.validate_attention_backward(dout, q, k, v, out, lse, **options)
    p = bp.forward
    buffers = backward_machine._gradient_buffers(
        {name: t.padded(1) for name, t in bp.targets.items()}, p.acc_dtype)
    sums = backward_machine.RowSums(p)
    done = backward_machine._compiled_stack(bp, ElementRun((5,), 0, 5), buffers, sums)
    assert done == (bad, 0)
    assert (sums.sums[:bad] > 0).all() and (sums.sums[bad:] == 0).all()


@pytest.mark.parametrize("where", [None, "k", "lse"])
def test_a_stack_zeroes_the_gradient_slots_it_owns(rng, backward_machine, monkeypatch, where):
    # the engine hands a stack of elements with slots of their own its gradient buffers
    # unzeroed: whatever they held, the gradients come out the same, whether the kernel
    # does every element, stops at one (a key not finite) or does none (a row with no key)
    monkeypatch.setattr(backward_machine, "BLOCK_K", 4)
    q, k, v = data(rng, (5,), 16, 16, 8)
    options = {"causal": True, "q_offset": -1} if where == "lse" else {"causal": True}
    if where == "k":
        k[2, 13, 1] = np.inf
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    bp = _validate.validate_attention_backward(np.ones_like(out), q, k, v, out, lse, **options)
    shapes = {name: t.padded(1) for name, t in bp.targets.items()}
    task = (ElementRun((5,), 0, 5), "stack", None, None)
    results = []
    for fill in (0.0, np.nan, 7.0):
        buffers = backward_machine._gradient_buffers(shapes, bp.forward.acc_dtype, False)
        for buffer in buffers.values():
            buffer[...] = fill
        backward_machine._run_task(bp, task, buffers, backward_machine.RowSums(bp.forward))
        results.append(buffers)
    for name in shapes:
        np.testing.assert_array_equal(results[1][name], results[0][name])
        np.testing.assert_array_equal(results[2][name], results[0][name])
    grads = cuonline.attention_backward(np.ones_like(out), q, k, v, out, lse, **options)
    np.testing.assert_array_equal(results[0]["k"], grads.dk)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_grouped_query_heads_in_16_bits(rng, dtype):
    # keys and values shared by 4 query heads (a zero-stride batch axis), Dv != D, float16
    # inputs accumulated in float32
    q = rng.standard_normal((2, 4, 40, 16)).astype(dtype)
    k = rng.standard_normal((2, 1, 50, 16)).astype(dtype)
    v = rng.standard_normal((2, 1, 50, 24)).astype(dtype)
    assert numpy_engine.stack_plan(_validate.validate_attention(q, k, v, causal=True))
    out, lse = cuonline.attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    check_attention(q, k, v, out, lse, {"causal": True})


# --------------------------------------------------------------------------------------------
# the backward: stacks of the groups that share no gradient slot


@pytest.fixture
def backward_machine(monkeypatch):
    """The backward's stacks planned alike on every machine (512 x 256 tiles, 2 cores)."""
    from cuonline.engines import numpy_backward

    monkeypatch.setattr(numpy_backward, "BLOCK_Q", 512)
    monkeypatch.setattr(numpy_backward, "BLOCK_K", 256)
    monkeypatch.setattr(numpy_backward, "workers", lambda: 2)
    return numpy_backward


def backward_plan(backward, q, k, v, **options):
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    bp = _validate.validate_attention_backward(out, q, k, v, out, lse, **options)
    return backward._plan(bp.forward, bp.targets)


def test_backward_stacks_split_the_batch_evenly_and_keep_groups_whole(rng, backward_machine):
    q, k, v = data(rng, (2, 6), 40, 40, 8)
    tasks = backward_plan(backward_machine, q, k, v, causal=True)
    assert [part for _, part, _, _ in tasks] == ["stack", "stack"]
    assert [elements for elements, _, _, _ in tasks] == [list(np.ndindex(2, 6))[:6],
                                                         list(np.ndindex(2, 6))[6:]]
    # keys shared by the 3 heads of each of 4 groups: a group's heads add into one dK slot
    # and stay in one stack, in C order
    q = rng.standard_normal((4, 3, 40, 8)).astype(np.float32)
    k = v = rng.standard_normal((4, 1, 40, 8)).astype(np.float32)
    tasks = backward_plan(backward_machine, q, k, v)
    assert [elements for elements, _, _, _ in tasks] == [list(np.ndindex(4, 3))[:6],
                                                         list(np.ndindex(4, 3))[6:]]


@pytest.mark.parametrize("options", [{"bias": np.zeros((8, 8))}, {"softcap": 5.0},
                                     {"kv_lengths": np.array([3, 8, 8, 8])}], ids=str)
def test_backward_score_terms_take_a_task_per_group(rng, backward_machine, options):
    q, k, v = data(rng, (4,), 8, 8, 4)
    assert {part for _, part, _, _ in backward_plan(backward_machine, q, k, v, **options)} == {
        "all"}


def test_backward_stacks_hold_what_fits_their_copies(rng, backward_machine, monkeypatch):
    """Elements of several tiles stack too, as many as their copies of q, dO and O allow
    (SLICE_BYTES); an element past that alone is a task of its own."""
    q, k, v = data(rng, (4,), 600, 700, 4)                # 2 x 3 tiles each
    tasks = backward_plan(backward_machine, q, k, v)
    assert [(part, len(elements)) for elements, part, _, _ in tasks] == [("stack", 2)] * 2
    monkeypatch.setattr(backward_machine, "SLICE_BYTES", 600 * 12 * 4 * 2 - 1)
    tasks = backward_plan(backward_machine, q, k, v)
    assert [(part, len(elements)) for elements, part, _, _ in tasks] == [("all", 1)] * 4


@pytest.mark.parametrize("options", [{"causal": True, "q_offset": -20},
                                     {"window": (0, 0), "q_offset": 30}], ids=str)
def test_a_finite_lse_for_rows_that_see_no_key_is_refused(rng, backward_machine, options):
    """No row sees a key (a stack has no tile at all): an lse of zeros gets the check's
    ValueError naming lse, not a failure inside the stack."""
    q, k, v = data(rng, (4,), 6, 8, 8)
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    assert np.isneginf(lse).all()
    assert {part for _, part, _, _ in backward_plan(backward_machine, q, k, v, **options)} == {
        "stack"}
    with pytest.raises(ValueError, match="`lse` must be the one attention returned"):
        cuonline.attention_backward(np.ones_like(out), q, k, v, out, np.zeros_like(lse),
                                    **options)


def test_longer_sequences_stack_each_query_block(rng, monkeypatch):
    # 1100 queries: blocks of 512, 512 and 76 rows, each stacked over the 6 elements (2
    # stacks of 3: one per core); under the causal band each block sees the keys up to its
    # last row's diagonal
    q, k, v = data(rng, (2, 3), 1100, 1100, 8)
    p = _validate.validate_attention(q, k, v, causal=True)
    stacks = numpy_engine.stack_plan(p)
    elements = list(np.ndindex(2, 3))
    assert [(i0, i1, j0, j1) for _, i0, i1, j0, j1 in stacks] == [
        (0, 512, 0, 512), (0, 512, 0, 512), (512, 1024, 0, 1024), (512, 1024, 0, 1024),
        (1024, 1100, 0, 1100), (1024, 1100, 0, 1100)]
    assert all(members == elements[:3] or members == elements[3:] for members, *_ in stacks)
    out, lse = cuonline.attention(q, k, v, causal=True, return_lse=True)
    check_attention(q, k, v, out, lse, {"causal": True})
    single = per_element(monkeypatch, lambda: cuonline.attention(q, k, v, causal=True,
                                                                 return_lse=True))
    np.testing.assert_array_equal(out, single[0])
    np.testing.assert_array_equal(lse, single[1])


def test_query_blocks_past_the_keys_are_left_as_they_are(rng):
    # a window band that lets the last block see no key: it gets no stack, and its rows
    # 0 and -inf
    q, k, v = data(rng, (4,), 1200, 600, 8)
    options = {"q_offset": 0, "window": (0, 0)}    # row i sees key i only
    stacks = numpy_engine.stack_plan(_validate.validate_attention(q, k, v, **options))
    assert sorted({(i0, i1) for _, i0, i1, _, _ in stacks}) == [(0, 512), (512, 1024)]
    out, lse = cuonline.attention(q, k, v, return_lse=True, **options)
    assert (out[:, 600:] == 0).all() and (lse[:, 600:] == -np.inf).all()
    check_attention(q, k, v, out, lse, options)


@pytest.mark.parametrize("case", ["one element", "kv_lengths", "a bias", "no compiled walk"])
def test_query_blocks_without_stacks(rng, monkeypatch, case):
    # a stack of one element, per-element key ranges, a score term, no compiled walk: the
    # general path's task per element and query block
    batch = (1,) if case == "one element" else (4,)
    q, k, v = data(rng, batch, 1100, 700, 8)
    options = {"kv_lengths": np.array([700, 300, 5, 640])} if case == "kv_lengths" else (
        {"bias": np.zeros((1100, 700), np.float32)} if case == "a bias" else {})
    p = _validate.validate_attention(q, k, v, **options)
    if case == "no compiled walk":
        with without_compiled_walk(monkeypatch):
            assert numpy_engine.stack_plan(p) is None
    else:
        assert numpy_engine.stack_plan(p) is None
