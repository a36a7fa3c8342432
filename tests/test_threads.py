"""The NumPy engine's threads: ``workers=``, BLAS's thread count under concurrent calls, and
``os.fork()`` after a threaded call."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import threadpoolctl

import cuonline
from cuonline.engines import numpy as numpy_engine

# 2 batch elements x 300 queries = 4 tasks (query blocks of 256): the threaded path
POOL_SHAPE = (2, 300, 16)
needs_cores = pytest.mark.skipif(numpy_engine.workers() < 2,
                                 reason="default workers thread only with 2 or more cores")


def blas_threads():
    """The thread counts of the BLAS libraries loaded, but for MKL on its sequential layer
    (cuonline's products, ``cuonline.engines.cpu_blas``): it has no threads to hold."""
    return [info["num_threads"] for info in threadpoolctl.threadpool_info()
            if info["user_api"] == "blas" and info.get("threading_layer") != "sequential"]


def data(rng, batch, lq, lk, d, dtype=np.float32):
    return (rng.standard_normal(batch + (lq, d)).astype(dtype),
            rng.standard_normal(batch + (lk, d)).astype(dtype),
            rng.standard_normal(batch + (lk, d)).astype(dtype))


# --------------------------------------------------------------------------------------------
# fork


FORK_SCRIPT = """
import os, sys, time
import numpy as np
import cuonline

kwargs = {kwargs}
x = np.random.default_rng(0).standard_normal({shape}, dtype=np.float32)
expected = cuonline.attention(x, x, x, **kwargs)       # starts the parent's pool threads
pid = os.fork()
if pid == 0:
    ok = np.array_equal(cuonline.attention(x, x, x, **kwargs), expected)
    os._exit(0 if ok else 3)
# a child stuck waiting for its parent's threads must fail the test, not hang it
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        code = os.waitstatus_to_exitcode(status)
        print("child exit", code)
        sys.exit(code)
    time.sleep(0.02)
os.kill(pid, 9)
os.waitpid(pid, 0)
print("child hung in cuonline.attention")
sys.exit(1)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
@pytest.mark.parametrize("workers", [pytest.param(None, marks=needs_cores), 3])
def test_a_forked_child_runs_threaded_attention(workers):
    kwargs = {} if workers is None else {"workers": workers}
    script = FORK_SCRIPT.format(kwargs=kwargs, shape=POOL_SHAPE)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# BLAS threads


@pytest.mark.parametrize("workers", [pytest.param(None, marks=needs_cores), 4])
def test_concurrent_calls_leave_the_blas_thread_count_as_it_was(rng, workers):
    # the NumPy engine's first call loads numba, which loads SciPy's BLAS beside NumPy's: a
    # second library for threadpoolctl, so count after one call (run alone, this test is first)
    cuonline.attention(*data(rng, (), 5, 40, 16))
    before = blas_threads()
    if not before or min(before) < 2:
        pytest.skip(f"BLAS runs on {before} threads here: a reset to 1 would not show")
    kwargs = {} if workers is None else {"workers": workers}
    # a mix: threaded calls, multi-task calls on one worker, single-task calls (BLAS left
    # alone), from 8 threads released at once so that the calls overlap
    q, k, v = data(rng, POOL_SHAPE[:1], POOL_SHAPE[1], POOL_SHAPE[1], POOL_SHAPE[2])
    small = data(rng, (), 5, 40, 16)
    calls = [(q, k, v, kwargs), (*small, {}), (q, k, v, {"workers": 1} if workers else {})]
    expected = [cuonline.attention(a, b, c, **kw) for a, b, c, kw in calls]
    barrier = threading.Barrier(8)
    errors = []

    def client(n):
        try:
            barrier.wait()
            for i in range(12):
                a, b, c, kw = calls[(n + i) % len(calls)]
                got = cuonline.attention(a, b, c, **kw)
                np.testing.assert_array_equal(got, expected[(n + i) % len(calls)])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    clients = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=120)
    assert blas_threads() == before
    assert not errors, errors


def test_a_call_from_a_living_thread_leaves_openblas_to_the_user(rng):
    # threadpoolctl lets one thread at a time set OpenBLAS's thread count; a call run on a
    # thread that stays alive (a pool's) must not keep that hold, or the user's own limits
    # would do nothing afterwards
    from concurrent.futures import ThreadPoolExecutor

    q, k, v = data(rng, POOL_SHAPE[:1], POOL_SHAPE[1], POOL_SHAPE[1], POOL_SHAPE[2])
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(cuonline.attention, q, k, v, workers=2).result()
        counts = blas_threads()
        if not counts or max(counts) < 2:
            pytest.skip(f"BLAS runs on {counts} threads here: a limit to 1 would not show")
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            assert blas_threads() == [1] * len(counts)
        assert blas_threads() == counts


def test_a_failing_task_raises_in_the_caller_and_restores_blas(rng, monkeypatch):
    before = blas_threads()
    real = numpy_engine._attend

    def attend(p, b, i0, i1, j_lo, j_hi):
        if i0 > 0:
            raise RuntimeError("task failed")
        return real(p, b, i0, i1, j_lo, j_hi)

    monkeypatch.setattr(numpy_engine, "_attend", attend)
    monkeypatch.setattr(numpy_engine, "stack_plan", lambda p: None)  # a task per block
    q, k, v = data(rng, (3,), 600, 100, 8)
    with pytest.raises(RuntimeError, match="task failed"):
        cuonline.attention(q, k, v, workers=2)
    assert blas_threads() == before
    monkeypatch.setattr(numpy_engine, "_attend", real)
    assert cuonline.attention(q, k, v, workers=2).shape == (3, 600, 8)   # the pool still works


@pytest.mark.parametrize("library", ["openblas", "mkl"], indirect=True)
def test_stacks_hold_numpys_blas_only_where_their_products_could_thread(library, rng,
                                                                        monkeypatch):
    # a call's tasks hold NumPy's BLAS to one thread where they may call a BLAS that threads
    # (OpenBLAS, which the compiled stacks then call too); compiled stacks whose products go
    # to MKL's sequential layer leave it as the user set it (no hold and release a call)
    from cuonline.engines import cpu_runtime

    seen = []
    real = numpy_engine.StackWalks.call

    def call(self, *args, **kwargs):
        run = real(self, *args, **kwargs)
        return lambda: (seen.append(blas_threads()), run())[1]

    monkeypatch.setattr(numpy_engine.StackWalks, "call", call)
    monkeypatch.setattr(numpy_engine, "cores_for", lambda scores, products: 2)
    q, k, v = data(rng, (4,), 40, 40, 8)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        counts = blas_threads()
        if not counts or max(counts) < 2:
            pytest.skip(f"BLAS runs on {counts} threads here: a hold to 1 would not show")
        out = cuonline.attention(q, k, v, workers=2)
        assert len(seen) == 2                                  # two stacks, each compiled
        if library == "openblas":
            assert all(set(threads) == {1} for threads in seen)
        else:
            assert seen == [counts, counts]
        counts = blas_threads()
        assert max(counts) == 2
        for hold in (True, False):
            seen = cpu_runtime.run_tasks(range(2), lambda i: blas_threads(), 2, hold_blas=hold)
            assert seen == ([[1] * len(counts)] * 2 if hold else [counts] * 2)
    np.testing.assert_array_equal(out, cuonline.attention(q, k, v, workers=1))


# --------------------------------------------------------------------------------------------
# workers=


CASES = {
    "many blocks": ((3,), 600, 700, {}),
    "few queries, split keys": ((), 5, 3000, {}),
    "one task": ((), 200, 500, {}),
    "options": ((2, 2), 300, 1100, {"causal": True, "kv_lengths": np.array([1000, 7])}),
}


@pytest.mark.parametrize("case", CASES)
def test_results_do_not_depend_on_workers(rng, case):
    batch, lq, lk, options = CASES[case]
    q, k, v = data(rng, batch, lq, lk, 32)
    ref_out, ref_lse = cuonline.attention(q, k, v, workers=1, return_lse=True, **options)
    cpus = os.cpu_count()
    for workers in (None, 2, 3, 7, -1, -cpus):
        out, lse = cuonline.attention(q, k, v, workers=workers, return_lse=True, **options)
        np.testing.assert_array_equal(out, ref_out, err_msg=f"workers={workers}")
        np.testing.assert_array_equal(lse, ref_lse, err_msg=f"workers={workers}")


def _busiest(monkeypatch, call, expected):
    """The most tasks that ran at the same time during ``call()``. Each task waits (up to a
    few seconds) until ``expected`` run at once, so that a slow thread start cannot hide one."""
    real = numpy_engine._attend
    changed = threading.Condition()
    state = {"now": 0, "max": 0}

    def attend(*args):
        with changed:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
            changed.notify_all()
            changed.wait_for(lambda: state["max"] >= expected, timeout=5)
        try:
            return real(*args)
        finally:
            with changed:
                state["now"] -= 1

    monkeypatch.setattr(numpy_engine, "_attend", attend)
    call()
    monkeypatch.setattr(numpy_engine, "_attend", real)
    return state["max"]


@pytest.mark.parametrize("workers, threads", [(1, 1), (2, 2), (5, 5), (None, 3), (-1, None)])
def test_workers_is_the_number_of_threads(rng, monkeypatch, workers, threads):
    monkeypatch.setattr(numpy_engine, "workers", lambda: 3)     # "all cores" = 3 here
    monkeypatch.setattr(numpy_engine, "stack_plan", lambda p: None)  # a task per block
    if threads is None:
        threads = os.cpu_count()
    q, k, v = data(rng, (4,), 520, 64, 8)                         # 4 x 3 = 12 tasks
    expected = min(threads, 12)
    seen = _busiest(monkeypatch, lambda: cuonline.attention(q, k, v, workers=workers), expected)
    assert seen == expected


BAD_WORKERS = [
    (0, ValueError, r"`workers` must be a positive int, a negative int >= -os.cpu_count\(\) "
                    r"or None, got 0"),
    (-(os.cpu_count() + 1), ValueError,
     rf"`workers` counts back from os.cpu_count\(\) = {os.cpu_count()} when negative, so it "
     rf"must be >= -{os.cpu_count()}, got -{os.cpu_count() + 1}"),
    (1.5, TypeError, r"`workers` must be an int or None, got float 1.5"),
    (True, TypeError, r"`workers` must be an int or None, got bool True"),
    ("2", TypeError, r"`workers` must be an int or None, got str '2'"),
]


@pytest.mark.parametrize("value, error, message", BAD_WORKERS)
def test_bad_workers_name_the_argument(rng, value, error, message):
    q, k, v = data(rng, (), 4, 5, 3)
    with pytest.raises(error, match=message):
        cuonline.attention(q, k, v, workers=value)


def test_workers_takes_numpy_integers(rng):
    q, k, v = data(rng, (2,), 300, 30, 8)
    np.testing.assert_array_equal(cuonline.attention(q, k, v, workers=np.int64(2)),
                                  cuonline.attention(q, k, v, workers=1))



@pytest.mark.parametrize("workers", [1, 2])
def test_the_longest_tasks_start_first(rng, monkeypatch, workers):
    # causal: the lower query blocks see more keys; the pool starts them first so that no
    # thread is left alone with a long task at the end, and the results stay in place
    monkeypatch.setattr(numpy_engine, "BLOCK_Q", 64)
    monkeypatch.setattr(numpy_engine, "stack_plan", lambda p: None)  # a task per block
    q, k, v = data(rng, (2,), 400, 400, 16)
    expected = cuonline.attention(q, k, v, causal=True, workers=1)
    real, started, lock = numpy_engine._attend, [], threading.Lock()

    def attend(p, b, i0, i1, j_lo, j_hi):
        with lock:
            started.append((i1 - i0) * (j_hi - j_lo))
        return real(p, b, i0, i1, j_lo, j_hi)

    monkeypatch.setattr(numpy_engine, "_attend", attend)
    out = cuonline.attention(q, k, v, causal=True, workers=workers)
    np.testing.assert_array_equal(out, expected)
    assert len(started) == 2 * 7
    # one thread: exactly in decreasing order; two: a task may be logged just before the one
    # the other thread took a moment earlier, never before a task two places earlier
    slack = workers - 1
    assert all(started[n] >= max(started[n + 1 + slack:], default=0)
               for n in range(len(started))), started


@pytest.mark.parametrize("count, most, cores, lengths", [
    (64, 21, 2, [16] * 4),            # not 21, 21, 21 and 1: one core would do 42
    (64, 100, 2, [32, 32]),
    (10, 4, 2, [2, 3, 2, 3]),         # each core 5
    (6, 2, 2, [2, 2, 2]),             # not 1, 2, 1, 2: a run of one is no stack
    (3, 8, 4, [1, 1, 1]),             # fewer elements than 2 cores: no stacks
    (6, 8, 4, [2, 2, 2]),
    (7, 0, 1, [1] * 7),
])
def test_stacks_give_every_core_the_same_share(count, most, cores, lengths):
    from cuonline.engines.cpu_runtime import stacks_of

    runs = stacks_of(count, most, cores)
    assert [z - a for a, z in runs] == lengths
    assert runs[0][0] == 0 and runs[-1][1] == count
    assert all(a == z0 for (_, z0), (a, _) in zip(runs, runs[1:]))


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4), (1, 5, 1)], ids=str)
def test_element_runs_read_as_the_lists_of_their_elements(shape):
    from cuonline.engines.cpu_blas import batch_addresses
    from cuonline.engines.cpu_runtime import ElementRun

    elements = list(np.ndindex(*shape))
    for a, z in [(0, len(elements)), (1, len(elements) - 1), (2, 2)]:
        run, want = ElementRun(shape, a, z), elements[a:z]
        assert len(run) == len(want) and list(run) == want and run == want
        assert [run[i] for i in range(-len(want), len(want))] == want + want
        assert run[1:-1] == want[1:-1] and run[::2] == want[::2]
        with pytest.raises(IndexError):
            run[len(want)]
        assert run.indices().tolist() == [list(e) for e in want]
        # the addresses a compiled stack reads, broadcast axes (length 1) included
        x = np.zeros(tuple(1 if n == 3 else n for n in shape) + (2, 3), np.float32)
        lead = [n == 1 for n in x.shape[:len(shape)]]
        np.testing.assert_array_equal(
            batch_addresses(x, run),
            [x[tuple(0 if one else i for i, one in zip(e, lead))].ctypes.data for e in want])
        # the run as one slice: a view of a C-ordered array, None where the axes do not merge
        y = np.arange(math.prod(shape) * 6.0).reshape(shape + (2, 3))
        view = run.view(y)
        assert np.shares_memory(view, y) or not len(want)
        np.testing.assert_array_equal(view, [y[e] for e in want] or np.empty((0, 2, 3)))
        if shape == (2, 3, 4) and len(want):     # heads before batch in memory
            assert run.view(y.transpose(1, 0, 2, 3, 4).copy().transpose(1, 0, 2, 3, 4)) is None
        # addresses by the run's step where the axes merge, by the index where they do not,
        # and a broadcast batch read as the elements' own views
        apart = y.transpose(1, 0, 2, 3, 4).copy().transpose(1, 0, 2, 3, 4) if len(shape) == 3 else y
        for arr in (y, y[..., ::-1, :], apart):
            np.testing.assert_array_equal(batch_addresses(arr, run),
                                          [arr[e].ctypes.data for e in want])
        shared = y[(slice(0, 1),) * len(shape)]              # every batch axis of length 1
        np.testing.assert_array_equal(run.view(shared), [shared.reshape(2, 3)] * len(want)
                                      or np.empty((0, 2, 3)))
