"""The CUDA-emulation runtime (cuonline.testing.emulate + cuda_cpu.h) on small kernels of its own.

Every kernel result is compared with NumPy, in both execution modes; mutants and misuse must be
caught (wrong answer, data race report or a clear error).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from support import needs_emulation

from cuonline.testing import emulate

KERNELS = Path(__file__).parent / "emulation_kernels"
MODES = ["fibers", "threads"]
FULL = 0xFFFFFFFF


pytestmark = [needs_emulation, pytest.mark.slow]   # the fast tier leaves it out


def _source(name: str) -> str:
    return (KERNELS / name).read_text()


@pytest.fixture(scope="module", params=MODES)
def basic(request):
    return emulate.compile_module(_source("basic.cu"), mode=request.param)


# ------------------------------------------------------------------------------------------------
# Kernels against NumPy


def test_strided_axpy_with_grid_tail(basic):
    n, stride = 1000, 3
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n * stride).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    expected = np.float32(2.5) * x[::stride] + y
    args = (x, y, np.float32(2.5), np.int32(n), np.int32(stride))
    basic.get_function("strided_axpy")(8, 128, args)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("threads", [32, 64, 256])
def test_block_sum_through_shared_memory(basic, threads):
    n = 5 * threads - 7
    x = np.random.default_rng(1).integers(-50, 50, n).astype(np.float32)  # exact sums
    out = np.full(5, np.nan, np.float32)
    basic.get_function("block_sum")(5, threads, (x, out, np.int32(n)))
    padded = np.zeros(5 * threads, np.float32)
    padded[:n] = x
    np.testing.assert_array_equal(out, padded.reshape(5, threads).sum(axis=1))


def _memory_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_launch_keeps_no_fiber_stacks_mapped():
    # Every emulated module is a library of its own; stacks kept per module after a launch
    # (two mappings each, the guard page splits them) added up over a test run to the kernel's
    # limit of 65,530 mappings. A launch now unmaps its stacks when it returns. A module of its
    # own (the comment), loaded before counting, launched here first.
    module = emulate.compile_module(_source("basic.cu") + "\n// fiber stack mappings\n",
                                    mode="fibers")
    threads = 256
    x = np.zeros(threads, np.float32)
    out = np.zeros(1, np.float32)
    function = module.get_function("block_sum")
    before = _memory_mappings()
    function(1, threads, (x, out, np.int32(threads)))
    assert _memory_mappings() - before < threads // 4


def _shuffle_oracle(kind: str, b: int, width: int, nthreads: int, values: np.ndarray):
    """The CUDA programming guide's description, written independently of the PTX formula."""
    out = np.empty_like(values)
    for t in range(nthreads):
        warp, lane = divmod(t, 32)
        seg = lane // width * width
        if kind == "idx":
            src = seg + b % width
        elif kind == "up":
            src = lane - b if lane - seg >= b else lane
        elif kind == "down":
            src = lane + b if lane - seg + b < width else lane
        else:  # xor: later groups are out of reach, earlier ones are not
            src = lane ^ b
            if src >= seg + width:
                src = lane
        g = warp * 32 + src
        out[t] = values[g] if g < nthreads else -1  # missing lanes read the poison
    return out


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("kind", ["idx", "up", "down", "xor"])
def test_shuffles_follow_ptx_rules(basic, kind, width):
    nthreads = 96
    values = np.arange(1000, 1000 + nthreads, dtype=np.int32)
    fn = basic.get_function("shuffle_probe")
    code = ["idx", "up", "down", "xor"].index(kind)
    for b in sorted({0, 1, 3, width // 2, width - 1, width, 5, 17, 31}):
        out = np.zeros(nthreads, np.int32)
        fn(1, nthreads, (values, out, np.int32(code), np.int32(b), np.int32(width)))
        np.testing.assert_array_equal(
            out, _shuffle_oracle(kind, b, width, nthreads, values), err_msg=f"{kind} b={b}"
        )


def test_shuffles_in_a_partial_last_warp_read_poison(basic):
    nthreads = 40  # warp 1 has lanes 0-7 only
    values = np.arange(nthreads, dtype=np.int32)
    out = np.zeros(nthreads, np.int32)
    args = (values, out, np.int32(2), np.int32(4), np.int32(32))  # down by 4
    basic.get_function("shuffle_probe")(1, nthreads, args)
    expected = _shuffle_oracle("down", 4, 32, nthreads, values)
    np.testing.assert_array_equal(out, expected)
    assert (out[36:] == -1).all()


@pytest.mark.parametrize("width", [4, 32])
def test_shuffles_of_8_byte_types(basic, width):
    n = 64
    rng = np.random.default_rng(2)
    xd = rng.integers(-1000, 1000, n).astype(np.float64) * 0.5
    xl = rng.integers(-(2**40), 2**40, n).astype(np.int64)
    od, ol = np.zeros(n), np.zeros(n, np.int64)
    basic.get_function("warp_sums")(2, 32, (xd, xl, od, ol, np.int32(width)))
    seg = lambda a: np.repeat(a.reshape(-1, width).sum(axis=1), width)  # noqa: E731
    np.testing.assert_array_equal(od, seg(xd))
    np.testing.assert_array_equal(ol, seg(xl))


def test_votes(basic):
    n = 96
    pred = np.zeros(n, np.int32)
    pred[[0, 5, 31]] = 1  # warp 0: some
    pred[32:64] = 1  # warp 1: all
    ballot, anyv, allv = np.zeros(n, np.uint32), np.zeros(n, np.int32), np.zeros(n, np.int32)
    basic.get_function("votes")(1, n, (pred, ballot, anyv, allv))
    np.testing.assert_array_equal(ballot[:32], (1 << 0) | (1 << 5) | (1 << 31))
    np.testing.assert_array_equal(ballot[32:64], FULL)
    np.testing.assert_array_equal(ballot[64:], 0)
    np.testing.assert_array_equal(anyv, np.repeat([1, 1, 0], 32))
    np.testing.assert_array_equal(allv, np.repeat([0, 1, 0], 32))


def test_never_written_shared_memory_reads_as_poison(basic):
    blocks, threads = 3, 64
    out = np.zeros(blocks * threads, np.float32)
    iout = np.zeros(blocks * threads, np.int32)
    basic.get_function("read_unwritten_shared")(blocks, threads, (out, iout))
    even = np.arange(blocks * threads) % 2 == 0
    assert (out[even] == 1).all() and (iout[even] == 7).all()
    assert np.isnan(out[~even]).all() and (iout[~even] == -1).all()


def test_dynamic_shared_memory_is_sized_per_launch_and_poisoned(basic):
    threads, blocks = 128, 3
    x = np.arange(threads * blocks, dtype=np.float32)
    y = np.zeros_like(x)
    fn = basic.get_function("reverse_dynamic")
    fn(blocks, threads, (x, y, np.int32(0)), shared_mem=threads * 4)
    np.testing.assert_array_equal(y, x.reshape(blocks, threads)[:, ::-1].ravel())
    # Thread 0 reads one slot past what the block wrote: inside the buffer, never written.
    fn(blocks, threads, (x, y, np.int32(1)), shared_mem=2 * threads * 4)
    assert np.isnan(y[::threads]).all()


def test_dynamic_shared_memory_above_48k_needs_the_attribute(basic):
    fn = basic.get_function("reverse_dynamic")
    x = np.zeros(32, np.float32)
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        fn(1, 32, (x, x.copy(), np.int32(0)), shared_mem=64 * 1024)
    fn.max_dynamic_shared_size_bytes = 64 * 1024
    fn(1, 32, (x, x.copy(), np.int32(0)), shared_mem=64 * 1024)
    fn.max_dynamic_shared_size_bytes = 48 * 1024


def _bf16_reference(f: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 by picking the nearer neighbour (ties to even)."""
    bits = f.view(np.uint32)
    with np.errstate(invalid="ignore", over="ignore"):
        return _bf16_reference_unchecked(f, bits)


def _bf16_reference_unchecked(f, bits):
    lo = bits & np.uint32(0xFFFF0000)
    hi = lo + np.uint32(0x10000)
    mag = np.abs(f.astype(np.float64))
    dlo = np.abs(mag - np.abs(lo.view(np.float32).astype(np.float64)))
    dhi = np.abs(np.abs(hi.view(np.float32).astype(np.float64)) - mag)
    take_hi = (dhi < dlo) | ((dhi == dlo) & ((lo >> 16) & 1 == 1))
    out = np.where(take_hi, hi, lo) >> 16
    return np.where(np.isnan(f), 0x7FFF, out).astype(np.uint16)


def test_16_bit_conversions_are_exact(basic):
    n = 65536
    bits = np.arange(n, dtype=np.uint16)
    rng = np.random.default_rng(3)
    halves = bits.view(np.float16).astype(np.float32)
    f = np.concatenate([halves[:32768], rng.standard_normal(20000).astype(np.float32) * 1e3,
                        (rng.standard_normal(12768) * 1e-6).astype(np.float32)])
    f[:8] = [65504, 65519.996, 65520, 2.0**-24, 2.0**-25, 2.0**-25 * 1.5, np.inf, np.nan]
    from_half, from_bf16 = np.zeros(n, np.float32), np.zeros(n, np.float32)
    to_half, to_bf16 = np.zeros(n, np.float16), np.zeros(n, np.uint16)
    # __half* needs float16; __nv_bfloat16* takes uint16 bits (NumPy has no bfloat16).
    with pytest.raises(TypeError, match="__half\\* but the array has dtype uint16"):
        basic.get_function("convert16")(
            256, 256, (bits, from_half, from_bf16, f, to_bf16, to_bf16, np.int32(n))
        )
    basic.get_function("convert16")(
        256, 256, (bits, from_half, from_bf16, f, to_half, to_bf16, np.int32(n))
    )
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(from_half), nan)
    np.testing.assert_array_equal(from_half[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    np.testing.assert_array_equal(from_bf16.view(np.uint32), bits.astype(np.uint32) << 16)
    fnan = np.isnan(f)
    with np.errstate(over="ignore"):  # values beyond 65520 round to inf, as intended
        ref_half = f[~fnan].astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(to_half.view(np.uint16)[~fnan], ref_half)
    assert (to_half.view(np.uint16)[fnan] == 0x7FFF).all()
    np.testing.assert_array_equal(to_bf16, _bf16_reference(f))


def test_atomics(basic):
    n = 1000
    icount, fsum, dsum = np.zeros(1, np.int32), np.zeros(1, np.float32), np.zeros(1, np.float64)
    basic.get_function("atomics")(8, 128, (icount, fsum, dsum, np.int32(n)))
    assert icount[0] == n and fsum[0] == n and dsum[0] == n * (n - 1) / 2


def test_math_intrinsics(basic):
    x = np.array([0.7], np.float32)
    out = np.zeros(10, np.float32)
    basic.get_function("math_probe")(1, 1, (x, out))
    v = np.float64(x[0])
    expected = [2**v, np.exp(v), 1 / np.sqrt(v), 1.5, 0.25, 7, -np.inf, 1 / v, np.tanh(v), 1]
    np.testing.assert_allclose(out, np.array(expected, np.float32), rtol=2e-7)


def test_multidimensional_grid_and_block(basic):
    grid, block = (3, 2), (4, 5)
    w, h = grid[0] * block[0], grid[1] * block[1]
    out = np.zeros((h, w, 4), np.int32)
    basic.get_function("coords")(grid, block, (out,))
    gy, gx = np.mgrid[0:h, 0:w]
    np.testing.assert_array_equal(out[..., 0], gx // 4)
    np.testing.assert_array_equal(out[..., 1], gy // 5)
    np.testing.assert_array_equal(out[..., 2], gx % 4)
    np.testing.assert_array_equal(out[..., 3], gy % 5)


@pytest.fixture(scope="module", params=MODES)
def templates(request):
    return emulate.compile_module(_source("templates.cu"), mode=request.param)


def test_shared_memory_in_templates_and_helpers(templates):
    x = np.random.default_rng(4).integers(-9, 9, (5, 300)).astype(np.float32)
    out = np.zeros(5, np.float32)
    templates.get_function("row_sums_f32_t64")(5, 64, (x, out, np.int32(300)))
    np.testing.assert_array_equal(out, x.sum(axis=1))
    xd, od = x.astype(np.float64), np.zeros(5)
    templates.get_function("row_sums_f64_t128")(5, 128, (xd, od, np.int32(300)))
    np.testing.assert_array_equal(od, xd.sum(axis=1))


def test_poison_reaches_template_and_inline_shared_memory(templates):
    blocks, threads = 2, 64
    out, iout = np.zeros(blocks * threads, np.float32), np.zeros(blocks * threads, np.int32)
    templates.get_function("template_poison")(blocks, threads, (out, iout))
    even = np.arange(blocks * threads) % 2 == 0
    assert (out[even] == 1).all() and np.isnan(out[~even]).all()
    assert (iout[even] == 5).all() and (iout[~even] == -1).all()
    assert templates.static_shared_bytes >= 64 * 4 * 2


def test_extern_shared_is_the_dynamic_buffer(templates):
    out = np.zeros(32, np.float32)
    templates.get_function("extern_dynamic")(1, 32, (out,), shared_mem=32 * 4)
    np.testing.assert_array_equal(out, np.arange(32)[::-1])


def test_struct_and_half_parameters_by_value(templates):
    import ctypes

    class Params(ctypes.Structure):
        _fields_ = [("n", ctypes.c_int), ("scale", ctypes.c_float), ("shift", ctypes.c_double)]

    out = np.zeros(8, np.float32)
    fn = templates.get_function("by_value")
    fn(1, 8, (Params(6, 2.0, 0.5), np.float16(0.25), out))
    np.testing.assert_array_equal(out, [0.75, 2.75, 4.75, 6.75, 8.75, 10.75, 0, 0])
    with pytest.raises(TypeError, match="16-byte struct but got a 4-byte"):
        fn(1, 8, ((ctypes.c_int * 1)(), np.float16(0), out))


def test_both_modes_give_identical_results():
    outs = []
    for mode in MODES:
        mod = emulate.compile_module(_source("basic.cu"), mode=mode)
        out = np.zeros(4 * 128, np.float32)
        mod.get_function("barrier_loop")(4, 128, (out, np.int32(10)))
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    t = np.arange(128)
    np.testing.assert_array_equal(outs[0][:128], 10 * ((t + 1) % 128) + 45)


# ------------------------------------------------------------------------------------------------
# Bugs and misuse are caught


def test_mutant_without_syncthreads_gives_a_wrong_sum():
    mod = emulate.compile_module(_source("block_sum_nosync.cu"), mode="fibers")
    x = np.ones(256, np.float32)
    out = np.zeros(1, np.float32)
    mod.get_function("block_sum")(1, 256, (x, out, np.int32(256)))
    assert out[0] != 256


def test_deadlock_is_reported_in_fibers_mode():
    mod = emulate.compile_module(_source("misuse.cu"), mode="fibers")
    out = np.zeros(64, np.int32)
    with pytest.raises(emulate.EmulationError, match=r"deadlock in block \(0,0,0\).*16 missing"):
        mod.get_function("divergent_barrier")(1, 64, (out,))
    # The module stays usable after a failed launch.
    mod.get_function("shuffle_after_exit")(1, 32, (out,))


def test_partial_masks_and_bad_widths_are_refused():
    mod = emulate.compile_module(_source("misuse.cu"), mode="fibers")
    out = np.zeros(32, np.int32)
    with pytest.raises(emulate.EmulationError, match="mask 0x0000ffff"):
        mod.get_function("partial_mask")(1, 32, (out,))
    with pytest.raises(emulate.EmulationError, match="width 12"):
        mod.get_function("bad_width")(1, 32, (out,))


def test_reading_an_exited_lane_gives_poison():
    mod = emulate.compile_module(_source("misuse.cu"), mode="fibers")
    out = np.zeros(32, np.int32)
    mod.get_function("shuffle_after_exit")(1, 32, (out,))
    np.testing.assert_array_equal(out[:8], np.arange(8, 16))
    np.testing.assert_array_equal(out[8:16], -1)


def _run_python(code: str, env: dict[str, str], timeout: float = 120):
    root = str(Path(emulate.__file__).resolve().parents[2])
    env = dict(env)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [emulate.tsan_python(), "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_watchdog_reports_a_deadlock_in_threads_mode():
    code = f"""
        import numpy as np
        from cuonline.testing import emulate
        mod = emulate.compile_module(open({str(KERNELS / "misuse.cu")!r}).read(), mode="threads")
        mod.get_function("divergent_barrier")(1, 64, (np.zeros(64, np.int32),))
    """
    env = dict(os.environ, CUONLINE_EMULATE_WATCHDOG_S="1")
    proc = _run_python(code, env)
    assert proc.returncode != 0
    assert "watchdog" in proc.stderr and "missing" in proc.stderr, proc.stderr[-2000:]


def test_python_scalars_and_mistyped_arguments_are_refused(basic):
    fn = basic.get_function("strided_axpy")
    x, y = np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="argument 3 of strided_axpy is a int.*NumPy scalar"):
        fn(1, 8, (x, y, np.float32(1), 8, np.int32(1)))
    with pytest.raises(TypeError, match="argument 2 .* float passed by value"):
        fn(1, 8, (x, y, 1.0, np.int32(8), np.int32(1)))
    with pytest.raises(TypeError, match="argument 3 .* int but got int64"):
        fn(1, 8, (x, y, np.float32(1), np.int64(8), np.int32(1)))
    with pytest.raises(TypeError, match="argument 0 .* float\\* but the array has dtype float64"):
        fn(1, 8, (x.astype(np.float64), y, np.float32(1), np.int32(8), np.int32(1)))
    ro = y.copy()
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="argument 1 .* read-only"):
        fn(1, 8, (x, ro, np.float32(1), np.int32(8), np.int32(1)))
    with pytest.raises(TypeError, match="takes 5 arguments"):
        fn(1, 8, (x, y))
    with pytest.raises(TypeError, match="args must be a tuple"):
        fn(1, 8, [x, y, np.float32(1), np.int32(8), np.int32(1)])
    with pytest.raises(ValueError, match="block"):
        fn(1, 2048, (x, y, np.float32(1), np.int32(8), np.int32(1)))


def test_float64_scalar_for_a_double_parameter(basic):
    # np.float64 subclasses Python float; it is an explicit C double and must be accepted.
    x = np.arange(4, dtype=np.float64)
    basic.get_function("scale_double")(1, 4, (x, np.float64(0.5)))
    np.testing.assert_array_equal(x, [0, 0.5, 1, 1.5])
    with pytest.raises(TypeError, match="is a double passed by value"):
        basic.get_function("scale_double")(1, 4, (x, 0.5))


def test_null_pointer_and_read_only_input_are_accepted(basic):
    x = np.arange(8, dtype=np.float32)
    x.flags.writeable = False  # const float* may be read-only
    y = np.zeros(8, np.float32)
    basic.get_function("strided_axpy")(1, 8, (x, y, np.float32(1), np.int32(8), np.int32(1)))
    np.testing.assert_array_equal(y, x)
    # n = 0: every thread returns before touching x, which may then be null.
    basic.get_function("strided_axpy")(1, 8, (None, y, np.float32(1), np.int32(0), np.int32(1)))


def test_unknown_function_name(basic):
    with pytest.raises(ValueError, match="'nope' is not defined.*strided_axpy"):
        basic.get_function("nope")


def test_compile_error_names_the_kernel_and_quotes_the_compiler():
    src = 'extern "C" __global__ void broken_kernel(float* x) { x[0] = undeclared_name; }\n'
    with pytest.raises(emulate.EmulationError, match=r"(?s)broken_kernel.*undeclared_name"):
        emulate.compile_module(src)


def test_source_without_entry_points_is_refused():
    with pytest.raises(ValueError, match="no extern"):
        emulate.compile_module("__device__ float f(float x) { return x; }\n")


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(emulate, "_compiler_info", None)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(RuntimeError, match="C\\+\\+20 compiler"):
        emulate.compile_module('extern "C" __global__ void k(int* p) {}\n')


def test_modules_are_cached_in_process_and_on_disk(tmp_path, monkeypatch):
    src = _source("basic.cu")
    assert emulate.compile_module(src) is emulate.compile_module(src)
    mod = emulate.compile_module(src)
    assert mod.path.exists() and mod.path.suffix == ".so"


def test_tsan_requires_a_preloaded_runtime():
    if emulate.running_under_tsan():
        pytest.skip("this interpreter runs under TSan")
    with pytest.raises(RuntimeError, match="tsan_environment"):
        emulate.compile_module(_source("basic.cu"), tsan=True)


# ------------------------------------------------------------------------------------------------
# ThreadSanitizer


def _tsan_env():
    try:
        return emulate.tsan_environment()
    except RuntimeError as exc:
        pytest.skip(str(exc))


_TSAN_SCRIPT = """
    import numpy as np
    from cuonline.testing import emulate
    assert emulate.running_under_tsan()
    mod = emulate.compile_module(open({path!r}).read(), tsan=True)
    x = np.arange(128, dtype=np.float32)
    out = np.zeros(2, np.float32)
    mod.get_function("block_sum")(2, 64, (x, out, np.int32(128)))
    print("RESULT", out.tolist())
    if {everything}:  # the runtime's own paths: exchange buffer, votes, dynamic smem, atomics
        v = np.arange(64, dtype=np.int32)
        o = np.zeros(64, np.int32)
        for kind in range(4):
            args = (v, o, np.int32(kind), np.int32(1), np.int32(8))
            mod.get_function("shuffle_probe")(2, 32, args)
        b, a, l = np.zeros(64, np.uint32), np.zeros(64, np.int32), np.zeros(64, np.int32)
        mod.get_function("votes")(1, 64, (v % 2, b, a, l))
        y = np.zeros(128, np.float32)
        mod.get_function("reverse_dynamic")(2, 64, (x, y, np.int32(0)), shared_mem=256)
        c, f, d = np.zeros(1, np.int32), np.zeros(1, np.float32), np.zeros(1)
        mod.get_function("atomics")(2, 64, (c, f, d, np.int32(100)))
        print("CHECKS", (y == x.reshape(2, 64)[:, ::-1].ravel()).all(), c[0], f[0], d[0])
"""


@pytest.mark.parametrize(
    "kernel, racy", [("basic.cu", False), ("block_sum_nosync.cu", True)], ids=["correct", "mutant"]
)
def test_thread_sanitizer(kernel, racy):
    env = _tsan_env()
    script = _TSAN_SCRIPT.format(path=str(KERNELS / kernel), everything=not racy)
    proc = _run_python(script, env, timeout=300)
    reported = "WARNING: ThreadSanitizer" in proc.stderr
    if racy:
        assert reported and "data race" in proc.stderr, proc.stderr[-3000:]
    else:
        assert not reported and proc.returncode == 0, proc.stderr[-3000:]
        assert "RESULT [2016.0, 6112.0]" in proc.stdout
        assert "CHECKS True 100 100.0 4950.0" in proc.stdout
